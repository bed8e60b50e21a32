"""LangChain's standard unit suite for ChatEpic (no engine is started: construction is lazy)."""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")

from _langchain_flags import ChatEpicFlags  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage  # noqa: E402
from langchain_tests.unit_tests import ChatModelUnitTests  # noqa: E402

from epic_rag.integrations.langchain import ChatEpic  # noqa: E402


class TestChatEpicUnit(ChatEpicFlags, ChatModelUnitTests):
    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2-135m-instruct"}


def test_chat_epic_construction_starts_no_engine():
    from epic_rag.integrations import _shared

    before = _shared.peek_shared_engine()
    m = ChatEpic(model="smollm2-135m-instruct", max_tokens=4)
    assert m._engine is None and _shared.peek_shared_engine() is before


def test_chat_epic_rejects_non_text_blocks_and_bad_chunk_messages():
    m = ChatEpic(model="smollm2-135m-instruct")
    with pytest.raises(ValueError, match="text only"):
        m._request([HumanMessage(content=[{"type": "image", "url": "http://x/y.png"}])], {})
    with pytest.raises(ValueError, match="one question"):
        m._request([HumanMessage("a"), AIMessage("b"), HumanMessage("c")], {"chunks": ["doc"]})
    req = m._request([SystemMessage("be brief"), HumanMessage("q?")], {"chunks": ["doc one"]})
    assert req.question == "q?" and req.chunks == ["doc one"] and req.system == "be brief"


def test_chat_epic_refuses_to_switch_models_per_call():
    m = ChatEpic(model="smollm2-135m-instruct")
    with pytest.raises(ValueError, match="cannot switch"):
        m._gen_kwargs(None, {"model": "other-model"})
    assert m._gen_kwargs(["x"], {"max_tokens": 3, "temperature": 0.5}) == {
        "max_tokens": 3,
        "temperature": 0.5,
        "policy": None,
        "stop": ["x"],
    }
