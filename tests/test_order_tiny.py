"""Chunk order by relevance (tiny two-layer Llama): with order="relevance" a RagRequest's chunks are placed in
ascending order of the retriever's scores, the most relevant nearest the question; the answer is the one the
same chunks listed in that order give, the request reports the order, and bad scores change nothing."""

from __future__ import annotations

import pytest

from epic_rag import RagRequest

CHUNKS = [f"def step_{i}(x):\n    return x * {i + 2} - {i}\n" for i in range(3)]
QUESTION = "Which function multiplies by 3?"


def _first(g) -> dict[int, float]:
    lp = g.logprobs[0]
    return {a["token_id"]: a["logprob"] for a in lp["top_logprobs"]} | {lp["token_id"]: lp["logprob"]}


def test_relevance_order_places_the_best_scored_chunk_last_and_reports_the_order(tiny_engine):
    req = RagRequest(question=QUESTION, chunks=CHUNKS, scores=[0.9, 0.1, 0.5])
    g = tiny_engine.generate(req, max_tokens=2, order="relevance", logprobs=5, policy="legolink-16")
    assert g.chunk_order == [1, 2, 0]
    same = RagRequest(question=QUESTION, chunks=[CHUNKS[1], CHUNKS[2], CHUNKS[0]])
    listed = tiny_engine.generate(same, max_tokens=2, logprobs=5, policy="legolink-16")
    assert g.chunk_keys == listed.chunk_keys and listed.chunk_order is None
    assert g.token_ids == listed.token_ids
    assert max(abs(a - b) for a, b in zip(_first(g).values(), _first(listed).values())) < 2e-3
    given = tiny_engine.generate(req, max_tokens=2, policy="legolink-16")  # the default keeps the given order
    assert given.chunk_order is None and given.chunk_keys == [listed.chunk_keys[i] for i in (2, 0, 1)]


@pytest.mark.parametrize(
    ("scores", "order", "message"),
    [
        ([0.1, 0.2], "relevance", "scores must be a list of 3 numbers"),
        ([0.1, float("nan"), 0.2], "relevance", "finite numbers"),
        ([0.1, 0.2, 0.3], "best-first", "order must be one of"),
    ],
)
def test_bad_scores_or_orders_are_refused_with_a_clear_error(tiny_engine, scores, order, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine.prepare(RagRequest(question=QUESTION, chunks=CHUNKS, scores=scores), order=order)


def test_relevance_order_of_a_rendered_prompt_is_refused(tiny_engine):
    with pytest.raises(ValueError, match="reorders a RagRequest"):
        tiny_engine.prepare("Documents: none. Question?", order="relevance")
