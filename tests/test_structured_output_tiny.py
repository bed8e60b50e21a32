"""Structured output on the tiny random Llama: a schema vLLM's grammar backend refuses is a ValueError at
submission (no request left behind), and the engine keeps serving."""

from __future__ import annotations

import pytest

from epic_rag import RagRequest


def _req() -> RagRequest:
    return RagRequest(question="which function adds?", chunks=["def add(a, b):\n    return a + b\n"])


def test_a_schema_the_grammar_backend_refuses_is_a_value_error_and_the_engine_keeps_serving(tiny_engine):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "not-a-type"}}}
    with pytest.raises(ValueError):
        tiny_engine.generate(_req(), max_tokens=4, response_format=bad)
    assert tiny_engine.runtime.idle()
    assert tiny_engine.generate(_req(), max_tokens=2).token_ids
