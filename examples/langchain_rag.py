"""RAG with LangChain on epic_rag: documents compiled once, linked in any order at query time.

    .venv/bin/python examples/langchain_rag.py
    .venv/bin/python examples/langchain_rag.py --docs builtin:pydoc --question "What does shutil.copytree do?"
    .venv/bin/python examples/langchain_rag.py --chain lcel     # the usual prompt | model recipe with ChatEpic

Retrieval: FAISS (langchain-community) with the packaged all-MiniLM-L6-v2 embeddings (langchain-huggingface).
Needs the extras retrieval + langchain + examples (scripts/setup.sh installs them).
"""

from __future__ import annotations

import sys
import time

from _common import QUESTIONS, chunks, parse_args, print_figures, start


def main(argv: list[str] | None = None) -> int:
    def own(ap):
        ap.add_argument(
            "--chain",
            choices=["epic", "lcel"],
            default="epic",
            help="epic: create_epic_rag_chain (documents passed as chunks); "
            "lcel: retriever | prompt | ChatEpic (compiled documents found in the prompt)",
        )

    args = parse_args(__doc__, argv, own)

    from langchain_community.vectorstores import FAISS
    from langchain_core.documents import Document
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnablePassthrough
    from langchain_huggingface import HuggingFaceEmbeddings

    from epic_rag.embeddings import minilm_dir
    from epic_rag.integrations.langchain import ChatEpic, compile_documents, create_epic_rag_chain

    docs, engine = start(args)
    try:
        documents = [
            Document(page_content=c.text, metadata={"doc": c.doc, "index": c.index}, id=f"{c.doc}#{c.index}")
            for c in chunks(docs, engine, args)
        ]
        t0 = time.perf_counter()
        compile_documents(documents, engine=engine)
        embeddings = HuggingFaceEmbeddings(
            model_name=str(minilm_dir()),
            model_kwargs={"device": "cpu"},
            encode_kwargs={"normalize_embeddings": True},
        )
        retriever = FAISS.from_documents(documents, embeddings).as_retriever(search_kwargs={"k": args.top_k})
        print(
            f"ingested {len(documents)} chunks from {len(docs)} documents (compiled + embedded) in "
            f"{time.perf_counter() - t0:.1f} s",
            file=sys.stderr,
        )

        if args.chain == "epic":
            chain = create_epic_rag_chain(retriever, engine=engine, max_tokens=args.max_tokens)
        else:
            prompt = ChatPromptTemplate.from_messages(
                [
                    ("system", "Answer the question from the context, briefly."),
                    ("human", "Context:\n{context}\n\nQuestion: {question}"),
                ]
            )
            context = retriever | (lambda ds: "\n\n".join(d.page_content for d in ds))
            chain = (
                {"context": context, "question": RunnablePassthrough()}
                | prompt
                | ChatEpic(engine=engine, max_tokens=args.max_tokens)
            )

        for q in args.question or QUESTIONS:
            print(f"\nQ: {q}\nA: ", end="", flush=True)
            full = None
            for chunk in chain.stream(q):
                print(chunk.content, end="", flush=True)
                full = chunk if full is None else full + chunk
            print()
            meta = full.response_metadata
            print_figures(meta, [d.id or "?" for d in meta.get("documents", [])])
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
