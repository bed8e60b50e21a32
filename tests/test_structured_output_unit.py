"""Structured output without a model: `response_format` is checked and becomes vLLM's structured outputs,
ChatEpic.with_structured_output and EpicLLM.structured_predict ask the engine for the schema and parse its
answer (a scripted engine stands in; test_structured_output_smollm.py runs the real one)."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from epic_rag import EngineConfig
from epic_rag.sampling import check_response_format, check_sampling_options
from epic_rag.types import Delta, Generation


class Person(BaseModel):
    name: str
    age: int


SCHEMA_FMT = {"type": "json_schema", "json_schema": {"name": "Person", "schema": Person.model_json_schema()}}


# ---------------------------------------------------------------------- the option
def test_response_format_text_is_unconstrained_and_json_kinds_are_kept():
    assert check_response_format({"type": "text"}) is None
    assert check_sampling_options({"response_format": {"type": "text"}}) == {}
    assert check_response_format({"type": "json_object"}) == {"type": "json_object"}
    assert check_response_format(SCHEMA_FMT) == SCHEMA_FMT


@pytest.mark.parametrize(
    "fmt",
    ["json", {"type": "regex"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": "x"}}],
    ids=str,
)
def test_bad_response_format_is_an_error_naming_it(fmt):
    with pytest.raises(ValueError, match="response_format"):
        check_sampling_options({"response_format": fmt})


def test_request_inputs_turn_response_format_into_vllm_structured_outputs():
    from epic_rag.engine.vllm_api import request_inputs

    _, p = request_inputs([1, 2], "s", 8, 0.0, None, None, None, response_format=SCHEMA_FMT)
    assert p.structured_outputs.json == Person.model_json_schema()
    _, p = request_inputs([1, 2], "s", 8, 0.0, None, None, None, response_format={"type": "json_object"})
    assert p.structured_outputs.json_object is True
    _, p = request_inputs([1, 2], "s", 8, 0.0, None, None, None, top_p=0.5)
    assert p.structured_outputs is None


# ---------------------------------------------------------------------- the wrappers
class JsonEngine:
    """Answers `text` (one delta); records every call's sampling keywords."""

    def __init__(self, text: str) -> None:
        self.config = EngineConfig(model="smollm2-135m-instruct")
        self.max_model_len = 8192
        self.text = text
        self.calls: list[dict] = []

        class _Tok:
            chat_template = "x"

            def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
                return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

        self.tokenizer = _Tok()

    def render_messages(self, messages):
        return [self.tokenizer.apply_chat_template(messages)]

    def stream_events(self, request, **sampling):
        self.calls.append(sampling)
        yield Delta(self.text, [1], True, "stop", 0.0)
        yield Generation(self.text, [1], 0.01, 0.02, 10, 0, 10, 0, 0, "legolink-16", "stop")

    def generate(self, request, **sampling):
        return list(self.stream_events(request, **sampling))[-1]

    async def astream_events(self, request, **sampling):
        for ev in self.stream_events(request, **sampling):
            yield ev

    async def agenerate(self, request, **sampling):
        return self.generate(request, **sampling)


ADA = json.dumps({"name": "Ada", "age": 36})


def _chat(text: str):
    from epic_rag.integrations.langchain import ChatEpic

    model = ChatEpic(model="smollm2-135m-instruct")
    model._engine = JsonEngine(text)  # not adopt_engine: a scripted engine must not become the shared one
    return model


def test_chat_epic_with_structured_output_constrains_to_the_schema_and_parses_pydantic_and_dicts():
    model = _chat(ADA)
    assert model.with_structured_output(Person).invoke("who?") == Person(name="Ada", age=36)
    fmt = model._engine.calls[-1]["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] == "Person"
    assert fmt["json_schema"]["schema"]["required"] == ["name", "age"]
    assert model.with_structured_output(Person.model_json_schema()).invoke("who?") == {"name": "Ada", "age": 36}
    assert [c for c in model.with_structured_output(Person).stream("who?")][-1] == Person(name="Ada", age=36)


def test_chat_epic_json_mode_asks_for_any_json_object():
    model = _chat(ADA)
    assert model.with_structured_output(None, method="json_mode").invoke("who?") == {"name": "Ada", "age": 36}
    assert model._engine.calls[-1]["response_format"] == {"type": "json_object"}


def test_chat_epic_include_raw_gives_the_message_and_the_parsing_error():
    ok = _chat(ADA).with_structured_output(Person, include_raw=True).invoke("who?")
    assert ok["parsed"] == Person(name="Ada", age=36) and ok["parsing_error"] is None
    assert ok["raw"].content == ADA and ok["raw"].usage_metadata["input_tokens"] == 10
    bad = _chat('{"name": "Ada"}').with_structured_output(Person, include_raw=True).invoke("who?")
    assert bad["parsed"] is None and bad["parsing_error"] is not None and bad["raw"].content == '{"name": "Ada"}'


def test_chat_epic_with_structured_output_refuses_unknown_methods_and_arguments():
    model = _chat(ADA)
    with pytest.raises(ValueError, match="method"):
        model.with_structured_output(Person, method="xml")
    with pytest.raises(ValueError, match="tools"):
        model.with_structured_output(Person, tools=[])
    with pytest.raises(ValueError, match="schema"):
        model.with_structured_output(None, method="json_schema")


def _llm(text: str):
    from epic_rag.integrations.llamaindex import EpicLLM

    llm = EpicLLM(model="smollm2-135m-instruct")
    llm._engine = JsonEngine(text)
    return llm


def test_epic_llm_structured_predict_constrains_to_the_output_class_and_parses():
    from llama_index.core.prompts import PromptTemplate

    llm = _llm(ADA)
    assert llm.structured_predict(Person, PromptTemplate("Who is {who}?"), who="Ada") == Person(name="Ada", age=36)
    assert llm._engine.calls[-1]["response_format"] == SCHEMA_FMT


async def test_epic_llm_as_structured_llm_and_async_structured_predict():
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate

    llm = _llm(ADA)
    resp = llm.as_structured_llm(Person).chat([ChatMessage(role="user", content="Who is Ada?")])
    assert resp.raw == Person(name="Ada", age=36)
    assert llm._engine.calls[-1]["response_format"] == SCHEMA_FMT
    got = await llm.astructured_predict(Person, PromptTemplate("Who is {who}?"), who="Ada")
    assert got == Person(name="Ada", age=36)
