"""Request bodies of the OpenAI-compatible API (pydantic): wrong types and shapes become 400s.

Unknown fields are ignored (OpenAI clients send many optional ones); the demo's own fields (policy,
top_k, chunk_ids, use_retrieval) travel in the body the way the OpenAI client's `extra_body` sends them.
Limits that depend on the server's configuration are checked in the route.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    field_validator,
    model_validator,
)

# Every list and the strings vLLM matches per token are bounded here, before any work (OpenAI: <= 4 stops).
MAX_STOPS, MAX_STOP_CHARS = 4, 64
ChunkId = Annotated[str, StringConstraints(strict=True, max_length=512)]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | Annotated[list[TextPart], Field(max_length=256)] | None = None

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
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)  # the route applies max_messages
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
    chunk_ids: list[ChunkId] | None = Field(default=None, max_length=64)
    use_retrieval: StrictBool = True

    @field_validator("stop")
    @classmethod
    def _stop_is_bounded(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence has at most {MAX_STOP_CHARS} characters")
        return v

    @model_validator(mode="after")
    def _text_is_unicode(self):
        """JSON may escape lone surrogates ("\\ud800"): not text; tokenizers raise TypeError on them."""
        texts = [(f"messages.{i}.content", m.text) for i, m in enumerate(self.messages)]
        texts += [("model", self.model), ("policy", self.policy)]
        texts += [("stop", s) for s in self.stop_list or []] + [("chunk_ids", c) for c in self.chunk_ids or []]
        for where, s in texts:
            try:
                (s or "").encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{where}: not valid Unicode text (lone surrogate at position {e.start})") from None
        return self

    @property
    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None
