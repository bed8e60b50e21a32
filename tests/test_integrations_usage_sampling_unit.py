"""Usage and sampling through EpicLLM and ChatEpic, on a scripted engine (no model): token usage lands where
LlamaIndex (`raw["usage"]`, TokenCountingHandler) and LangChain (`usage_metadata`, `token_usage`) read it,
sampling options reach the engine, and an unknown option is an error naming it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from epic_rag import EngineConfig
from epic_rag.types import Delta, Generation

LOGPROBS = [
    {
        "token_id": 7,
        "token": "Hi",
        "logprob": -0.1,
        "top_logprobs": [
            {"token_id": 7, "token": "Hi", "logprob": -0.1},
            {"token_id": 8, "token": "Ho", "logprob": -2},
        ],
    },
    {"token_id": 9, "token": "!", "logprob": -0.5, "top_logprobs": [{"token_id": 9, "token": "!", "logprob": -0.5}]},
]


class _Tok:
    chat_template = "x"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class ScriptedEngine:
    """Answers 'Hi!' (2 tokens) to a 30-token prompt of which 24 were linked; records every call's keywords."""

    def __init__(self) -> None:
        self.config = EngineConfig(model="smollm2-135m-instruct")
        self.tokenizer = _Tok()
        self.max_model_len = 8192
        self.calls: list[dict] = []

    def render_messages(self, messages):
        return [self.tokenizer.apply_chat_template(messages)]

    def prepare(self, request, **sampling):  # what EpicSynthesizer sizes a request with
        return SimpleNamespace(token_ids=[0] * 30)

    def _gen(self, sampling) -> Generation:
        return Generation(
            text="Hi!",
            token_ids=[7, 9],
            ttft_s=0.01,
            total_s=0.02,
            prompt_tokens=30,
            linked_tokens=24,
            recomputed_tokens=6,
            chunk_hits=2,
            chunk_misses=0,
            policy="legolink-16",
            finish_reason="stop",
            logprobs=LOGPROBS if sampling.get("logprobs") is not None else None,
        )

    def stream_events(self, request, **sampling):
        self.calls.append(sampling)
        yield Delta("Hi", [7], False, None, 0.0)
        yield Delta("!", [9], True, "stop", 0.0)
        yield self._gen(sampling)

    def generate(self, request, **sampling):
        return list(self.stream_events(request, **sampling))[-1]

    async def astream_events(self, request, **sampling):
        for ev in self.stream_events(request, **sampling):
            yield ev

    async def agenerate(self, request, **sampling):
        return self.generate(request, **sampling)


USAGE = {
    "prompt_tokens": 30,
    "completion_tokens": 2,
    "total_tokens": 32,
    "prompt_tokens_details": {"cached_tokens": 24},
}


@pytest.fixture()
def engine():
    return ScriptedEngine()


# ---------------------------------------------------------------------- LlamaIndex
li = pytest.importorskip("llama_index.core")


def _llm(engine, **kw):
    from epic_rag.integrations.llamaindex import EpicLLM

    llm = EpicLLM(model="smollm2-135m-instruct", **kw)
    llm._engine = engine  # not adopt_engine: the scripted engine must not become the process's shared one
    return llm


def test_epic_llm_responses_carry_openai_usage_with_linked_tokens_as_cached(engine):
    from llama_index.core.llms import ChatMessage

    llm = _llm(engine)
    assert llm.complete("q").raw == {"usage": USAGE}
    assert llm.chat([ChatMessage(role="user", content="q")]).raw == {"usage": USAGE}
    last = list(llm.stream_complete("q"))[-1]
    assert last.raw == {"usage": USAGE} and last.text == "Hi!"
    last = list(llm.stream_chat([ChatMessage(role="user", content="q")]))[-1]
    assert last.raw == {"usage": USAGE}


async def test_epic_llm_async_responses_carry_usage(engine):
    llm = _llm(engine)
    assert (await llm.acomplete("q")).raw == {"usage": USAGE}
    items = [r async for r in await llm.astream_complete("q")]
    assert items[-1].raw == {"usage": USAGE}


def test_token_counting_handler_counts_the_engines_tokens_not_tiktokens(engine):
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
    from llama_index.core.llms import ChatMessage

    counter = TokenCountingHandler(tokenizer=lambda s: [0] * 1000)  # a wrong count if it were used
    llm = _llm(engine, callback_manager=CallbackManager([counter]))
    llm.complete("q")
    llm.chat([ChatMessage(role="user", content="q")])
    assert counter.prompt_llm_token_count == 60 and counter.completion_llm_token_count == 4


@pytest.mark.parametrize("streaming", [False, True])
def test_epic_synthesizer_calls_are_epic_llm_chat_calls_seen_by_events_spans_and_token_counting(engine, streaming):
    from _llamaindex_events import caught
    from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
    from llama_index.core.instrumentation.events.llm import (
        LLMChatEndEvent,
        LLMChatInProgressEvent,
        LLMChatStartEvent,
    )
    from llama_index.core.schema import NodeWithScore, TextNode

    from epic_rag.integrations.llamaindex import EpicSynthesizer

    counter = TokenCountingHandler(tokenizer=lambda s: [0] * 1000)  # a wrong count if it were used
    synth = EpicSynthesizer(llm=_llm(engine), callback_manager=CallbackManager([counter]), streaming=streaming)
    with caught() as (events, spans):
        r = synth.synthesize("which adds?", [NodeWithScore(node=TextNode(text="def add(a, b): return a + b"))])
        text = "".join(r.response_gen) if streaming else r.response
    assert text == "Hi!" and r.metadata["chunk_hits"] == 2 and r.metadata["linked_tokens"] == 24
    (start,) = [e for e in events if isinstance(e, LLMChatStartEvent)]
    (end,) = [e for e in events if isinstance(e, LLMChatEndEvent)]
    assert start.messages[-1].content == "which adds?"
    assert start.additional_kwargs["chunks"] == ["def add(a, b): return a + b"]
    assert end.response.raw == {"usage": USAGE} and end.span_id == start.span_id
    assert any(isinstance(e, LLMChatInProgressEvent) for e in events) == streaming
    assert counter.prompt_llm_token_count == 30 and counter.completion_llm_token_count == 2
    names = {s.id_: s.id_.rsplit("-", 5)[0] for s in spans.completed_spans}
    (synth_span,) = [s for s in spans.completed_spans if names[s.id_] == "EpicSynthesizer.synthesize"]
    (get_span,) = [s for s in spans.completed_spans if names[s.id_] == "EpicSynthesizer.get_response"]
    chat = "EpicLLM.stream_chat" if streaming else "EpicLLM.chat"
    (chat_span,) = [s for s in spans.completed_spans if names[s.id_] == chat]
    assert get_span.parent_id == synth_span.id_ and chat_span.parent_id == get_span.id_
    assert chat_span.id_ == start.span_id


def test_epic_llm_passes_sampling_fields_additional_kwargs_and_per_call_options(engine):
    llm = _llm(engine, top_p=0.9, seed=5, additional_kwargs={"repetition_penalty": 1.1, "top_k": 40})
    llm.complete("q", top_k=10, min_p=0.05, presence_penalty=0.5, frequency_penalty=-0.5)
    got = engine.calls[-1]
    assert got["top_p"] == 0.9 and got["seed"] == 5 and got["repetition_penalty"] == 1.1
    assert got["top_k"] == 10 and got["min_p"] == 0.05  # per call wins over additional_kwargs
    assert got["presence_penalty"] == 0.5 and got["frequency_penalty"] == -0.5
    assert "logprobs" not in got


def test_epic_llm_logprobs_as_llamaindex_logprob_lists(engine):
    llm = _llm(engine, logprobs=True, top_logprobs=2)
    r = llm.complete("q")
    assert engine.calls[-1]["logprobs"] == 2
    assert [[lp.token for lp in alts] for alts in r.logprobs] == [["Hi", "Ho"], ["!"]]
    assert r.logprobs[0][0].logprob == -0.1 and r.logprobs[0][0].bytes == list(b"Hi")


def test_epic_llm_unknown_or_bad_options_are_errors_naming_them(engine):
    with pytest.raises(ValueError, match="'tools'"):
        _llm(engine).complete("q", tools=[{"type": "function"}])
    with pytest.raises(ValueError, match="'best_of'"):
        _llm(engine, additional_kwargs={"best_of": 2})
    with pytest.raises(ValueError, match="top_p"):
        _llm(engine).complete("q", top_p=1.5)
    assert engine.calls == []


# ---------------------------------------------------------------------- LangChain
lc = pytest.importorskip("langchain_core")


def _chat(engine, **kw):
    from epic_rag.integrations.langchain import ChatEpic

    m = ChatEpic(model="smollm2-135m-instruct", **kw)
    m._engine = engine
    return m


def test_chat_epic_usage_metadata_and_token_usage_as_chat_openai(engine):
    from langchain_core.messages import HumanMessage

    m = _chat(engine)
    msg = m.invoke("q")
    assert msg.usage_metadata == {
        "input_tokens": 30,
        "output_tokens": 2,
        "total_tokens": 32,
        "input_token_details": {"cache_read": 24},
    }
    assert msg.response_metadata["token_usage"] == USAGE
    assert msg.response_metadata["finish_reason"] == "stop"
    result = m.generate([[HumanMessage("q")]])
    assert result.llm_output["token_usage"] == USAGE


def test_chat_epic_stream_ends_with_usage(engine):
    m = _chat(engine)
    full = None
    for c in m.stream("q"):
        full = c if full is None else full + c
    assert full.content == "Hi!"
    assert full.usage_metadata["input_token_details"] == {"cache_read": 24}
    assert full.response_metadata["token_usage"] == USAGE


def test_chat_epic_passes_sampling_fields_model_kwargs_and_bound_options(engine):
    m = _chat(engine, top_p=0.8, model_kwargs={"seed": 3, "repetition_penalty": 1.2})
    m.bind(top_k=5, min_p=0.1).invoke("q")
    got = engine.calls[-1]
    assert got["top_p"] == 0.8 and got["seed"] == 3 and got["repetition_penalty"] == 1.2
    assert got["top_k"] == 5 and got["min_p"] == 0.1


def test_chat_epic_logprobs_in_response_metadata_as_chat_openai(engine):
    msg = _chat(engine, logprobs=True, top_logprobs=2).invoke("q")
    assert engine.calls[-1]["logprobs"] == 2
    content = msg.response_metadata["logprobs"]["content"]
    assert [t["token"] for t in content] == ["Hi", "!"]
    assert [a["token"] for a in content[0]["top_logprobs"]] == ["Hi", "Ho"]
    assert content[0]["bytes"] == list(b"Hi")


def test_chat_epic_unknown_options_are_errors_naming_them(engine):
    from epic_rag.integrations.langchain import ChatEpic

    with pytest.raises(ValueError, match="'top_pp'"):
        ChatEpic(model="smollm2-135m-instruct", top_pp=0.3)
    with pytest.raises(ValueError, match="'best_of'"):
        ChatEpic(model="smollm2-135m-instruct", model_kwargs={"best_of": 2})
    with pytest.raises(ValueError, match="'tools'"):
        _chat(engine).invoke("q", tools=[])
    with pytest.raises(ValueError, match="top_logprobs needs logprobs=True"):
        _chat(engine, logprobs=False, top_logprobs=3)
    assert engine.calls == []
