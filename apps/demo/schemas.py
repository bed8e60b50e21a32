"""Request bodies of the OpenAI-compatible API (pydantic): wrong types and shapes become 400s.

Unknown fields are ignored (OpenAI clients send many optional ones); the demo's own fields (policy,
top_k, chunk_ids, use_retrieval) travel in the body the way the OpenAI client's `extra_body` sends them.
Limits that depend on the server's configuration are checked in the route.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: StrictStr | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    # epic-rag extensions (OpenAI client: extra_body={...})
    policy: StrictStr | None = None
    top_k: StrictInt | None = Field(default=None, ge=0)
    chunk_ids: list[StrictStr] | None = Field(default=None, max_length=64)
    use_retrieval: StrictBool = True

    @property
    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None
