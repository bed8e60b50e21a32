"""Structured output on the real SmolLM2 (vLLM structured outputs, xgrammar on CPU): answers over linked
chunks parse against the schema through the engine, ChatEpic.with_structured_output and EpicLLM."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from epic_rag import RagRequest

pytestmark = pytest.mark.smollm

PASSAGE = "Ada Lovelace was an English mathematician. She was born in 1815 and died at the age of 36."


class Person(BaseModel):
    name: str
    age: int


def _schema_fmt() -> dict:
    schema = Person.model_json_schema() | {"additionalProperties": False}
    return {"type": "json_schema", "json_schema": {"name": "Person", "schema": schema}}


def test_engine_json_schema_answer_over_linked_chunks_parses_against_the_schema(smol_engine):
    smol_engine.compile([PASSAGE])
    req = RagRequest(question="Who was Ada Lovelace and how old did she get? Answer in JSON.", chunks=[PASSAGE])
    g = smol_engine.generate(req, max_tokens=64, response_format=_schema_fmt())
    assert g.chunk_hits == 1 and g.linked_tokens > 0  # structured output does not stop chunk linking
    person = Person.model_validate_json(g.text)
    assert set(json.loads(g.text)) == {"name", "age"} and person.name


def test_engine_json_object_answer_is_a_json_object_where_the_free_answer_is_prose(smol_engine):
    q = 'Reply with a JSON object like {"name": "...", "born": 0} for the person in the document.'
    free = smol_engine.generate(RagRequest(question=q, chunks=[PASSAGE]), max_tokens=48)
    g = smol_engine.generate(
        RagRequest(question=q, chunks=[PASSAGE]), max_tokens=96, response_format={"type": "json_object"}
    )
    assert not free.text.lstrip().startswith("{"), free.text  # the constraint, not the prompt, makes it JSON
    assert g.finish_reason == "stop", g.text  # the grammar closed the object
    assert isinstance(json.loads(g.text), dict)


def test_chat_epic_with_structured_output_returns_the_pydantic_object(smol_engine):
    from epic_rag.integrations.langchain import ChatEpic

    model = ChatEpic(engine=smol_engine, max_tokens=64)
    out = model.with_structured_output(Person).invoke("Ada Lovelace was 36. Give her name and age.")
    assert isinstance(out, Person)
    smol_engine.compile([PASSAGE])
    # a compiled text inside the message is linked (prompt matching), structured or not
    raw = model.with_structured_output(Person, include_raw=True).invoke(f"{PASSAGE}\n\nName and age of Ada?")
    assert isinstance(raw["parsed"], Person) and raw["parsing_error"] is None
    assert raw["raw"].usage_metadata["input_token_details"]["cache_read"] > 0


def test_epic_llm_structured_predict_and_as_structured_llm_return_the_output_class(smol_engine):
    from llama_index.core.llms import ChatMessage
    from llama_index.core.prompts import PromptTemplate

    from epic_rag.integrations.llamaindex import EpicLLM

    llm = EpicLLM(engine=smol_engine, max_tokens=64)
    got = llm.structured_predict(Person, PromptTemplate("{text}\nGive the person's name and age."), text=PASSAGE)
    assert isinstance(got, Person)
    resp = llm.as_structured_llm(Person).chat([ChatMessage(role="user", content=f"{PASSAGE}\nName and age?")])
    assert isinstance(resp.raw, Person)
