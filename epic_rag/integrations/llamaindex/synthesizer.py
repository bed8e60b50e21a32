"""EpicSynthesizer: a LlamaIndex response synthesizer that hands the retrieved nodes to the engine as chunks (no
string matching), through EpicLLM.chat so LlamaIndex's instrumentation sees an ordinary LLM call."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Generator, Sequence
from contextvars import ContextVar
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    MessageRole,
)
from llama_index.core.callbacks import CallbackManager
from llama_index.core.prompts import BasePromptTemplate, PromptTemplate
from llama_index.core.response_synthesizers.base import BaseSynthesizer
from llama_index.core.schema import NodeWithScore
from llama_index.core.settings import Settings

from ...prompt import DEFAULT_TEMPLATE, check_template
from ...types import RagRequest
from .llm import EpicLLM


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
