"""EpicSynthesizer on the tiny random Llama: its text_qa_template is exposed and replaceable through
get_prompts/update_prompts and reaches the engine as the RagRequest template; retrieved chunks are packed
to the context window (best first, whole) instead of the request failing."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")

from llama_index.core.prompts import PromptTemplate  # noqa: E402

from epic_rag.integrations.llamaindex import DEFAULT_TEXT_QA_TEMPLATE, EpicLLM, EpicSynthesizer  # noqa: E402
from epic_rag.prompt import DEFAULT_TEMPLATE  # noqa: E402


@pytest.fixture()
def synth(tiny_engine):
    llm = EpicLLM(model="tiny")
    llm._engine = tiny_engine  # not adopt_engine: leave the process's shared engine alone
    return EpicSynthesizer(llm=llm, max_tokens=4)


def _spy(engine, monkeypatch) -> list:
    seen = []
    real = engine.generate

    def generate(req, **kw):
        seen.append(req)
        return real(req, **kw)

    monkeypatch.setattr(engine, "generate", generate)
    return seen


def test_default_text_qa_template_is_the_engines_default_prompt(synth, tiny_engine, monkeypatch):
    prompts = synth.get_prompts()
    assert prompts["text_qa_template"].template == DEFAULT_TEXT_QA_TEMPLATE.template
    assert DEFAULT_TEXT_QA_TEMPLATE.template.replace("{context_str}", "{context}").replace(
        "{query_str}", "{question}"
    ) == (DEFAULT_TEMPLATE)
    seen = _spy(tiny_engine, monkeypatch)
    synth.get_response("which function adds?", ["def add(a, b): return a + b"])
    assert seen[-1].template is None  # the default: byte-identical to the prompt chunks are compiled behind


def test_update_prompts_sets_the_template_the_engine_renders(synth, tiny_engine, monkeypatch):
    tmpl = PromptTemplate("Context:\n{context_str}\nAnswer in {lang}: {query_str}").partial_format(lang="French")
    synth.update_prompts({"text_qa_template": tmpl})
    assert synth.get_prompts()["text_qa_template"].template == tmpl.template
    seen = _spy(tiny_engine, monkeypatch)
    synth.get_response("which function adds?", ["def add(a, b): return a + b"])
    assert seen[-1].template == "Context:\n{context}\nAnswer in French: {question}"


def test_a_template_without_the_slots_is_refused_when_set(synth):
    with pytest.raises(ValueError, match="context"):
        synth.update_prompts({"text_qa_template": PromptTemplate("Just {query_str}")})
    assert synth.get_prompts()["text_qa_template"].template == DEFAULT_TEXT_QA_TEMPLATE.template  # unchanged


def test_chunks_over_the_window_are_packed_best_first_instead_of_raising(synth, tiny_engine, monkeypatch):
    window = tiny_engine.max_model_len
    n_tok = len(tiny_engine.tokenizer.encode("alpha beta gamma delta " * 10, add_special_tokens=False))
    chunks = [f"chunk {i}: " + "alpha beta gamma delta " * 10 + "end" for i in range(2 * window // n_tok)]
    seen = _spy(tiny_engine, monkeypatch)
    synth.get_response("which chunk?", chunks)
    kept = seen[-1].chunks
    assert 0 < len(kept) < len(chunks) and kept == chunks[: len(kept)]  # a prefix, in retrieval order
    with pytest.raises(ValueError, match="context window"):  # the same request unpacked does not fit
        tiny_engine.prepare(seen[-1].__class__("which chunk?", chunks))


def test_a_first_chunk_longer_than_the_window_is_cut_to_fit(synth, tiny_engine, monkeypatch):
    huge = "alpha beta gamma delta " * tiny_engine.max_model_len
    seen = _spy(tiny_engine, monkeypatch)
    synth.get_response("which chunk?", [huge, "a second chunk"])
    (kept,) = seen[-1].chunks
    assert huge.startswith(kept.strip()[:100]) and len(kept) < len(huge)


def test_packing_does_not_hide_a_bad_chunk_behind_dropping_it(synth):
    with pytest.raises(ValueError, match="surrogate"):
        synth.get_response("which chunk?", ["fine text", "bad \ud800 text"])


# EpicLLM's chat keywords the synthesizer passes its packed chunks through (so the call is an ordinary,
# instrumented EpicLLM.chat): chunks= with system messages and one question makes a RagRequest.
def test_epic_llm_chat_with_chunks_sends_the_system_question_and_chunks_as_a_rag_request(
    synth, tiny_engine, monkeypatch
):
    from llama_index.core.base.llms.types import ChatMessage
    from llama_index.core.schema import NodeWithScore, TextNode

    seen = _spy(tiny_engine, monkeypatch)
    node = NodeWithScore(node=TextNode(text="def sub(a, b): return a - b", metadata={"doc": "ops.py"}), score=1.0)
    messages = [ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="which adds?")]
    r = synth._epic.chat(messages, chunks=["def add(a, b): return a + b", node], template="{context}Q: {question}")
    req = seen[-1]
    assert (req.question, req.system, req.template) == ("which adds?", "Be brief.", "{context}Q: {question}")
    assert req.chunks == ["def add(a, b): return a + b", "doc: ops.py\n\ndef sub(a, b): return a - b"]
    assert r.additional_kwargs["chunk_hits"] + r.additional_kwargs["chunk_misses"] == 2


def test_epic_llm_chunks_need_one_user_question_and_template_needs_chunks(synth):
    from llama_index.core.base.llms.types import ChatMessage

    two = [ChatMessage(role="user", content="a?"), ChatMessage(role="assistant", content="b")]
    with pytest.raises(ValueError, match="one user question"):
        synth._epic.chat(two, chunks=["some text"])
    with pytest.raises(ValueError, match="template= applies to a request with chunks="):
        synth._epic.chat([ChatMessage(role="user", content="a?")], template="{context}{question}")
    with pytest.raises(ValueError, match="unsupported option 'chunks'"):  # completion prompts take no chunks
        synth._epic.complete("a?", chunks=["some text"])
