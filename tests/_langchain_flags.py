"""ChatEpic's answers to langchain-tests' feature flags, shared by the unit and integration suites.

Features the model does not have are declared here, not faked."""

from __future__ import annotations

from epic_rag.integrations.langchain import ChatEpic


class ChatEpicFlags:
    @property
    def chat_model_class(self) -> type[ChatEpic]:
        return ChatEpic

    @property
    def has_tool_calling(self) -> bool:
        return False

    @property
    def has_structured_output(self) -> bool:
        return True  # vLLM structured outputs (JSON-schema grammar), see ChatEpic.with_structured_output

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_image_inputs(self) -> bool:
        return False

    @property
    def supports_model_override(self) -> bool:
        return False  # one engine serves one model; a different per-call model raises

    @property
    def returns_usage_metadata(self) -> bool:
        return True
