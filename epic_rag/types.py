"""Boundary dataclasses of the public API (engine <-> callers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from .policy import Policy


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A compiled chunk (what EpicEngine.compile returns).

    Attributes:
        key: addresses its KV in the chunk store; content-derived (keys.py: model, tokenizer, KV dtype, compile
            lead, tenant and tokens).
        num_tokens: its tokens.
        text: its text, when known (the engine then needs no look-up for its tokens).
    """

    key: str
    num_tokens: int
    text: str | None = None


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk given as text inside a segment list (compiled on the fly when missing)."""

    text: str


# One piece of a pre-rendered prompt: a plain string is literal glue text (never cached),
# a Chunk or ChunkRef is a position-independent chunk.
Segment = str | Chunk | ChunkRef


@dataclass(slots=True)
class RagRequest:
    """A question over retrieved chunks, rendered through the model's chat template.

    Attributes:
        question: the user's question.
        chunks: the retrieved chunks in prompt order: ChunkRefs, or texts (compiled on the fly when missing).
        system: a system message (None: the model's default).
        template: the user message, with a `{context}` and a `{question}` slot (each once; other braces are
            text). `{context}` becomes the chunks as "Document i:\n<chunk>\n\n". None: prompt.DEFAULT_TEMPLATE.
        scores: the retriever's score of each chunk (higher: more relevant), for `order="relevance"`; None:
            the packaged MiniLM scores them against the question when that order is asked for.
    """

    question: str
    chunks: list[str | ChunkRef] = field(default_factory=list)
    system: str | None = None
    template: str | None = None
    scores: list[float] | None = None


@dataclass(slots=True)
class PlacedChunk:
    """One chunk of a prepared prompt: its tokens at prompt positions [start, start + len(token_ids))."""

    token_ids: list[int]
    start: int = 0
    sink: int = 0  # sink tokens right before `start` that belong to this chunk's linked span


class Sampling(TypedDict, total=False):
    """Per-request keywords of EpicEngine.prepare and every generate/stream method."""

    max_tokens: int  # default 64 (capped to what the context window leaves)
    temperature: float  # default 0.0: greedy
    policy: str | None  # default: the engine's policy
    # A RagRequest's chunk order: "given" (default: as listed) or "relevance" (ascending score, the most relevant
    # chunk last, nearest the question; free under linking: keys are rotated to their places anyway).
    order: str
    stop: list[str] | str | None
    # Passed to vLLM's SamplingParams (checked in epic_rag.sampling; anything else is an error naming it).
    top_p: float
    top_k: int  # 0 or -1: off
    min_p: float
    seed: int  # per-request seed: a sampled answer repeats
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logprobs: int  # 0-20: Generation.logprobs gets the chosen token's logprob and this many alternatives
    # OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema"}}: the answer
    # is decoded under vLLM's structured outputs (a JSON grammar), so it parses.
    response_format: dict[str, Any]
    min_tokens: int  # at least this many tokens before EOS or a stop string may end the answer
    ignore_eos: bool  # keep generating past EOS up to max_tokens (benchmarks: fixed-length answers)
    skip_special_tokens: bool  # default True: special tokens are left out of the text
    # vLLM's prefix-cache namespace (under the engine's tenant): by default all of a tenant's requests share one,
    # so exact blocks (template, system prompt, exact repeats) and a link's blocks (for the same link: a
    # follow-up turn) are reused; requests with another salt reuse nothing of them. `full` never reuses.
    cache_salt: str


@dataclass(slots=True)
class PreparedRequest:
    """A request validated and tokenized once (`EpicEngine.prepare`); generate/stream take it as it is.
    Nothing is compiled or loaded from the store until it is submitted."""

    token_ids: list[int]
    chunks: list[PlacedChunk]
    policy: Policy
    max_tokens: int
    temperature: float
    stop: list[str] | None = None
    options: dict[str, Any] = field(default_factory=dict)  # the further Sampling options, checked
    chunk_order: list[int] | None = None  # a reordered RagRequest: its chunks' indices in prompt order
    escalated: str | None = None  # `auto` ran it past a link, and why (engine/guard.py)


# One generated token's log-probability: {"token_id", "token", "logprob", "top_logprobs": [{"token_id",
# "token", "logprob"}, ...]} (top_logprobs: the `logprobs` most likely tokens at that step, best first).
TokenLogprob = dict[str, Any]


@dataclass(slots=True)
class Delta:
    """One step's new output of a streaming request (`EpicEngine.stream_events` yields these, then a Generation).

    Attributes:
        text: the new text.
        token_ids: the new tokens.
        finished: whether the request ended with this step.
        finish_reason: vLLM's ("stop", "length", ...) once finished.
        t: time.perf_counter() when the step produced it.
        cached_tokens: prompt tokens vLLM served from its own prefix cache.
        logprobs: one TokenLogprob per token in token_ids, when requested.
        kv_transfer_params: the KV connector's outcome, on the finished delta.
    """

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    t: float
    cached_tokens: int | None = None
    logprobs: list[TokenLogprob] | None = None
    kv_transfer_params: dict | None = None


@dataclass(slots=True)
class Generation:
    """Result of one request, with the linking figures that explain its TTFT.

    Attributes:
        text: the answer.
        token_ids: its tokens.
        ttft_s: time to the first token, from submission.
        total_s: time to the last token.
        prompt_tokens: tokens in the prompt.
        linked_tokens: prompt tokens not recomputed: their KV came from compiled chunks or from vLLM's prefix
            cache (prefix_cached_tokens of them); linked_tokens + recomputed_tokens == prompt_tokens.
        recomputed_tokens: prompt tokens the linker recomputed (chunk heads, glue, blend picks).
        chunk_hits: chunks found compiled.
        chunk_misses: chunks compiled for this request.
        policy: the link policy it ran under.
        finish_reason: vLLM's ("stop", "length", ...).
        chunk_keys: the keys of its chunks, in prompt order.
        prefix_cached_tokens: prompt tokens served by vLLM's prefix cache: exact blocks (the template and
            system prompt before the first chunk, a `prefix` policy's repeats) or, for a link, the blocks of an
            earlier request that linked the same chunks the same way (a follow-up turn; never exact blocks'
            stand-ins, see connector/scheduler.py on_new_request).
        logprobs: one TokenLogprob per generated token, when `logprobs` was requested.
        chunk_order: for a RagRequest run with `order="relevance"`, the indices of its chunks in the order they
            were placed (the last one nearest the question); None when the order was the given one.
        escalated: why policy `auto` ran this request as `policy` rather than a link ("lookalike-keys": the
            question's key has a near twin in another linked chunk, see engine/guard.py); None when it linked.
    """

    text: str
    token_ids: list[int]
    ttft_s: float
    total_s: float
    prompt_tokens: int
    linked_tokens: int
    recomputed_tokens: int
    chunk_hits: int
    chunk_misses: int
    policy: str
    finish_reason: str | None = None
    chunk_keys: list[str] = field(default_factory=list)
    prefix_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    chunk_order: list[int] | None = None
    escalated: str | None = None
