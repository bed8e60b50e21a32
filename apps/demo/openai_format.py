"""The OpenAI response shapes the demo answers in that are not the engine's own: the `epic` figures, usage,
legacy completions logprobs."""

from __future__ import annotations

from epic_rag.integrations import usage_of
from epic_rag.types import Generation

from .plans import Plan


def epic_figures(plan: Plan, gen: Generation | None) -> dict:
    """The `epic` object of a response: policy, retrieval time, sources and, once answered, the linking figures."""
    out = {"policy": plan.policy, "retrieval_s": round(plan.retrieval_s, 4), "sources": plan.sources}
    if gen is not None:
        if gen.policy != plan.policy:  # auto: the policy it ran, and the name the request gave
            out.update(policy=gen.policy, policy_asked=plan.policy)
        if gen.escalated:  # auto's guard ran it with exact KV, not a link (engine/guard.py)
            out["escalated"] = gen.escalated
        out.update(
            ttft_s=round(gen.ttft_s, 4),
            total_s=round(gen.total_s, 4),
            prompt_tokens=gen.prompt_tokens,
            linked_tokens=gen.linked_tokens,
            recomputed_tokens=gen.recomputed_tokens,
            chunk_hits=gen.chunk_hits,
            chunk_misses=gen.chunk_misses,
        )
    return out


def usage(gen: Generation) -> dict:
    """OpenAI usage; prompt_tokens_details.cached_tokens: the prompt tokens linked from compiled chunks (or, for
    the `prefix` policy, served by vLLM's prefix cache), i.e. not recomputed."""
    return usage_of(gen)


def text_logprobs(entries: list[dict] | None, offset: int = 0) -> dict | None:
    """Logprobs in the legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    if entries is None:
        return None
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in entries:
        out["tokens"].append(t["token"])
        out["token_logprobs"].append(t["logprob"])
        out["top_logprobs"].append({a["token"]: a["logprob"] for a in t["top_logprobs"]})
        out["text_offset"].append(offset)
        offset += len(t["token"])
    return out
