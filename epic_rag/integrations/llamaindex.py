"""LlamaIndex integration: a drop-in LLM, an ingestion transform that compiles chunks, a response synthesizer.

- `EpicLLM` (a CustomLLM). Set `Settings.llm = EpicLLM(...)` and a stock query engine links the retrieved
  nodes from cache: the engine finds the compiled chunk texts inside the prompt LlamaIndex renders (chat
  messages go through the model's chat template) and tokenizes each piece on its own.
- `EpicChunkCompiler` (a TransformComponent) compiles each node's LLM-visible text
  (`node.get_content(MetadataMode.LLM)`, metadata header included, stripped as response synthesis inserts
  it), so a corpus is compiled at ingest. Put it after every step that changes text or metadata.
- `EpicNodeCompiler` (a BaseNodePostprocessor) compiles the retrieved nodes' LLM-visible text at query time,
  so an index persisted elsewhere, a vector store that keeps its own text, or a pipeline whose docstore
  skipped unchanged documents still links: `index.as_query_engine(node_postprocessors=[EpicNodeCompiler()])`.
  Texts already compiled in this process cost nothing; texts already in the chunk store cost a store lookup.
- `EpicSynthesizer` (a BaseSynthesizer) hands the retrieved node texts to the engine as chunks of a
  RagRequest: no string matching; the linking figures land in `Response.metadata`. Its calls are
  `EpicLLM.chat(messages, chunks=[...])` (and the stream / async forms), so LlamaIndex's instrumentation
  (LLMChat* events, spans) and callback handlers (TokenCountingHandler) see them as any LLM call.

`EpicLLM.chat` and its stream / async forms take `chunks=[...]` (texts, ChunkRefs or nodes) per call, with
the messages as system messages and one user question: the chunks go to the engine as a RagRequest (and
`template=` is its user message, with `{context}` and `{question}` slots), as ChatEpic takes them.

Every response carries the figures in `additional_kwargs` (CompletionResponse / ChatResponse; for streams,
on the last item): ttft_s, total_s, prompt_tokens, linked_tokens, recomputed_tokens, chunk_hits,
chunk_misses, policy, finish_reason, completion_tokens, chunk_keys; and OpenAI-shaped token usage in
`raw["usage"]` (prompt_tokens, completion_tokens, total_tokens, prompt_tokens_details.cached_tokens = linked
tokens), where LlamaIndex's `TokenCountingHandler` reads it. Sampling options (top_p, top_k, min_p, seed,
penalties, logprobs/top_logprobs) are fields, `additional_kwargs` entries or per-call keywords; an unknown
one is an error naming it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Generator, Sequence
from contextvars import ContextVar
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
from llama_index.core.callbacks import CallbackManager
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle, TransformComponent
from llama_index.core.settings import Settings

from ..config import EngineConfig
from ..prompt import DEFAULT_TEMPLATE, check_template
from ..types import ChunkRef, Delta, Generation, RagRequest
from ._shared import (
    adopt_engine,
    generation_stats,
    model_label,
    option_defaults,
    peek_shared_engine,
    sampling_of,
    shared_engine,
    usage_of,
)

__all__ = ["EpicLLM", "EpicChunkCompiler", "EpicNodeCompiler", "EpicSynthesizer", "node_llm_text"]

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


class _SharedEngine:
    """For the pipeline components: the engine given, else the process's shared engine (made on first use)."""

    _engine: Any

    def __init__(self, engine: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._engine = adopt_engine(engine) if engine is not None else None

    @property
    def engine(self):
        if self._engine is None:
            self._engine = shared_engine()
        return self._engine


class EpicChunkCompiler(_SharedEngine, TransformComponent):
    """Ingestion step: compiles every node's LLM-visible text, so queries link it from cache.

    Nodes pass through unchanged. Place it after the steps that set node text and metadata (splitters,
    extractors); embedding steps may come before or after. A new instance (new process) misses the
    IngestionPipeline cache for this step, so chunks are compiled (or found in the store) again there.
    """

    policy: str | None = Field(default=None, description="Compile for this link policy (default: engine's).")
    batch_size: int = Field(default=32, gt=0, description="Chunks per compile batch.")
    session: str = Field(
        default_factory=lambda: uuid.uuid4().hex,
        description="Per instance: keeps the pipeline cache from skipping compilation.",
    )

    _engine: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "EpicChunkCompiler"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        texts = list(dict.fromkeys(t for t in (node_llm_text(n) for n in nodes) if t))
        self.engine.compile(texts, policy=self.policy, batch_size=self.batch_size)
        return nodes

    async def acall(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        _ = self.engine  # created (if need be) on this thread, not in the worker
        return await asyncio.to_thread(self.__call__, nodes, **kwargs)


def _compile_new(engine: Any, texts: Sequence[str], policy: str | None, batch_size: int) -> int:
    """Compile the texts not yet known to this process's engine (the store skips those it holds); returns how
    many were handed to compile."""
    fresh = [t for t in dict.fromkeys(texts) if t and t.strip() and t not in engine.text_index]
    if fresh:
        engine.compile(fresh, policy=policy, batch_size=batch_size)
    return len(fresh)


class EpicNodeCompiler(_SharedEngine, BaseNodePostprocessor):
    """Query-time step: compiles the retrieved nodes' LLM-visible text, so the LLM call links them.

    Nodes pass through unchanged (order and scores kept). Use it last among the node postprocessors (after
    rerankers and filters, which may change what reaches the prompt), e.g.
    `index.as_query_engine(node_postprocessors=[EpicNodeCompiler()])`, or in a context chat engine.
    For a corpus compiled at ingest (EpicChunkCompiler) in this process it costs a dictionary lookup per node;
    texts whose KV the chunk store already holds (a persisted index after a restart) cost a store lookup.
    """

    policy: str | None = Field(default=None, description="Compile for this link policy (default: engine's).")
    batch_size: int = Field(default=32, gt=0, description="Chunks per compile batch.")

    _engine: Any = PrivateAttr(default=None)

    @classmethod
    def class_name(cls) -> str:
        return "EpicNodeCompiler"

    def _postprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        _compile_new(self.engine, [node_llm_text(n.node) for n in nodes], self.policy, self.batch_size)
        return nodes

    async def _apostprocess_nodes(
        self, nodes: list[NodeWithScore], query_bundle: QueryBundle | None = None
    ) -> list[NodeWithScore]:
        _ = self.engine  # created (if need be) on this thread, not in the worker
        return await asyncio.to_thread(self._postprocess_nodes, nodes, query_bundle)


class _Stats:
    """Carries one synthesis' linking figures into its Response.metadata (now, or when a stream ends)."""

    def __init__(self) -> None:
        self.stats: dict[str, Any] | None = None
        self.target: dict[str, Any] | None = None

    def put(self, stats: dict[str, Any]) -> None:
        self.stats = dict(stats)
        if self.target is not None:
            self.target.update(self.stats)

    def attach(self, response: Any) -> Any:
        if getattr(response, "metadata", None) is None:
            try:
                response.metadata = {}
            except Exception:
                return response
        self.target = response.metadata
        if self.stats is not None:
            self.target.update(self.stats)
        return response


# The figures of the synthesis under way in this thread / task: get_response leaves them here and
# _prepare_response_output (called next by BaseSynthesizer.synthesize) puts them into the Response, so
# synthesize itself stays BaseSynthesizer's (one span, no private keyword in its arguments).
_PENDING_STATS: ContextVar[_Stats | None] = ContextVar("epic_synthesizer_stats", default=None)


log = logging.getLogger(__name__)

# EpicSynthesizer's default text_qa_template: the engine's default RagRequest prompt in LlamaIndex's slot names.
DEFAULT_TEXT_QA_TEMPLATE = PromptTemplate(
    DEFAULT_TEMPLATE.replace("{context}", "{context_str}").replace("{question}", "{query_str}")
)


def _rag_template(prompt: BasePromptTemplate) -> str | None:
    """A LlamaIndex text_qa_template as a RagRequest template (None: the engine's default). Its
    `{context_str}` gets the chunks, `{query_str}` the question; partially formatted variables are filled."""
    tmpl = prompt.get_template() if isinstance(prompt, BasePromptTemplate) else None
    if not isinstance(tmpl, str):
        raise ValueError("text_qa_template must be a LlamaIndex text prompt template")
    for name, value in (getattr(prompt, "kwargs", None) or {}).items():
        if name not in ("context_str", "query_str"):
            tmpl = tmpl.replace("{" + name + "}", str(value))
    tmpl = check_template(tmpl.replace("{context_str}", "{context}").replace("{query_str}", "{question}"))
    return None if tmpl == DEFAULT_TEMPLATE else tmpl


class EpicSynthesizer(BaseSynthesizer):
    """Answers from the retrieved nodes given to the engine as chunks (RagRequest), no prompt matching.

    Use with `RetrieverQueryEngine(retriever, response_synthesizer=EpicSynthesizer(...))` or
    `index.as_query_engine(response_synthesizer=...)`. `Response.metadata` gets the linking figures
    (for a streaming response, once the stream has ended).
    """

    def __init__(
        self,
        llm: EpicLLM | None = None,
        engine: Any = None,
        system: str | None = None,
        streaming: bool = False,
        callback_manager: CallbackManager | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        policy: str | None = None,
        text_qa_template: BasePromptTemplate | None = None,
    ) -> None:
        if llm is None:
            current = Settings._llm  # not Settings.llm: that resolves (and may build) a default LLM
            llm = current if isinstance(current, EpicLLM) and engine is None else EpicLLM(engine=engine)
        if not isinstance(llm, EpicLLM):
            raise ValueError("EpicSynthesizer needs an EpicLLM")
        super().__init__(llm=llm, callback_manager=callback_manager, streaming=streaming)
        self._epic: EpicLLM = llm
        self._system = system
        self._qa_prompt: BasePromptTemplate = DEFAULT_TEXT_QA_TEMPLATE
        self._template: str | None = None
        if text_qa_template is not None:
            self._update_prompts({"text_qa_template": text_qa_template})
        self._overrides = {
            k: v
            for k, v in (("max_tokens", max_tokens), ("temperature", temperature), ("policy", policy))
            if v is not None
        }

    def _get_prompts(self) -> dict[str, Any]:
        return {"text_qa_template": self._qa_prompt}

    def _update_prompts(self, prompts: dict[str, Any]) -> None:
        if "text_qa_template" in prompts:
            prompt = prompts["text_qa_template"]
            self._template = _rag_template(prompt)  # a template without both slots fails here
            self._qa_prompt = prompt

    def _llm_call(self, query_str: str, text_chunks: Sequence[str], response_kwargs: dict[str, Any]):
        """The EpicLLM chat call answering `query_str` from the chunks: its messages (the system prompt and the
        question) and keywords (sampling, and the chunks that fit the window, passed as `chunks=`)."""
        kw = {**self._overrides, **response_kwargs}
        max_tokens = self._epic._sampling(kw)["max_tokens"]  # an unknown option fails here, naming it
        messages = ([ChatMessage(role=MessageRole.SYSTEM, content=self._system)] if self._system else []) + [
            ChatMessage(role=MessageRole.USER, content=query_str)
        ]
        chunks = [c.strip() for c in text_chunks if c and c.strip()]
        if chunks:  # none: a plain chat prompt
            req = self._pack(RagRequest(query_str, chunks, self._system, self._template), max_tokens)
            kw["chunks"] = list(req.chunks)
            if self._template is not None:
                kw["template"] = self._template
        return messages, kw

    def _pack(self, req: RagRequest, max_tokens: int) -> RagRequest:
        """The request with as many leading chunks (retrieval order: best first) as leave `max_tokens` of the
        window for the answer, as LlamaIndex's PromptHelper reserves num_output; a first chunk too long on its
        own is cut to fit. Chunks stay whole otherwise (a cut chunk is a new text, compiled on the fly)."""
        engine = self._epic.engine
        window = engine.max_model_len

        def size(chunks: list[str]) -> int | None:
            try:
                return len(engine.prepare(RagRequest(req.question, chunks, req.system, req.template)).token_ids)
            except ValueError as e:  # over the window; any other bad input is the caller's error, raised
                if "context window" in str(e):  # the prompt, or one chunk on its own, is too long
                    return None
                raise

        def fits(n: int) -> bool:
            got = size(req.chunks[:n])
            return got is not None and got + max_tokens <= window

        if fits(len(req.chunks)):
            return req
        lo, hi = 0, len(req.chunks)  # fits(lo) (or lo == 0), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        if lo == 0:  # the first chunk alone is too long: keep the head of it that fits
            base = size(["."])
            tok = engine.tokenizer
            ids = tok.encode(req.chunks[0], add_special_tokens=False)
            budget = window - max_tokens - (base or window) - 8  # 8: slack for tokens merging at the cut
            if budget <= 0:
                return req  # no room even for a little text: the engine's error says why
            log.info("EpicSynthesizer: first chunk cut from %d to %d tokens to fit the window", len(ids), budget)
            return RagRequest(req.question, [tok.decode(ids[:budget])], req.system, req.template)
        log.info("EpicSynthesizer: %d of %d chunks fit the window", lo, len(req.chunks))
        return RagRequest(req.question, req.chunks[:lo], req.system, req.template)

    # The LLM calls go through EpicLLM.chat / stream_chat (and their async forms), so LlamaIndex's
    # instrumentation (LLMChat* events, spans) and callback handlers (TokenCountingHandler) see them.
    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        stats = _Stats()
        _PENDING_STATS.set(stats)
        messages, kw = self._llm_call(query_str, text_chunks, response_kwargs)
        if not self._streaming:
            r = self._epic.chat(messages, **kw)
            stats.put(r.additional_kwargs)
            return r.message.content or ""
        responses = self._epic.stream_chat(messages, **kw)

        def gen() -> Generator[str, None, None]:
            for r in responses:
                if r.delta:
                    yield r.delta
                if r.additional_kwargs:  # the last item: the figures
                    stats.put(r.additional_kwargs)

        return gen()

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        stats = _Stats()
        _PENDING_STATS.set(stats)
        messages, kw = self._llm_call(query_str, text_chunks, response_kwargs)
        if not self._streaming:
            r = await self._epic.achat(messages, **kw)
            stats.put(r.additional_kwargs)
            return r.message.content or ""
        responses = await self._epic.astream_chat(messages, **kw)

        async def gen() -> AsyncGenerator[str, None]:
            async for r in responses:
                if r.delta:
                    yield r.delta
                if r.additional_kwargs:
                    stats.put(r.additional_kwargs)

        return gen()

    def _prepare_response_output(self, response_str: Any, source_nodes: list[NodeWithScore]) -> Any:
        response = super()._prepare_response_output(response_str, source_nodes)
        stats = _PENDING_STATS.get()
        if stats is None:
            return response
        _PENDING_STATS.set(None)
        return stats.attach(response)
