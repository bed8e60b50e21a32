"""LangChain integration: `ChatEpic` (a chat model) and `create_epic_rag_chain` (retriever -> engine).

- `ChatEpic` renders messages through the model's chat template; compiled chunk texts found in the result
  (e.g. documents a `create_stuff_documents_chain` prompt inserted) are linked from cache. Passing
  `chunks=[...]` (texts, ChunkRefs or Documents) per call, e.g. `model.invoke(question, chunks=docs)`,
  hands them to the engine explicitly as a RagRequest instead.
- `EpicDocumentCompiler()` is a pass-through Runnable compiling Documents' page_content at query time:
  `retriever | EpicDocumentCompiler()` links documents from a store loaded from disk or one that keeps its
  own text. Texts already compiled in this process cost nothing; texts in the chunk store a store lookup.
- `create_epic_rag_chain(retriever, ...)` is a Runnable: question -> retriever -> engine, with the retrieved
  Documents passed as chunks (no prompt matching); invoke/stream/batch and their async forms.

`AIMessage.response_metadata` carries model_name, finish_reason, `token_usage` (OpenAI-shaped, as ChatOpenAI:
prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens) and the linking figures
(ttft_s, total_s, prompt_tokens, linked_tokens, recomputed_tokens, chunk_hits, chunk_misses, policy,
completion_tokens, chunk_keys); `usage_metadata` counts linked prompt tokens as `input_token_details.cache_read`;
with `logprobs=True` (and `top_logprobs=k`), `response_metadata["logprobs"] = {"content": [...]}` as ChatOpenAI.
For streams they arrive on the last chunk.

Sampling options (top_p, top_k, min_p, seed, presence_penalty, frequency_penalty, repetition_penalty,
logprobs/top_logprobs) are fields, `model_kwargs` entries or per-call keywords; an unknown one is an error
naming it, never dropped.
"""

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
    RunnableConfig,
    RunnableMap,
    RunnablePassthrough,
    RunnableSerializable,
)
from langchain_core.runnables.config import patch_config, run_in_executor
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from ..config import EngineConfig
from ..prompt import check_template
from ..types import ChunkRef, Delta, Generation, RagRequest
from ._shared import (
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

__all__ = ["ChatEpic", "EpicDocumentCompiler", "EpicRagChain", "compile_documents", "create_epic_rag_chain"]


def _text(content: Any, role: str) -> str:
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
            system = [_text(m.content, "system") for m in messages if isinstance(m, SystemMessage)]
            rest = [m for m in messages if not isinstance(m, SystemMessage)]
            if len(rest) != 1 or not isinstance(rest[0], HumanMessage):
                raise ValueError("with chunks=, the messages must be system messages and one question")
            return RagRequest(
                question=_text(rest[0].content, "user"),
                chunks=[_chunk(c) for c in chunks],
                system="\n\n".join(system) or None,
                template=kwargs.get("template"),
            )
        if kwargs.get("template") is not None:
            raise ValueError("template= applies to a request with chunks=; without them, format your own messages")
        if not messages:
            raise ValueError("no messages")
        dicts = [{"role": _role(m), "content": _text(m.content, _role(m))} for m in messages]
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


def _question(value: Any) -> str:
    if isinstance(value, str):
        q = value
    elif isinstance(value, dict):
        q = next((value[k] for k in ("question", "input", "query") if k in value), None)
    elif isinstance(value, HumanMessage):
        q = _text(value.content, "user")
    else:
        q = None
    if not isinstance(q, str) or not q.strip():
        raise ValueError("input must be a question string or a dict with a 'question' (or 'input') string")
    return q


def _template_of(prompt: Any) -> str | None:
    """A chain prompt as a RagRequest template: a string or a PromptTemplate with `{context}` and
    `{question}` (or `{input}`, as create_retrieval_chain prompts name it) slots."""
    if prompt is None:
        return None
    text = getattr(prompt, "template", prompt)
    if not isinstance(text, str):
        raise ValueError(
            "prompt must be a string or a PromptTemplate with {context} and {question} (or {input}) slots; "
            "for a chat prompt, give its user message as a string (and system= for the system message)"
        )
    return check_template(text.replace("{input}", "{question}") if "{question}" not in text else text)


class EpicRagChain(RunnableSerializable[Any, Any]):
    """question -> retriever -> ChatEpic with the retrieved Documents as chunks (a RagRequest).

    Input: a question string, or a dict with "question" (or "input"/"query"). Output: an AIMessage
    (AIMessageChunks when streaming) whose response_metadata also lists the retrieved `documents`; or, with
    `output="dict"`, create_retrieval_chain's shape: the input (a string as "input") plus "context" (the
    Documents) and "answer" (the text); streamed as {"input"...}, {"context": docs}, then {"answer": delta}s.
    `prompt`: the user message template (see _template_of); default: the engine's own prompt.
    """

    retriever: Any
    llm: ChatEpic
    system: str | None = None
    prompt: str | None = None
    output: Literal["message", "dict"] = "message"

    model_config = ConfigDict(arbitrary_types_allowed=True)

    @model_validator(mode="before")
    @classmethod
    def _prompt_is_a_template(cls, values: Any) -> Any:
        if isinstance(values, dict) and values.get("prompt") is not None:
            values = {**values, "prompt": _template_of(values["prompt"])}
        return values

    def _call_kwargs(self, docs: list[Document], kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"chunks": docs, **({"template": self.prompt} if self.prompt else {}), **kwargs}

    def _shaped(self, value: Any, docs: list[Document], msg: Any) -> Any:
        if self.output == "message":
            return self._with_docs(msg, docs)
        head = dict(value) if isinstance(value, dict) else {"input": _question(value)}
        return {**head, "context": docs, "answer": msg.content}

    def _messages(self, q: str) -> list[BaseMessage]:
        return ([SystemMessage(self.system)] if self.system else []) + [HumanMessage(q)]

    @staticmethod
    def _docs(docs: Any) -> list[Document]:
        docs = list(docs)
        if not all(isinstance(d, Document) for d in docs):
            raise ValueError("the retriever must return Documents")
        return docs

    @staticmethod
    def _with_docs(msg: Any, docs: list[Document]) -> Any:
        msg.response_metadata["documents"] = docs
        return msg

    def _invoke(self, value: Any, run_manager, config: RunnableConfig, **kwargs: Any) -> AIMessage:
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(self.retriever.invoke(q, child))
        msg = self.llm.invoke(self._messages(q), child, **self._call_kwargs(docs, kwargs))
        return self._shaped(value, docs, msg)

    async def _ainvoke(self, value: Any, run_manager, config: RunnableConfig, **kwargs: Any) -> AIMessage:
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(await self.retriever.ainvoke(q, child))
        msg = await self.llm.ainvoke(self._messages(q), child, **self._call_kwargs(docs, kwargs))
        return self._shaped(value, docs, msg)

    def invoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return self._call_with_config(self._invoke, input, config, **kwargs)

    async def ainvoke(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await self._acall_with_config(self._ainvoke, input, config, **kwargs)

    def _head(self, value: Any, docs: list[Document]) -> list[dict]:
        """What a dict stream yields before the answer: the input, then the Documents."""
        if self.output == "message":
            return []
        return [dict(value) if isinstance(value, dict) else {"input": _question(value)}, {"context": docs}]

    def _piece(self, chunk: Any, docs: list[Document]) -> list[Any]:
        if self.output == "message":
            return [self._with_docs(chunk, docs) if chunk.chunk_position == "last" else chunk]
        return [{"answer": chunk.content}] if chunk.content else []

    def _transform(self, values: Iterator[Any], run_manager, config: RunnableConfig, **kwargs: Any) -> Iterator[Any]:
        value = None
        for value in values:  # noqa: B007 - the last input is the question
            pass
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(self.retriever.invoke(q, child))
        yield from self._head(value, docs)
        for chunk in self.llm.stream(self._messages(q), child, **self._call_kwargs(docs, kwargs)):
            yield from self._piece(chunk, docs)

    async def _atransform(
        self, values: AsyncIterator[Any], run_manager, config: RunnableConfig, **kwargs: Any
    ) -> AsyncIterator[Any]:
        value = None
        async for value in values:  # noqa: B007 - the last input is the question
            pass
        q = _question(value)
        child = patch_config(config, callbacks=run_manager.get_child())
        docs = self._docs(await self.retriever.ainvoke(q, child))
        for head in self._head(value, docs):
            yield head
        async for chunk in self.llm.astream(self._messages(q), child, **self._call_kwargs(docs, kwargs)):
            for piece in self._piece(chunk, docs):
                yield piece

    def transform(
        self, input: Iterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> Iterator[AIMessageChunk]:
        yield from self._transform_stream_with_config(input, self._transform, config, **kwargs)

    def stream(self, input: Any, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        yield from self.transform(iter([input]), config, **kwargs)

    async def atransform(
        self, input: AsyncIterator[Any], config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        async for chunk in self._atransform_stream_with_config(input, self._atransform, config, **kwargs):
            yield chunk

    async def astream(
        self, input: Any, config: RunnableConfig | None = None, **kwargs: Any
    ) -> AsyncIterator[AIMessageChunk]:
        async def one() -> AsyncIterator[Any]:
            yield input

        async for chunk in self.atransform(one(), config, **kwargs):
            yield chunk


def compile_documents(
    documents: Sequence[Document], engine: Any = None, policy: str | None = None, batch_size: int = 32
) -> list[ChunkRef]:
    """Compile the Documents' page_content (at ingest), so prompts that insert them verbatim link them and
    chains that pass them as chunks find them compiled. Returns the refs in input order."""
    eng = adopt_engine(engine) if engine is not None else shared_engine()
    return eng.compile([d.page_content for d in documents], policy=policy, batch_size=batch_size)


class EpicDocumentCompiler(RunnableSerializable[Sequence[Document], list[Document]]):
    """Documents in, the same Documents out, their page_content compiled on the way (a retrieval-time step).

    `retriever | EpicDocumentCompiler() | ...`: a prompt that inserts page_content verbatim (e.g.
    `create_stuff_documents_chain`) then links them. Texts already compiled in this process are skipped;
    the chunk store skips those it holds.
    """

    policy: str | None = None
    batch_size: int = Field(default=32, gt=0)

    model_config = ConfigDict(arbitrary_types_allowed=True)

    _engine: Any = PrivateAttr(default=None)

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if engine is not None:
            self._engine = adopt_engine(engine)

    @property
    def engine(self):
        if self._engine is None:
            self._engine = shared_engine()
        return self._engine

    def _compile(self, docs: Any) -> list[Document]:
        docs = list(docs)
        if not all(isinstance(d, Document) for d in docs):
            raise ValueError("EpicDocumentCompiler takes a list of Documents")
        eng = self.engine
        fresh = [t for t in dict.fromkeys(d.page_content for d in docs) if t.strip() and t not in eng.text_index]
        if fresh:
            eng.compile(fresh, policy=self.policy, batch_size=self.batch_size)
        return docs

    def invoke(self, input: Sequence[Document], config: RunnableConfig | None = None, **kwargs: Any) -> list[Document]:
        return self._call_with_config(self._compile, input, config)

    async def ainvoke(
        self, input: Sequence[Document], config: RunnableConfig | None = None, **kwargs: Any
    ) -> list[Document]:
        _ = self.engine  # created (if need be) on this thread, not in the worker

        async def run(docs: Any) -> list[Document]:
            return await run_in_executor(None, self._compile, docs)

        return await self._acall_with_config(run, input, config)


def create_epic_rag_chain(
    retriever: Any,
    engine: Any = None,
    *,
    llm: ChatEpic | None = None,
    system: str | None = None,
    max_tokens: int = 256,
    temperature: float = 0.0,
    policy: str | None = None,
    prompt: Any = None,
    output: Literal["message", "dict"] = "message",
) -> EpicRagChain:
    """A Runnable answering a question from what `retriever` returns, the Documents linked as chunks.

    `retriever`: any Runnable from a question string to a list of Documents (e.g. a vector store's
    `.as_retriever()`). Give `llm` to reuse a ChatEpic, else one is made on `engine` (or the shared one).
    `prompt`: a string or PromptTemplate with `{context}` and `{question}` (or `{input}`) slots; `{context}`
    becomes the Documents as "Document i:\n<text>\n\n". `output="dict"`: create_retrieval_chain's
    `{input, context, answer}` instead of an AIMessage.
    """
    if llm is None:
        llm = ChatEpic(engine=engine, max_tokens=max_tokens, temperature=temperature, policy=policy)
    return EpicRagChain(retriever=retriever, llm=llm, system=system, prompt=prompt, output=output)
