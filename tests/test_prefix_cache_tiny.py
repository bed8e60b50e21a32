"""Linking beside vLLM's prefix cache in the embedded engine (tiny two-layer Llama, fp32): the engine's requests
share their tenant's cache_salt, so vLLM's prefix cache serves exact blocks between them, and a link's blocks
only in the link's own scope. After a link under each policy, the same prompt tokens run exactly (`prefix`, which
reads vLLM's prefix cache) answer with `full`'s logprobs (`full` reuses nothing), while the link itself is off
them (the test can fail); a follow-up turn over the same linked chunks finds its first turn's blocks."""

from __future__ import annotations

import dataclasses

import pytest

from epic_rag import RagRequest, parse_policy

# Approximate on a two-layer model (CacheBlend's check layer is its last layer there: exact; see the serve test).
POLICIES = ["naive", "legolink-16", "legolink-epic-16", "query-20"]
CHUNKS = [
    f"def window_sum_{i}(values, width={i + 2}):\n    total, out = 0, []\n    for j, v in enumerate(values):\n"
    f"        total += v\n        if j >= width:\n            total -= values[j - width]\n        out.append(total)\n"
    f"    return out\n"
    for i in range(4)
]
SAME, OFF = 2e-3, 2e-2
BLOCK = 128  # vLLM's CPU block size: full blocks are what its prefix cache holds


def _first(g) -> dict[int, float]:
    lp = g.logprobs[0]
    return {a["token_id"]: a["logprob"] for a in lp["top_logprobs"]} | {lp["token_id"]: lp["logprob"]}


def _gap(a, b) -> float:
    fa, fb = _first(a), _first(b)
    return max(abs(fa[t] - fb[t]) for t in fa) if set(fa) == set(fb) else float("inf")


def _as(engine, prep, policy: str):
    return engine.generate(dataclasses.replace(prep, policy=parse_policy(policy)))


@pytest.mark.parametrize("policy", POLICIES)
def test_after_a_link_the_same_tokens_run_exactly_get_fulls_logprobs_from_the_shared_prefix_cache(tiny_engine, policy):
    req = RagRequest(question="Which function sums a window?", chunks=CHUNKS)
    prep = tiny_engine.prepare(req, max_tokens=2, policy=policy, logprobs=5)
    assert len(prep.token_ids) > 2 * BLOCK
    linked = tiny_engine.generate(prep)
    assert linked.chunk_hits + linked.chunk_misses == len(CHUNKS)
    full = _as(tiny_engine, prep, "full")  # a salt of its own: nothing reused
    exact = _as(tiny_engine, prep, "prefix")  # the tenant's salt, as the link's
    again = _as(tiny_engine, prep, "prefix")  # an exact repeat: served by vLLM's prefix cache
    assert again.prefix_cached_tokens >= (len(prep.token_ids) // BLOCK) * BLOCK
    assert _gap(exact, full) < SAME and _gap(again, full) < SAME
    assert _gap(linked, full) > OFF, f"{policy}: the link is not approximate here; the test proves nothing"


def test_a_follow_up_turn_over_the_same_linked_chunks_finds_its_first_turns_blocks(tiny_engine):
    tiny_engine.compile(CHUNKS)
    docs = "\n\n".join(CHUNKS)
    turn1 = [{"role": "user", "content": f"Documents:\n{docs}\n\nWhich function uses width 3?"}]
    first = tiny_engine.generate(tiny_engine.render_messages(turn1), max_tokens=8, policy="query-20")
    assert first.chunk_hits == len(CHUNKS) and first.prefix_cached_tokens < BLOCK  # nothing to reuse yet
    turn2 = turn1 + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And which one uses width 5?"},
    ]
    second = tiny_engine.generate(tiny_engine.render_messages(turn2), max_tokens=8, policy="query-20")
    assert second.chunk_hits == len(CHUNKS)
    # every full block of the first turn's prompt came from its link, in the link's scope: nothing relinked
    assert second.prefix_cached_tokens >= (first.prompt_tokens // BLOCK) * BLOCK > 0
    assert second.recomputed_tokens <= second.prompt_tokens - second.prefix_cached_tokens  # the rest linked
    # another policy over the same chunks is another link: it reuses none of those blocks
    other = tiny_engine.generate(tiny_engine.render_messages(turn2), max_tokens=8, policy="legolink-16")
    assert other.prefix_cached_tokens < BLOCK
