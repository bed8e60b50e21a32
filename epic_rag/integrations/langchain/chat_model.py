"""ChatEpic: a LangChain chat model over the engine (sync, async, streaming, structured output), with the
linking figures in every message's response_metadata (the package docstring says which)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.documents import Document
from langchain_core.language_models import BaseChatModel, LangSmithParams
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import (
    Runnable,
    RunnableMap,
    RunnablePassthrough,
)
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ...config import EngineConfig
from ...types import ChunkRef, Delta, Generation, RagRequest
from .._shared import (
    adopt_engine,
    generation_stats,
    model_label,
    openai_logprobs,
    option_defaults,
    peek_shared_engine,
    sampling_of,
    shared_engine,
    usage_of,
)


def content_text(content: Any, role: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
        elif isinstance(block, dict) and block.get("type") in ("reasoning", "thinking"):
            continue
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise ValueError(f"ChatEpic takes text only; got a {kind!r} block in a {role} message")
    return "".join(parts)


def _role(m: BaseMessage) -> str:
    if isinstance(m, SystemMessage):
        return "system"
    if isinstance(m, HumanMessage):
        return "user"
    if isinstance(m, AIMessage):
        return "assistant"
    if isinstance(m, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(m, ChatMessage):
        return {"human": "user", "ai": "assistant", "developer": "system"}.get(m.role, m.role)
    raise ValueError(f"unsupported message type {type(m).__name__}")


def _response_format(schema: Any, method: str) -> dict[str, Any]:
    """OpenAI's response_format for a with_structured_output schema (pydantic class, TypedDict, JSON schema)."""
    if method == "json_mode":
        return {"type": "json_object"}
    if schema is None:
        raise ValueError("method='json_schema' needs a schema")
    js = convert_to_json_schema(schema)
    return {"type": "json_schema", "json_schema": {"name": js.get("title", "output"), "schema": js}}


# Per-call keywords ChatEpic takes besides the sampling options (`stream` is LangChain's own switch;
# `template`: with chunks=, the RagRequest template with {context} and {question} slots).
_CALL_KEYWORDS = ("chunks", "model", "stream", "template")


def _chunk(c: Any) -> str | ChunkRef:
    if isinstance(c, Document):
        return c.page_content
    if isinstance(c, (str, ChunkRef)):
        return c
    raise ValueError(f"chunks must be str, ChunkRef or Document, got {type(c).__name__}")


class ChatEpic(BaseChatModel):
    """A LangChain chat model on an embedded EpicEngine (the process's shared engine unless one is given).

    Construction is cheap: without `engine=`, the shared engine is created on the first call.
    Per call: `max_tokens`, `temperature`, `stop`, `policy`, `chunks`, and the sampling options.
    An unknown constructor parameter or per-call keyword is an error naming it.
    """

    model: str | None = Field(default=None, description="Model the engine serves (default: the engine's).")
    max_tokens: int = Field(default=256, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    stop: list[str] | None = None
    policy: str | None = Field(default=None, description="Link policy (default: the engine's).")
    streaming: bool = Field(default=False, description="invoke() streams internally (callbacks per token).")
    top_p: float | None = Field(default=None, description="Nucleus sampling (default: vLLM's, 1.0).")
    top_k: int | None = Field(default=None, description="Top-k sampling (0 or -1: off).")
    min_p: float | None = None
    seed: int | None = Field(default=None, description="Per-request sampling seed.")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logprobs: bool | int | None = Field(
        default=None, description="True (with top_logprobs) as ChatOpenAI, or vLLM's number of alternatives."
    )
    top_logprobs: int | None = None
    model_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Further sampling options by name (an unknown one is an error)."
    )
    timeout: float | None = Field(
        default=None, description="Accepted as LangChain's standard parameter; an in-process call has no timeout."
    )
    max_retries: int | None = Field(
        default=None, description="Accepted as LangChain's standard parameter; nothing is retried in-process."
    )
    api_key: SecretStr | None = Field(
        default=None, exclude=True, description="Accepted as LangChain's standard parameter; none is needed."
    )
    engine_config: Any = Field(
        default=None, exclude=True, description="Config for the shared engine if none exists yet."
    )

    model_config = ConfigDict(arbitrary_types_allowed=True, populate_by_name=True)

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        if engine is not None and not kwargs.get("model"):
            kwargs["model"] = model_label(engine)
        super().__init__(**kwargs)
        self._gen_kwargs(None, {})  # a bad or unknown sampling option fails here, not on the first call
        if engine is not None:
            self._engine = adopt_engine(engine)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_parameters(cls, values: Any) -> Any:
        if isinstance(values, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            unknown = [k for k in values if k not in known]
            if unknown:
                raise ValueError(
                    f"ChatEpic: unknown parameter {unknown[0]!r} (sampling options: top_p, top_k, min_p, seed, "
                    "presence_penalty, frequency_penalty, repetition_penalty, logprobs, top_logprobs, model_kwargs)"
                )
        return values

    @property
    def engine(self):
        """The engine (created or shared on first use)."""
        if self._engine is None:
            self._engine = shared_engine(self.model, self.engine_config)
        return self._engine

    @property
    def _llm_type(self) -> str:
        return "epic-rag"

    @property
    def model_name(self) -> str:
        if self.model:
            return self.model
        eng = self._engine or peek_shared_engine()
        if eng is not None:
            return model_label(eng)
        return (self.engine_config or EngineConfig()).model

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "policy": self.policy,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="epic_rag",
            ls_model_type="chat",
            ls_model_name=kwargs.get("model") or self.model_name,
            ls_temperature=float(kwargs.get("temperature", self.temperature)),
            ls_max_tokens=int(kwargs.get("max_tokens") or self.max_tokens),
        )
        stop = stop or kwargs.get("stop") or self.stop
        if stop:
            params["ls_stop"] = list(stop)
        return params

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable:
        """The answer decoded under vLLM's structured outputs and parsed: a pydantic instance for a pydantic
        class, else a dict. `json_schema` (default) constrains decoding to the schema; `json_mode` to any JSON
        object (the prompt should ask for the keys). There is no tool calling: `function_calling` is taken as
        `json_schema` (same parsed result).
        `include_raw=True` returns {"raw": AIMessage, "parsed": ..., "parsing_error": ...} as ChatOpenAI."""
        if kwargs:
            raise ValueError(f"ChatEpic.with_structured_output: unsupported arguments {sorted(kwargs)}")
        if method == "function_calling":  # no tool calling: the schema-constrained answer parses the same way
            method = "json_schema"
        if method not in ("json_schema", "json_mode"):
            raise ValueError(
                f"ChatEpic.with_structured_output: method must be 'json_schema' or 'json_mode', got {method!r}"
            )
        # `strict` is accepted for ChatOpenAI's signature: the grammar already enforces the schema.
        llm = self.bind(
            response_format=_response_format(schema, method),
            ls_structured_output_format={"kwargs": {"method": method, "strict": strict}, "schema": schema},
        )
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        parser: Runnable = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed], exception_key="parsing_error")

    # ------------------------------------------------------------------ requests
    def _gen_kwargs(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        model = kwargs.get("model")
        if model and model != self.model_name:
            raise ValueError(f"this engine serves {self.model_name!r}; it cannot switch to {model!r} per call")
        return sampling_of(
            self, kwargs, stop, defaults=option_defaults(self, self.model_kwargs), passthrough=_CALL_KEYWORDS
        )

    def _request(self, messages: Sequence[BaseMessage], kwargs: dict[str, Any]):
        chunks = kwargs.get("chunks")
        if chunks:  # an empty list (nothing retrieved) falls through to a plain chat prompt
            system = [content_text(m.content, "system") for m in messages if isinstance(m, SystemMessage)]
            rest = [m for m in messages if not isinstance(m, SystemMessage)]
            if len(rest) != 1 or not isinstance(rest[0], HumanMessage):
                raise ValueError("with chunks=, the messages must be system messages and one question")
            return RagRequest(
                question=content_text(rest[0].content, "user"),
                chunks=[_chunk(c) for c in chunks],
                system="\n\n".join(system) or None,
                template=kwargs.get("template"),
            )
        if kwargs.get("template") is not None:
            raise ValueError("template= applies to a request with chunks=; without them, format your own messages")
        if not messages:
            raise ValueError("no messages")
        dicts = [{"role": _role(m), "content": content_text(m.content, _role(m))} for m in messages]
        return self.engine.render_messages(dicts)

    def _metadata(self, g: Generation) -> dict[str, Any]:
        out = {
            "model_name": self.model_name,
            "model_provider": "epic_rag",
            "token_usage": usage_of(g),
            **generation_stats(g),
        }
        if g.logprobs is not None:
            out["logprobs"] = openai_logprobs(g)
        return out

    @staticmethod
    def _usage(g: Generation) -> UsageMetadata:
        out = len(g.token_ids)
        return UsageMetadata(
            input_tokens=g.prompt_tokens,
            output_tokens=out,
            total_tokens=g.prompt_tokens + out,
            input_token_details={"cache_read": g.linked_tokens},
        )

    def _result(self, g: Generation) -> ChatResult:
        msg = AIMessage(content=g.text, response_metadata=self._metadata(g), usage_metadata=self._usage(g))
        return ChatResult(
            generations=[ChatGeneration(message=msg, generation_info={"finish_reason": g.finish_reason})],
            llm_output={"model_name": self.model_name, "token_usage": usage_of(g)},
        )

    def _combine_llm_outputs(self, llm_outputs: list[dict | None]) -> dict:
        """`generate()` over several prompts: token usage summed, as ChatOpenAI does."""
        total: dict[str, Any] = {}
        for out in llm_outputs:
            for k, v in ((out or {}).get("token_usage") or {}).items():
                if isinstance(v, dict):
                    sub = total.setdefault(k, {})
                    for k2, v2 in v.items():
                        sub[k2] = sub.get(k2, 0) + v2
                else:
                    total[k] = total.get(k, 0) + v
        return {"model_name": self.model_name, "token_usage": total}

    def _last_chunk(self, g: Generation) -> ChatGenerationChunk:
        return ChatGenerationChunk(
            message=AIMessageChunk(
                content="", chunk_position="last", response_metadata=self._metadata(g), usage_metadata=self._usage(g)
            ),
            generation_info={"finish_reason": g.finish_reason},
        )

    # ------------------------------------------------------------------ BaseChatModel
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        gen_kw = self._gen_kwargs(stop, kwargs)
        return self._result(self.engine.generate(self._request(messages, kwargs), **gen_kw))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        gen_kw = self._gen_kwargs(stop, kwargs)
        for ev in self.engine.stream_events(self._request(messages, kwargs), **gen_kw):
            if isinstance(ev, Delta):
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=ev.text))
                if run_manager:
                    run_manager.on_llm_new_token(ev.text, chunk=chunk)
                yield chunk
            elif isinstance(ev, Generation):
                yield self._last_chunk(ev)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        gen_kw = self._gen_kwargs(stop, kwargs)
        return self._result(await self.engine.agenerate(self._request(messages, kwargs), **gen_kw))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        gen_kw = self._gen_kwargs(stop, kwargs)
        async for ev in self.engine.astream_events(self._request(messages, kwargs), **gen_kw):
            if isinstance(ev, Delta):
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=ev.text))
                if run_manager:
                    await run_manager.on_llm_new_token(ev.text, chunk=chunk)
                yield chunk
            elif isinstance(ev, Generation):
                yield self._last_chunk(ev)
