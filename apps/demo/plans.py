"""A chat or text completion request resolved into an engine request (a Plan): model, sampling and limits
checked, chunks retrieved (or named by id), the prompt validated and tokenized once."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid

from fastapi import HTTPException

from epic_rag.policy import parse_policy
from epic_rag.types import RagRequest

from .config import DemoConfig
from .library import ChunkRecord
from .schemas import ChatCompletionRequest, CompletionRequest
from .state import DemoState


class Plan:
    """One request resolved: engine request, sources, sampling settings; `text`: a /v1/completions request."""

    def __init__(
        self,
        req,
        sources: list[dict],
        policy: str,
        max_tokens: int,
        temperature: float,
        retrieval_s: float,
        text: bool = False,
    ) -> None:
        self.req = req
        self.sources = sources
        self.policy = policy
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.retrieval_s = retrieval_s
        self.text = text
        self.id = f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())


def check_model_and_sampling(cfg: DemoConfig, body, max_tokens: int) -> str:
    """The checks both endpoints share; returns the policy's name."""
    if body.model and body.model not in (cfg.served_model, cfg.model, "epic-rag", "default"):
        raise HTTPException(404, f"model {body.model!r} not found; this server serves {cfg.served_model!r}")
    if max_tokens > cfg.max_tokens_limit:
        raise HTTPException(400, f"max_tokens must be at most {cfg.max_tokens_limit}, got {max_tokens}")
    try:
        return parse_policy(body.policy or cfg.policy).name
    except ValueError as e:
        raise HTTPException(400, f"policy: {e}") from None


async def prepare(engine, req, body, max_tokens: int, temperature: float, policy: str, too_long_hint: str = ""):
    """Validated and tokenized once, off the event loop; the engine's own checks decide what fits."""
    try:
        prepare = functools.partial(
            engine.prepare,
            req,
            max_tokens=max_tokens,
            temperature=temperature,
            policy=policy,
            stop=body.stop_list,
            **body.sampling_options(),
        )
        return await asyncio.to_thread(prepare)
    except ValueError as e:
        if "context window" in str(e):
            raise HTTPException(400, f"prompt too long: {e}{too_long_hint}") from None
        raise HTTPException(400, f"invalid request: {e}") from None


async def plan_text(state: DemoState, body: CompletionRequest, engine) -> Plan:
    """/v1/completions: the prompt as given; compiled chunk texts found in it are linked."""
    cfg = state.cfg
    max_tokens = body.max_tokens or cfg.default_max_tokens
    policy = check_model_and_sampling(cfg, body, max_tokens)
    if len(body.prompt) > cfg.max_prompt_chars:
        raise HTTPException(400, f"prompt too long: {len(body.prompt)} characters, limit {cfg.max_prompt_chars}")
    temperature = 0.0 if body.temperature is None else float(body.temperature)
    req = await prepare(engine, body.prompt, body, max_tokens, temperature, policy)
    return Plan(req, [], policy, max_tokens, temperature, 0.0, text=True)


async def plan_chat(state: DemoState, body: ChatCompletionRequest, engine) -> Plan:
    cfg = state.cfg
    max_tokens = body.max_completion_tokens or body.max_tokens or cfg.default_max_tokens
    policy = check_model_and_sampling(cfg, body, max_tokens)
    if len(body.messages) > cfg.max_messages:
        raise HTTPException(400, f"messages: at most {cfg.max_messages} messages per request")
    chars = sum(len(m.text) for m in body.messages)
    if chars > cfg.max_prompt_chars:
        raise HTTPException(400, f"prompt too long: {chars} characters of messages, limit {cfg.max_prompt_chars}")
    last = body.messages[-1]
    if last.role != "user" or not last.text.strip():
        raise HTTPException(400, "messages: the last message must be a non-empty user message")
    top_k = cfg.top_k if body.top_k is None else body.top_k
    if top_k > cfg.max_top_k:
        raise HTTPException(400, f"top_k must be at most {cfg.max_top_k}, got {top_k}")
    temperature = 0.0 if body.temperature is None else float(body.temperature)

    system = "\n".join(m.text for m in body.messages if m.role in ("system", "developer") and m.text) or None
    dialog = [m for m in body.messages if m.role in ("user", "assistant")]
    question = last.text.strip()

    t0 = time.perf_counter()
    picked: list[tuple[ChunkRecord, float | None]] = []
    if body.chunk_ids:
        found, missing = state.library.get_chunks(list(dict.fromkeys(body.chunk_ids)))
        if missing:
            raise HTTPException(400, f"chunk_ids: unknown chunk ids {missing[:5]} (ids look like 'doc.txt#0')")
        picked = [(c, None) for c in found]
    elif body.use_retrieval and top_k > 0:
        picked = await asyncio.to_thread(state.library.search, question, top_k)
    retrieval_s = time.perf_counter() - t0
    if not body.chunk_ids and body.use_retrieval and top_k > 0:
        state.metrics.retrieval.observe(retrieval_s)

    if picked:
        earlier = dialog[:-1][-cfg.history_messages :]
        if earlier:
            lines = "\n".join(f"{m.role.capitalize()}: {m.text.strip()}" for m in earlier)
            question = f"{question}\n\n(Earlier in this conversation:\n{lines})"
        chunks = [c.ref if c.ref is not None and c.ref.key else c.text for c, _ in picked]
        req = RagRequest(question=question, chunks=chunks, system=system)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m.role, "content": m.text} for m in dialog[-(cfg.history_messages + 1) :]
        ]
        req = engine.render_messages(msgs)
    req = await prepare(engine, req, body, max_tokens, temperature, policy, " (lower top_k or shorten messages)")
    sources = [
        {
            "n": i + 1,
            "id": c.id,
            "doc": c.doc,
            "index": c.index,
            "score": None if s is None else round(s, 4),
            "tokens": c.ref.num_tokens if c.ref is not None and c.ref.key else None,
            "compiled": c.ref is not None and bool(c.ref.key),
            "text": c.text,
        }
        for i, (c, s) in enumerate(picked)
    ]
    return Plan(req, sources, policy, max_tokens, temperature, retrieval_s)
