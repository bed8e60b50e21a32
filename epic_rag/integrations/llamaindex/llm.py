"""EpicLLM: a LlamaIndex CustomLLM over the engine (complete, chat, streams, async, structured output), with
the linking figures in every response (the package docstring says which)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
    TextBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore

from ...config import EngineConfig
from ...types import ChunkRef, Delta, Generation, RagRequest
from .._shared import (
    adopt_engine,
    generation_stats,
    model_label,
    option_defaults,
    peek_shared_engine,
    sampling_of,
    shared_engine,
    usage_of,
)

_ROLE = {
    MessageRole.DEVELOPER: "system",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.FUNCTION: "tool",
}


_IGNORED_BLOCKS = {"CachePoint", "ThinkingBlock"}


# EpicLLM's chat keywords besides the sampling options: retrieved chunks passed explicitly (and with them the
# RagRequest template, `{context}` and `{question}` slots), as ChatEpic takes them.
_CHAT_KEYWORDS = ("chunks", "template")


def node_llm_text(node: BaseNode) -> str:
    """The text of a node as response synthesis puts it into the prompt (metadata header included)."""
    return node.get_content(metadata_mode=MetadataMode.LLM).strip()


def _chunk(c: Any) -> str | ChunkRef:
    if isinstance(c, NodeWithScore):
        c = c.node
    if isinstance(c, BaseNode):
        return node_llm_text(c)
    if isinstance(c, (str, ChunkRef)):
        return c
    raise ValueError(f"chunks must be str, ChunkRef or a LlamaIndex node, got {type(c).__name__}")


def _message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        parts = []
        for b in m.blocks:
            if isinstance(b, TextBlock):
                parts.append(b.text)
            elif type(b).__name__ not in _IGNORED_BLOCKS:
                raise ValueError(f"EpicLLM takes text only; got a {type(b).__name__} in a {m.role.value} message")
        out.append({"role": _ROLE.get(m.role, m.role.value), "content": "\n".join(parts)})
    return out


class EpicLLM(CustomLLM):
    """A LlamaIndex LLM on an embedded EpicEngine (the process's shared engine unless one is given)."""

    model: str | None = Field(default=None, description="Model the engine serves (default: the engine's).")
    max_tokens: int = Field(default=256, gt=0, description="Default number of tokens to generate.")
    temperature: float = Field(default=0.0, ge=0.0, le=2.0, description="Default sampling temperature.")
    policy: str | None = Field(default=None, description="Link policy (default: the engine's).")
    stop: list[str] | None = Field(default=None, description="Default stop strings.")
    context_window: int | None = Field(
        default=None, gt=0, description="Cap on the reported context window (default: engine's)."
    )
    top_p: float | None = Field(default=None, description="Nucleus sampling (default: vLLM's, 1.0).")
    top_k: int | None = Field(default=None, description="Top-k sampling (0 or -1: off).")
    min_p: float | None = Field(default=None, description="Min-p sampling.")
    seed: int | None = Field(default=None, description="Per-request sampling seed.")
    presence_penalty: float | None = Field(default=None)
    frequency_penalty: float | None = Field(default=None)
    repetition_penalty: float | None = Field(default=None)
    logprobs: bool | int | None = Field(
        default=None, description="True (with top_logprobs) as OpenAI, or vLLM's number of alternatives."
    )
    top_logprobs: int | None = Field(default=None, description="Alternatives per token with logprobs=True.")
    additional_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Further sampling options by name (an unknown one is an error)."
    )

    _engine: Any = PrivateAttr(default=None)
    _config: EngineConfig | None = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, config: EngineConfig | None = None, **kwargs: Any) -> None:
        if engine is not None and not kwargs.get("model"):
            kwargs["model"] = model_label(engine)
        super().__init__(**kwargs)
        self._sampling({})  # a bad or unknown sampling option fails here, not on the first call
        self._engine = adopt_engine(engine) if engine is not None else None
        self._config = config

    @classmethod
    def class_name(cls) -> str:
        return "EpicLLM"

    @property
    def engine(self):
        """The engine (created or shared on first use)."""
        if self._engine is None:
            self._engine = shared_engine(self.model, self._config)
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        eng = self._engine or peek_shared_engine()
        if eng is not None:
            window = eng.max_model_len
            name = self.model or model_label(eng)
            chat = bool(getattr(eng.tokenizer, "chat_template", None))
        else:  # no engine yet: report what it will be, without starting it
            cfg = self._config or EngineConfig(**({"model": self.model} if self.model else {}))
            window, name, chat = cfg.max_model_len, self.model or cfg.model, True
        if self.context_window:
            window = min(window, self.context_window)
        return LLMMetadata(
            context_window=window,
            num_output=self.max_tokens,
            model_name=name,
            is_chat_model=chat,
            is_function_calling_model=False,
        )

    # ------------------------------------------------------------------ requests
    def _sampling(self, kwargs: dict[str, Any], passthrough: tuple[str, ...] = ()):
        return sampling_of(
            self, kwargs, defaults=option_defaults(self, self.additional_kwargs), passthrough=passthrough
        )

    def _completion_request(self, prompt: str, formatted: bool):
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt)
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        return self.engine.render_messages(messages)

    def _chat_request(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]):
        chunks = kwargs.get("chunks")
        if chunks:  # an empty list (nothing retrieved) falls through to a plain chat prompt
            dicts = _message_dicts(messages)
            rest = [d for d in dicts if d["role"] != "system"]
            if len(rest) != 1 or rest[0]["role"] != "user":
                raise ValueError("with chunks=, the messages must be system messages and one user question")
            return RagRequest(
                question=rest[0]["content"],
                chunks=[_chunk(c) for c in chunks],
                system="\n\n".join(d["content"] for d in dicts if d["role"] == "system") or None,
                template=kwargs.get("template"),
            )
        if kwargs.get("template") is not None:
            raise ValueError("template= applies to a request with chunks=; without them, format your own messages")
        if self.messages_to_prompt is not generic_messages_to_prompt:  # the caller's own prompt format
            return self.messages_to_prompt(messages)
        return self.engine.render_messages(_message_dicts(messages))

    def _chat_call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]):
        """A chat call's engine request and sampling keywords."""
        return self._chat_request(messages, kwargs), self._sampling(kwargs, _CHAT_KEYWORDS)

    # ------------------------------------------------------------------ completion
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        g = self.engine.generate(self._completion_request(prompt, formatted), **self._sampling(kwargs))
        return _as_completion(g.text, None, g)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return _stream(
            self.engine.stream_events(self._completion_request(prompt, formatted), **self._sampling(kwargs)),
            _as_completion,
        )

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        req = self._completion_request(prompt, formatted)
        g = await self.engine.agenerate(req, **self._sampling(kwargs))
        return _as_completion(g.text, None, g)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        req = self._completion_request(prompt, formatted)
        return _astream(self.engine.astream_events(req, **self._sampling(kwargs)), _as_completion)

    # ------------------------------------------------------------------ chat
    # Per call, `chunks=[...]` (texts, ChunkRefs, nodes) with the messages as system messages and one user
    # question hands the chunks to the engine explicitly (a RagRequest; `template=` its user message).
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req, kw = self._chat_call(messages, kwargs)
        g = self.engine.generate(req, **kw)
        return _as_chat(g.text, None, g)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        req, kw = self._chat_call(messages, kwargs)
        return _stream(self.engine.stream_events(req, **kw), _as_chat)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        req, kw = self._chat_call(messages, kwargs)
        g = await self.engine.agenerate(req, **kw)
        return _as_chat(g.text, None, g)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        req, kw = self._chat_call(messages, kwargs)
        return _astream(self.engine.astream_events(req, **kw), _as_chat)

    # Structured prediction: LlamaIndex's default program for a non-function-calling LLM prompts with the
    # schema and parses the completion (PydanticOutputParser); the engine also constrains decoding to the
    # output class's JSON schema (vLLM structured outputs), so a small model's answer parses.
    @staticmethod
    def _json_kwargs(output_cls: type, llm_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        fmt = {
            "type": "json_schema",
            "json_schema": {"name": output_cls.__name__, "schema": output_cls.model_json_schema()},
        }
        return {"response_format": fmt, **(llm_kwargs or {})}  # a caller's own response_format wins

    def structured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args: Any):
        return super().structured_predict(output_cls, prompt, self._json_kwargs(output_cls, llm_kwargs), **prompt_args)

    async def astructured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args: Any):
        kw = self._json_kwargs(output_cls, llm_kwargs)
        return await super().astructured_predict(output_cls, prompt, kw, **prompt_args)

    def stream_structured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args: Any):
        kw = self._json_kwargs(output_cls, llm_kwargs)
        return super().stream_structured_predict(output_cls, prompt, kw, **prompt_args)

    async def astream_structured_predict(self, output_cls, prompt, llm_kwargs=None, **prompt_args: Any):
        kw = self._json_kwargs(output_cls, llm_kwargs)
        return await super().astream_structured_predict(output_cls, prompt, kw, **prompt_args)


# Engine stream events -> LlamaIndex responses carrying the text so far (sync and async share the steps).
def _pieces():
    """A function turning one event into (text so far, delta, the Generation or None), or None to skip it."""
    text = ""

    def step(ev):
        nonlocal text
        if isinstance(ev, Delta):
            text += ev.text
            return text, ev.text, None
        if isinstance(ev, Generation):
            return ev.text, "", ev
        return None

    return step


def _logprobs(g: Generation | None) -> list[list[LogProb]] | None:
    """Per generated token, its top alternatives (the chosen token alone when none were asked for), as
    LlamaIndex's OpenAI LLM gives them."""
    if g is None or g.logprobs is None:
        return None

    def lp(d: dict) -> LogProb:
        return LogProb(token=d["token"], logprob=d["logprob"], bytes=list(d["token"].encode("utf-8")))

    return [[lp(a) for a in t["top_logprobs"]] or [lp(t)] for t in g.logprobs]


def _extras(g: Generation | None) -> dict[str, Any]:
    if g is None:
        return {"additional_kwargs": {}}
    return {"additional_kwargs": generation_stats(g), "raw": {"usage": usage_of(g)}, "logprobs": _logprobs(g)}


def _as_completion(text: str, delta: str | None, g: Generation | None) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, **_extras(g))


def _as_chat(text: str, delta: str | None, g: Generation | None) -> ChatResponse:
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text), delta=delta, **_extras(g))


def _stream(events, make):
    step = _pieces()
    for ev in events:
        if (piece := step(ev)) is not None:
            yield make(*piece)


async def _astream(events, make):
    step = _pieces()
    async for ev in events:
        if (piece := step(ev)) is not None:
            yield make(*piece)
