"""Request bodies of the OpenAI-compatible API (pydantic): wrong types and shapes become 400s.

A field the server does not act on is a 400 naming it (never silently ignored), except the few that do not
change an answer (`user`, `metadata`, `store`, ...) and unsupported ones left at their off value
(`tools: []`, `n: 1`, ...). `response_format` (json_object, json_schema) constrains decoding. The demo's
own fields (policy, top_k, chunk_ids, use_retrieval) and vLLM's sampling extensions (min_p,
repetition_penalty, and `sampling_top_k`, since `top_k` here is the number of retrieved chunks) travel in
the body the way the OpenAI client's `extra_body` sends them. Limits that depend on the server's
configuration are checked in the route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

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

from epic_rag.sampling import check_response_format

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


# Fields that do not change an answer: accepted and ignored.
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
)
# Values of unsupported fields that mean "off" (what some clients send by default).
_OFF_VALUES: tuple[Any, ...] = (None, False, [], {}, "", "none", "auto", ["text"], {"type": "text"})


class _Generate(BaseModel):
    """Fields both completion endpoints share: sampling, streaming, the model and the link policy."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    n: StrictInt | None = Field(default=None, ge=1, le=1)
    stop: StrictStr | list[StrictStr] | None = None
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-(2**63), le=2**63 - 1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM's extensions (extra_body)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    sampling_top_k: StrictInt | None = Field(default=None, ge=-1)
    # vLLM's prefix-cache namespace (under the engine's tenant): requests that send none share it
    cache_salt: StrictStr | None = Field(default=None, min_length=1, max_length=256)
    # OpenAI's {"type": "json_object" | "json_schema" | "text"}: decoding constrained by vLLM's structured outputs
    response_format: dict[str, Any] | None = None
    # epic-rag extension
    policy: StrictStr | None = None

    @field_validator("stop")
    @classmethod
    def _stop_is_bounded(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"each stop sequence has at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("response_format")
    @classmethod
    def _response_format_is_known(cls, v):
        return None if v is None else check_response_format(v)  # {"type": "text"}: None (unconstrained)

    @model_validator(mode="after")
    def _no_unsupported_fields(self):
        for name, value in (self.model_extra or {}).items():
            if name in IGNORED_FIELDS or any(value == off and type(value) is type(off) for off in _OFF_VALUES):
                continue
            if name == "best_of" and value == 1:
                continue
            raise ValueError(f"unsupported field {name!r}: this server does not support it (remove it to proceed)")
        return self

    def _check_text(self, texts: list[tuple[str, str | None]]) -> None:
        """JSON may escape lone surrogates ("\\ud800"): not text; tokenizers raise TypeError on them."""
        texts = texts + [("model", self.model), ("policy", self.policy), ("cache_salt", self.cache_salt)]
        texts += [("stop", s) for s in self.stop_list or []]
        for where, s in texts:
            try:
                (s or "").encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{where}: not valid Unicode text (lone surrogate at position {e.start})") from None

    @property
    def stop_list(self) -> list[str] | None:
        if self.stop is None:
            return None
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return [s for s in stops if s] or None

    def engine_logprobs(self) -> int | None:
        return None

    def sampling_options(self) -> dict[str, Any]:
        """The further sampling options set in this request, as EpicEngine.prepare takes them."""
        opts = {
            "top_p": self.top_p,
            "top_k": self.sampling_top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logprobs": self.engine_logprobs(),
            "response_format": self.response_format,
            "cache_salt": self.cache_salt,
        }
        return {k: v for k, v in opts.items() if v is not None}


class ChatCompletionRequest(_Generate):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)  # the route applies max_messages
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    # epic-rag extensions (OpenAI client: extra_body={...})
    top_k: StrictInt | None = Field(default=None, ge=0)
    chunk_ids: list[ChunkId] | None = Field(default=None, max_length=64)
    use_retrieval: StrictBool = True

    @model_validator(mode="after")
    def _text_is_unicode(self):
        self._check_text(
            [(f"messages.{i}.content", m.text) for i, m in enumerate(self.messages)]
            + [("chunk_ids", c) for c in self.chunk_ids or []]
        )
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generate):
    """`/v1/completions`: a prompt string in, text out (no chat template, no server-side retrieval)."""

    prompt: StrictStr | list[StrictStr]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False

    @model_validator(mode="after")
    def _one_text_prompt(self):
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise ValueError("prompt: exactly one prompt per request (a list of one string at most)")
            self.prompt = self.prompt[0]
        if not self.prompt.strip():
            raise ValueError("prompt: must not be empty")
        if self.echo:
            raise ValueError("unsupported field 'echo': this server does not echo the prompt")
        self._check_text([("prompt", self.prompt)])
        return self

    def engine_logprobs(self) -> int | None:
        return self.logprobs
