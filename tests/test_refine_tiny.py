"""Neighbour-aware compile (EpicEngine.refine) on the tiny two-layer Llama, fp32: a chunk refined behind the
chunk that precedes it in a prompt gets a record of its own, keyed by its neighbours, and links of that chunk
use it. Linked with nothing recomputed (legolink-0) in that very order, the prompt's KV is then exactly a plain
prefill's, so the answer's logprobs equal full's, where the chunk's plain record (compiled alone) is measurably
off them (the test can fail)."""

from __future__ import annotations

import numpy as np
import pytest

from epic_rag import RagRequest

NEAR = (
    "def ledger_total(rows):\n    total = 0\n    for account, amount in rows:\n        total += amount\n"
    "    return total\n"
)
CHUNK = (
    "def ledger_average(rows):\n    total, n = 0, 0\n    for account, amount in rows:\n        total += amount\n"
    "        n += 1\n    return total / max(n, 1)\n"
)
OTHER = "The archive room's passcode is 7314 and the door opens after nine."
SAME, OFF = 2e-3, 2e-2


def _first(g) -> dict[int, float]:
    lp = g.logprobs[0]
    return {a["token_id"]: a["logprob"] for a in lp["top_logprobs"]} | {lp["token_id"]: lp["logprob"]}


def _gap(a, b) -> float:
    fa, fb = _first(a), _first(b)
    return max(abs(fa[t] - fb[t]) for t in fa) if set(fa) == set(fb) else float("inf")


def _run(engine, policy: str, salt: str):
    req = RagRequest(question="Which function divides by the count?", chunks=[NEAR, CHUNK])
    return engine.generate(req, max_tokens=2, policy=policy, logprobs=5, cache_salt=salt)


@pytest.fixture(scope="module")
def plain_first(tiny_engine):
    """The link before any refine: the chunk's plain record (compiled alone)."""
    return _run(tiny_engine, "legolink-0", "refine-before")


def test_a_chunk_refined_behind_its_neighbour_links_exactly_where_the_neighbour_precedes_it(tiny_engine, plain_first):
    full = _run(tiny_engine, "full", "refine-full")
    assert _gap(plain_first, full) > OFF, "the plain link is exact here: the test proves nothing"
    plain_key = tiny_engine.chunk_key(tiny_engine.chunks.chunk_tokens(CHUNK))
    (ref,) = tiny_engine.refine([CHUNK], [[NEAR]])
    assert ref.key != plain_key and ref.key.startswith("lead")  # keyed by its lead: never the plain record
    linked = _run(tiny_engine, "legolink-0", "refine-after")
    assert linked.chunk_keys[1] == ref.key and linked.chunk_keys[0] == plain_first.chunk_keys[0]
    assert _gap(linked, full) < SAME
    plain = tiny_engine.store.get(plain_key)
    assert plain is not None  # the plain record is kept (what links fall back to)
    # the refined record holds the chunk's KV only (its neighbours are not stored with it): the store grows by
    # one record of the plain one's size per refined chunk
    assert tiny_engine.store.get(ref.key).nbytes == plain.nbytes


def test_refine_nearest_picks_the_neighbours_by_the_embeddings_given(tiny_engine):
    # by these vectors NEAR and CHUNK are each other's nearest, OTHER's nearest is CHUNK
    emb = np.array([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    refs = tiny_engine.refine_nearest([NEAR, CHUNK, OTHER], k=1, embeddings=emb)
    # a record's key names its lead: the same chunk behind the same neighbour is the same record
    expected = [tiny_engine.refine([c], [[n]])[0].key for c, n in ((NEAR, CHUNK), (CHUNK, NEAR), (OTHER, CHUNK))]
    assert [r.key for r in refs] == expected and len(set(expected)) == 3


def test_refine_refuses_mismatched_neighbour_lists_and_changes_nothing(tiny_engine):
    before = tiny_engine.chunks.form_of(tiny_engine.chunks.chunk_tokens(OTHER))
    with pytest.raises(ValueError, match="one list of neighbour texts per chunk"):
        tiny_engine.refine([OTHER], [])
    with pytest.raises(ValueError, match="at least two chunks"):
        tiny_engine.refine_nearest([OTHER])
    assert tiny_engine.chunks.form_of(tiny_engine.chunks.chunk_tokens(OTHER)) == before


def test_auto_links_fast_only_where_every_chunk_is_refined_and_says_which_it_ran(tiny_engine):
    a, b = "The vault code for bay one is 4417.", "The vault code for bay two is 9051."
    req = RagRequest(question="What is the vault code for bay two?", chunks=[a, b])
    tiny_engine.unrefine([a, b])
    assert tiny_engine.generate(req, max_tokens=1, policy="auto").policy == "query-20"  # compiled alone
    tiny_engine.refine([b], [[a]])
    assert tiny_engine.generate(req, max_tokens=1, policy="auto").policy == "query-20"  # one chunk still plain
    tiny_engine.refine([a], [[b]])
    g = tiny_engine.generate(req, max_tokens=1, policy="auto")
    assert g.policy == "legolink-16" and g.recomputed_tokens < g.prompt_tokens
    assert tiny_engine.unrefine([a, b]) == 2
    assert tiny_engine.generate(req, max_tokens=1, policy="auto").policy == "query-20"


def test_chunks_sharing_a_neighbour_set_keep_their_refined_form_when_one_is_unrefined(tiny_engine):
    x, y, n = "Shelf X holds the blue binders.", "Shelf Y holds the red binders.", "Shelf N holds the ledgers."
    tiny_engine.refine([x, y], [[n], [n]])  # one lead (the template with n): one form for both
    tok = tiny_engine.chunks.chunk_tokens
    assert tiny_engine.chunks.form_of(tok(x)) == tiny_engine.chunks.form_of(tok(y)) != tiny_engine.chunks.variant
    tiny_engine.unrefine([x])
    assert not tiny_engine.chunks.is_refined(tok(x)) and tiny_engine.chunks.is_refined(tok(y))
    g = tiny_engine.generate(RagRequest(question="Which shelf?", chunks=[y]), max_tokens=1, policy="legolink-0")
    assert g.chunk_keys == [tiny_engine.chunk_key(tok(y), tiny_engine.chunks.form_of(tok(y)))]
    tiny_engine.unrefine([y])


def test_auto_answers_a_lookup_whose_key_has_a_twin_in_another_chunk_with_exact_kv_and_says_why(tiny_engine):
    a = "Part HT-8957-B (cable gland) is listed at $923.88 per unit."
    b = "Part HT-8975-B (hex bolt set) is listed at $547.37 per unit."
    q = "What is the unit price of part HT-8957-B?"
    g = tiny_engine.generate(RagRequest(question=q, chunks=[a, b]), max_tokens=2, policy="auto", logprobs=5)
    assert g.policy == "prefix" and g.escalated == "lookalike-keys"  # exact KV: vLLM's prefix caching
    assert g.chunk_hits == g.chunk_misses == 0 and g.chunk_keys == []  # nothing linked
    full = tiny_engine.generate(RagRequest(question=q, chunks=[a, b]), max_tokens=2, policy="full", logprobs=5)
    assert g.token_ids == full.token_ids and _gap(g, full) < SAME
    # unlike `full`, its exact blocks stay in vLLM's prefix cache: the same prompt again (a follow-up turn's
    # head) is served from it
    again = tiny_engine.generate(RagRequest(question=q, chunks=[a, b]), max_tokens=1, policy="auto")
    assert again.policy == "prefix" and again.prefix_cached_tokens > 0 and full.prefix_cached_tokens == 0
    # the twins compiled together in one chunk: that chunk saw both, so the request is linked
    one = tiny_engine.generate(RagRequest(question=q, chunks=[f"{a} {b}", OTHER]), max_tokens=1, policy="auto")
    assert one.policy == "query-20" and one.escalated is None
