"""LangChain on the real SmolLM2: the standard integration suite for ChatEpic, and RAG over FAISS
(langchain-community) with the packaged all-MiniLM-L6-v2 embeddings on Python's pydoc text."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("langchain_tests")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _langchain_flags import ChatEpicFlags  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import AIMessage, AIMessageChunk  # noqa: E402
from langchain_core.prompts import ChatPromptTemplate  # noqa: E402
from langchain_core.runnables import RunnablePassthrough  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from epic_rag.integrations import STAT_KEYS, set_shared_engine  # noqa: E402
from epic_rag.integrations.langchain import ChatEpic, compile_documents, create_epic_rag_chain  # noqa: E402

pytestmark = pytest.mark.smollm

PASSAGE = (
    "The secret passcode for the archive room is 7314. Only the head librarian may share it, and only "
    "with staff who have signed the archive register."
)


@pytest.fixture(autouse=True)
def _share_smol_engine(smol_engine):
    # ChatEpic objects the standard suite builds without engine= get this process's engine.
    set_shared_engine(smol_engine)
    yield


class TestChatEpicIntegration(ChatEpicFlags, ChatModelIntegrationTests):
    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m-instruct", "max_tokens": 12}

    @pytest.fixture
    def model(self, request):
        # A structured answer must close its JSON: the suite's structured-output tests get room for a joke.
        structured = "structured_output" in request.node.name or "json_mode" in request.node.name
        extra = getattr(request, "param", None) or {}
        params = {**self.standard_chat_model_params, **self.chat_model_params, **extra}
        return ChatEpic(**{**params, **({"max_tokens": 160} if structured else {})})

    @property
    def supports_json_mode(self) -> bool:
        # JSON mode works (any JSON object; test_structured_output_smollm.py), but SmolLM2-135M does not follow
        # keys asked for in prose: the suite's json_mode test nests {"setup": {"setup": ...}}. json_schema passes.
        return False

    @property
    def supported_usage_metadata_details(self) -> dict:
        # Linked prompt tokens (KV from compiled chunks) are reported as cache reads.
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        model = ChatEpic(**self.chat_model_params)
        model.engine.compile([PASSAGE])
        if stream:
            full = None
            for chunk in model.stream("What is the passcode?", chunks=[PASSAGE]):
                full = chunk if full is None else full + chunk
            msg = full
        else:
            msg = model.invoke("What is the passcode?", chunks=[PASSAGE])
        assert msg.usage_metadata["input_token_details"]["cache_read"] > 0
        return msg


# ---------------------------------------------------------------- RAG over FAISS
def _pydoc_documents(tokenizer) -> list[Document]:
    from epic_rag.corpus import chunk_document, pydoc_documents

    docs = []
    for d in pydoc_documents(["json", "heapq", "bisect"]):
        for c in chunk_document(d, tokenizer, max_tokens=192):
            docs.append(
                Document(page_content=c.text, metadata={"doc": c.doc, "index": c.index}, id=f"{c.doc}#{c.index}")
            )
    return docs


@pytest.fixture(scope="module")
def lc_retriever(smol_engine):
    from langchain_community.vectorstores import FAISS
    from langchain_huggingface import HuggingFaceEmbeddings

    from epic_rag.embeddings import minilm_dir

    docs = _pydoc_documents(smol_engine.tokenizer)
    compile_documents(docs, engine=smol_engine)  # compiled at ingest
    emb = HuggingFaceEmbeddings(
        model_name=str(minilm_dir()), model_kwargs={"device": "cpu"}, encode_kwargs={"normalize_embeddings": True}
    )
    store = FAISS.from_documents(docs, emb)
    return store.as_retriever(search_kwargs={"k": 2})


def _full(chunks):
    full = None
    for c in chunks:
        full = c if full is None else full + c
    return full


def test_lcel_rag_chain_streams_several_chunks_linked_from_cache(smol_engine, lc_retriever):
    chain = create_epic_rag_chain(lc_retriever, engine=smol_engine, max_tokens=32)
    chunks = list(chain.stream("What does heapq.heappush do?"))
    assert len(chunks) > 1 and all(isinstance(c, AIMessageChunk) for c in chunks)
    full = _full(chunks)
    meta = full.response_metadata
    assert set(STAT_KEYS) <= set(meta)
    assert meta["chunk_hits"] == 2 and meta["chunk_misses"] == 0 and meta["linked_tokens"] > 0
    assert [d.metadata["doc"] for d in meta["documents"]]
    assert full.text.strip()


def test_lcel_rag_chain_invoke_and_async_forms_report_linking(smol_engine, lc_retriever):
    chain = create_epic_rag_chain(lc_retriever, engine=smol_engine, max_tokens=16)
    msg = chain.invoke({"question": "How do I insert into a sorted list with bisect?"})
    assert isinstance(msg, AIMessage) and msg.text.strip()
    assert msg.response_metadata["chunk_hits"] == 2 and msg.response_metadata["chunk_misses"] == 0
    assert msg.usage_metadata["input_token_details"]["cache_read"] == msg.response_metadata["linked_tokens"]


async def test_lcel_rag_chain_ainvoke_and_astream(smol_engine, lc_retriever):
    chain = create_epic_rag_chain(lc_retriever, engine=smol_engine, max_tokens=16)
    msg = await chain.ainvoke("What does json.dumps return?")
    assert msg.response_metadata["chunk_misses"] == 0 and msg.response_metadata["chunk_hits"] == 2
    chunks = [c async for c in chain.astream("What does json.dumps return?")]
    assert len(chunks) > 1
    assert _full(chunks).response_metadata["ttft_s"] > 0


def test_stock_lcel_prompt_pipeline_links_compiled_documents(smol_engine, lc_retriever):
    # The usual LCEL recipe (retriever | format_docs -> prompt -> model): ChatEpic finds the compiled
    # page_content inside the rendered messages.
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")]
    )
    chain = (
        {
            "context": lc_retriever | (lambda ds: "\n\n".join(d.page_content for d in ds)),
            "question": RunnablePassthrough(),
        }
        | prompt
        | ChatEpic(engine=smol_engine, max_tokens=16)
    )
    msg = chain.invoke("What does heapq.heappop do?")
    meta = msg.response_metadata
    assert meta["chunk_hits"] == 2 and meta["chunk_misses"] == 0 and meta["linked_tokens"] > 0
    assert meta["policy"] == "legolink-16"


def test_retriever_piped_into_document_compiler_links_documents_never_compiled_at_ingest(smol_engine):
    # A store whose texts this process never compiled (as after loading one from disk): compiling at
    # retrieval time makes the stock prompt pipeline link them.
    from langchain_core.runnables import RunnableLambda

    from epic_rag.integrations.langchain import EpicDocumentCompiler

    docs = [
        Document("The Halvard ferry crosses the Sundby strait six times a day and carries up to forty cars."),
        Document("Tickets for the Halvard ferry are sold at the harbour kiosk, which opens at half past five."),
    ]
    assert not any(d.page_content in smol_engine.text_index for d in docs)
    retriever = RunnableLambda(lambda q: list(docs))  # stands in for any vector store's retriever
    prompt = ChatPromptTemplate.from_messages(
        [("system", "Answer from the context."), ("human", "Context:\n{context}\n\nQuestion: {question}")]
    )
    chain = (
        {
            "context": retriever
            | EpicDocumentCompiler(engine=smol_engine)
            | (lambda ds: "\n\n".join(d.page_content for d in ds)),
            "question": RunnablePassthrough(),
        }
        | prompt
        | ChatEpic(engine=smol_engine, max_tokens=12)
    )
    meta = chain.invoke("How many cars does the Halvard ferry carry?").response_metadata
    assert meta["chunk_hits"] == 2 and meta["chunk_misses"] == 0 and meta["linked_tokens"] > 0
