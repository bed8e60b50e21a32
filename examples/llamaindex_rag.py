"""RAG with a stock LlamaIndex query engine on epic_rag: chunks compiled at ingest, linked at query time.

    .venv/bin/python examples/llamaindex_rag.py
    .venv/bin/python examples/llamaindex_rag.py --docs builtin:pydoc --question "What does shutil.copytree do?"
    .venv/bin/python examples/llamaindex_rag.py --synthesizer epic     # nodes handed to the engine directly

Retrieval: FAISS (llama-index-vector-stores-faiss) with the packaged all-MiniLM-L6-v2 embeddings.
Needs the extras retrieval + llamaindex + examples (scripts/setup.sh installs them).
"""

from __future__ import annotations

import sys
import time
from typing import Any

from _common import QUESTIONS, chunks, parse_args, print_figures, start


def main(argv: list[str] | None = None) -> int:
    def own(ap):
        ap.add_argument(
            "--synthesizer",
            choices=["stock", "epic"],
            default="stock",
            help="stock: default query engine (prompt matching); epic: EpicSynthesizer (RagRequest)",
        )

    args = parse_args(__doc__, argv, own)

    import faiss
    from llama_index.core import Settings, StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.schema import TextNode
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
    from llama_index.vector_stores.faiss import FaissVectorStore

    from epic_rag.embeddings import minilm_dir
    from epic_rag.integrations.llamaindex import EpicChunkCompiler, EpicLLM, EpicSynthesizer

    docs, engine = start(args)
    try:
        Settings.llm = EpicLLM(engine=engine, max_tokens=args.max_tokens)
        Settings.embed_model = HuggingFaceEmbedding(model_name=str(minilm_dir()))
        nodes = [
            TextNode(
                text=c.text, id_=f"{c.doc}#{c.index}", metadata={"doc": c.doc}, excluded_embed_metadata_keys=["doc"]
            )
            for c in chunks(docs, engine, args)
        ]
        t0 = time.perf_counter()
        # Compile every node's LLM-visible text ("doc: ...\n\n<text>"), then embed it.
        pipeline = IngestionPipeline(transformations=[EpicChunkCompiler(engine=engine), Settings.embed_model])
        nodes = pipeline.run(nodes=nodes)
        print(
            f"ingested {len(nodes)} chunks from {len(docs)} documents (compiled + embedded) in "
            f"{time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )
        store = FaissVectorStore(faiss_index=faiss.IndexFlatIP(384))
        index = VectorStoreIndex(nodes, storage_context=StorageContext.from_defaults(vector_store=store))

        if args.synthesizer == "stock":
            query_engine = index.as_query_engine(similarity_top_k=args.top_k, streaming=True)
        else:
            query_engine = RetrieverQueryEngine(
                index.as_retriever(similarity_top_k=args.top_k), response_synthesizer=EpicSynthesizer(streaming=True)
            )

        # The stock engine's Response does not carry the LLM's figures: read them from its chat end event.
        class LastChat(BaseEventHandler):
            stats: dict = {}

            @classmethod
            def class_name(cls) -> str:
                return "LastChat"

            def handle(self, event: Any, **kwargs: Any) -> None:
                if isinstance(event, LLMChatEndEvent) and event.response is not None:
                    self.stats = dict(event.response.additional_kwargs)

        last = LastChat()
        get_dispatcher().add_event_handler(last)

        for q in args.question or QUESTIONS:
            print(f"\nQ: {q}\nA: ", end="", flush=True)
            response = query_engine.query(q)
            for piece in response.response_gen:
                print(piece, end="", flush=True)
            print()
            stats = response.metadata if args.synthesizer == "epic" else last.stats
            print_figures(stats, [n.node.node_id for n in response.source_nodes])
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
