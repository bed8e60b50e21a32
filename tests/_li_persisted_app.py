"""An existing LlamaIndex app in two processes, run by tests/test_llamaindex_persisted_fresh_process_smollm.py:

    python tests/_li_persisted_app.py build DIR   # index a few documents, compile their nodes into a disk
                                                  # chunk store, persist the index; exit
    python tests/_li_persisted_app.py query DIR   # a fresh process: load the index from storage, open the
                                                  # same store, ask two questions retrieving the same nodes

Each prints one JSON line (prefixed RESULT) with what the test checks.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

DOCS = {
    "orrin-built": "The Orrin lighthouse was built in 1874 on the Kestrel cliffs; its lamp is visible for 19 miles.",
    "orrin-keepers": "Keepers of the Orrin lighthouse served four-year terms and logged every passing ship by hand.",
    "mill": "The Dunmore windmill ground barley until 1952 and now houses a small museum of farm tools.",
    "ferry": "The Ashby ferry crossed the estuary twice a day and carried a brass bell instead of a horn.",
}
QUESTIONS = ("When was the Orrin lighthouse built?", "How long did Orrin lighthouse keepers serve?")


def _engine(folder: Path):
    from epic_rag import EngineConfig, EpicEngine

    return EpicEngine(
        EngineConfig(
            model="smollm2-135m-instruct",
            policy="legolink-16",
            max_model_len=2048,
            max_num_seqs=2,
            kv_cache_gib=1,
            dtype="float32",
            store=f"disk:{folder / 'chunks'}",
        )
    )


def _embeddings() -> None:
    from llama_index.core import Settings
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    from epic_rag.embeddings import minilm_dir

    Settings.embed_model = HuggingFaceEmbedding(model_name=str(minilm_dir()))


def _puts(engine) -> int:
    return int(sum(t["puts"] for t in engine.store.tier_stats().values()))


def build(folder: Path) -> dict[str, Any]:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.node_parser import SentenceSplitter

    from epic_rag.integrations.llamaindex import EpicChunkCompiler, node_llm_text

    _embeddings()
    engine = _engine(folder)
    try:
        docs = [Document(text=t, id_=k) for k, t in DOCS.items()]
        index = VectorStoreIndex.from_documents(
            docs,
            transformations=[
                SentenceSplitter(chunk_size=256),
                EpicChunkCompiler(engine=engine, neighbours=0),
            ],  # plain records: what a fresh process finds
        )
        index.storage_context.persist(persist_dir=str(folder / "index"))
        texts = [node_llm_text(n) for n in index.docstore.docs.values()]
        return {
            "node_texts": texts,
            "chunk_keys": {t: engine.text_index.get(t).key for t in texts},
            "store_keys": sorted(engine.store.keys()),
            "puts": _puts(engine),
        }
    finally:
        engine.shutdown()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def query(folder: Path) -> dict[str, Any]:
    from _llamaindex_events import EventCatcher
    from llama_index.core import StorageContext, load_index_from_storage
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.events.llm import LLMChatEndEvent, LLMCompletionEndEvent

    from epic_rag.integrations.llamaindex import EpicLLM, EpicNodeCompiler, node_llm_text

    ends = EventCatcher()
    get_dispatcher().add_event_handler(ends)
    log = _Lines()
    logger = logging.getLogger("epic_rag.engine.request")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(log)

    _embeddings()
    engine = _engine(folder)
    try:
        store_keys = sorted(engine.store.keys())
        index = load_index_from_storage(StorageContext.from_defaults(persist_dir=str(folder / "index")))
        llm = EpicLLM(engine=engine, max_tokens=8)
        qe = index.as_query_engine(llm=llm, similarity_top_k=2, node_postprocessors=[EpicNodeCompiler(engine=engine)])
        sources = []
        for q in QUESTIONS:
            r = qe.query(q)
            sources.append([node_llm_text(n.node) for n in r.source_nodes])
        llm.complete("Name a colour.", max_tokens=2)  # no chunk in it: a full prefill, which must say so
        return {
            "store_keys_before": store_keys,
            "store_keys_after": sorted(engine.store.keys()),
            "sources": sources,
            "source_keys": [[engine.text_index.get(t).key for t in s] for s in sources],
            "requests": [
                dict(e.response.additional_kwargs)
                for e in ends.events
                if isinstance(e, (LLMChatEndEvent, LLMCompletionEndEvent))
            ],
            "linked_nothing_log": [line for line in log.lines if "linked nothing" in line],
            "tiers": engine.store.tier_stats(),
            "puts": _puts(engine),
        }
    finally:
        engine.shutdown()


if __name__ == "__main__":
    step, folder = sys.argv[1], Path(sys.argv[2])
    out = {"build": build, "query": query}[step](folder)
    print("RESULT " + json.dumps(out), flush=True)
