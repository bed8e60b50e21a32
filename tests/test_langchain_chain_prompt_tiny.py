"""create_epic_rag_chain on the tiny random Llama: a prompt with {context} and {question} (or {input})
becomes the RagRequest template, and output="dict" gives create_retrieval_chain's {input, context, answer}."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_core")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.prompts import PromptTemplate  # noqa: E402
from langchain_core.runnables import RunnableLambda  # noqa: E402

from epic_rag.integrations.langchain import ChatEpic, create_epic_rag_chain  # noqa: E402

DOCS = [Document(page_content="def add(a, b):\n    return a + b\n"), Document(page_content="class Stack: pass\n")]


class _Seen(list):
    """The requests the engine got."""


@pytest.fixture()
def seen(tiny_engine, monkeypatch) -> _Seen:
    got = _Seen()
    real = tiny_engine.stream_events

    def stream_events(req, **kw):
        got.append(req)
        return real(req, **kw)

    monkeypatch.setattr(tiny_engine, "stream_events", stream_events)
    return got


@pytest.fixture()
def llm(tiny_engine, seen):
    model = ChatEpic(model="tiny", max_tokens=3)
    model._engine = tiny_engine  # not adopt_engine: leave the process's shared engine alone
    return model


def _retriever():
    return RunnableLambda(lambda q: list(DOCS))


def test_chain_prompt_string_is_the_rag_request_template_and_input_names_the_question(llm, seen):
    chain = create_epic_rag_chain(_retriever(), llm=llm, prompt="Context:\n{context}\nQ: {input}\nA:")
    msg = chain.invoke("which adds?")
    assert msg.response_metadata["documents"] == DOCS
    req = seen[-1]
    assert req.template == "Context:\n{context}\nQ: {question}\nA:" and req.question == "which adds?"
    assert req.chunks == [d.page_content for d in DOCS]


def test_chain_takes_a_prompt_template_and_refuses_one_without_the_slots(llm, seen):
    chain = create_epic_rag_chain(_retriever(), llm=llm, prompt=PromptTemplate.from_template("{context}|{question}"))
    chain.invoke("which adds?")
    assert seen[-1].template == "{context}|{question}"
    with pytest.raises(ValueError, match="context"):
        create_epic_rag_chain(_retriever(), llm=llm, prompt="Answer {question}")


def test_chain_without_a_prompt_keeps_the_engines_default(llm, seen):
    create_epic_rag_chain(_retriever(), llm=llm).invoke("which adds?")
    assert seen[-1].template is None


def test_chain_dict_output_is_create_retrieval_chains_shape(llm):
    chain = create_epic_rag_chain(_retriever(), llm=llm, output="dict")
    out = chain.invoke({"input": "which adds?", "user": "me"})
    assert set(out) == {"input", "user", "context", "answer"} and out["context"] == DOCS
    assert isinstance(out["answer"], str) and out["input"] == "which adds?"
    assert chain.invoke("which adds?")["input"] == "which adds?"


def test_chain_dict_stream_yields_input_then_context_then_answer_pieces(llm):
    parts = list(create_epic_rag_chain(_retriever(), llm=llm, output="dict").stream("which adds?"))
    assert parts[0] == {"input": "which adds?"} and parts[1] == {"context": DOCS}
    assert parts[2:] and all(set(p) == {"answer"} for p in parts[2:])
    whole = create_epic_rag_chain(_retriever(), llm=llm, output="dict").invoke("which adds?")["answer"]
    assert "".join(p["answer"] for p in parts[2:]) == whole


async def test_chain_dict_output_async(llm):
    chain = create_epic_rag_chain(_retriever(), llm=llm, output="dict")
    out = await chain.ainvoke("which adds?")
    assert out["context"] == DOCS and isinstance(out["answer"], str)
    parts = [p async for p in chain.astream("which adds?")]
    assert parts[1] == {"context": DOCS} and "".join(p.get("answer", "") for p in parts[2:]) == out["answer"]


def test_chat_epic_template_needs_chunks(llm):
    with pytest.raises(ValueError, match="template"):
        llm.invoke("hi", template="{context}{question}")
