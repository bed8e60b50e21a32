"""RAG with LangChain on epic_rag: documents compiled once, linked in any order at query time.

    .venv/bin/python examples/langchain_rag.py
    .venv/bin/python examples/langchain_rag.py --docs builtin:pydoc --question "What does shutil.copytree do?"
    .venv/bin/python examples/langchain_rag.py --chain lcel     # the usual prompt | model recipe with ChatEpic

Retrieval: FAISS (langchain-community) with the packaged all-MiniLM-L6-v2 embeddings (langchain-huggingface).
Needs the extras retrieval + langchain (scripts/setup.sh installs them).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep vLLM's INFO lines out of the answers

QUESTIONS = ["What does heapq.heappush do?", "What does heapq.heappop do?"]
DEFAULT_MODULES = ["json", "heapq", "bisect"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", default=None,
                    help="builtin:pydoc, a file or a folder (default: pydoc of json, heapq, bisect)")
    ap.add_argument("--question", action="append", help="ask this (repeatable; default: two heapq questions)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chain", choices=["epic", "lcel"], default="epic",
                    help="epic: create_epic_rag_chain (documents passed as chunks); "
                         "lcel: retriever | prompt | ChatEpic (compiled documents found in the prompt)")
    args = ap.parse_args(argv)

    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_huggingface import HuggingFaceEmbeddings

    from epic_rag import EngineConfig, EpicEngine
    from epic_rag.corpus import chunk_document, load_documents, pydoc_documents
    from epic_rag.embeddings import minilm_dir
    from epic_rag.integrations.langchain import ChatEpic, compile_documents, create_epic_rag_chain

    docs = pydoc_documents(DEFAULT_MODULES) if args.docs is None else load_documents(args.docs)
    print(f"starting the engine ({args.model})...", file=sys.stderr)
    engine = EpicEngine(EngineConfig(model=args.model))
    try:
        documents = [Document(page_content=c.text, metadata={"doc": c.doc, "index": c.index},
                              id=f"{c.doc}#{c.index}")
                     for d in docs for c in chunk_document(d, engine.tokenizer, max_tokens=args.chunk_tokens)]
        t0 = time.perf_counter()
        compile_documents(documents, engine=engine)
        embeddings = HuggingFaceEmbeddings(model_name=str(minilm_dir()), model_kwargs={"device": "cpu"},
                                           encode_kwargs={"normalize_embeddings": True})
        retriever = FAISS.from_documents(documents, embeddings).as_retriever(search_kwargs={"k": args.top_k})
        print(f"ingested {len(documents)} chunks from {len(docs)} documents (compiled + embedded) in "
              f"{time.perf_counter() - t0:.1f} s", file=sys.stderr)

        if args.chain == "epic":
            chain = create_epic_rag_chain(retriever, engine=engine, max_tokens=args.max_tokens)
        else:
            prompt = ChatPromptTemplate.from_messages([
                ("system", "Answer the question from the context, briefly."),
                ("human", "Context:\n{context}\n\nQuestion: {question}")])
            chain = ({"context": retriever | (lambda ds: "\n\n".join(d.page_content for d in ds)),
                      "question": RunnablePassthrough()}
                     | prompt | ChatEpic(engine=engine, max_tokens=args.max_tokens))

        for q in args.question or QUESTIONS:
            print(f"\nQ: {q}\nA: ", end="", flush=True)
            full = None
            for chunk in chain.stream(q):
                print(chunk.content, end="", flush=True)
                full = chunk if full is None else full + chunk
            print()
            meta = full.response_metadata
            if "documents" in meta:
                print("   sources:", ", ".join(d.id or "?" for d in meta["documents"]))
            print(f"   ttft {meta['ttft_s'] * 1000:.0f} ms | linked {meta['linked_tokens']} / "
                  f"recomputed {meta['recomputed_tokens']} prompt tokens | chunks: {meta['chunk_hits']} hits, "
                  f"{meta['chunk_misses']} compiled now | policy {meta['policy']}")
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
