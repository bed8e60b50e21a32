"""Behaviour on the real SmolLM2-135M-Instruct (fp32)."""

from __future__ import annotations

import pytest

from epic_rag import RagRequest

pytestmark = pytest.mark.smollm

PASSAGES = [
    "The Larkspur Bridge opened in 1931. It crosses the Vell River and is 412 metres long. "
    "It was designed by the engineer Maria Ostrand.",
    "Tovin is a small town in the northern hills. Its main industry is wool, and its market is held "
    "every Thursday in the old square.",
    "The secret passcode for the archive room is 7314. Only the head librarian may share it.",
]


def test_smollm_legolink_with_full_k_generates_the_same_tokens_as_full(smol_engine):
    req = RagRequest(question="How long is the Larkspur Bridge?", chunks=PASSAGES)
    full = smol_engine.generate(req, max_tokens=24, policy="full")
    linked = smol_engine.generate(req, max_tokens=24, policy="legolink-8192")
    assert linked.chunk_hits + linked.chunk_misses == 3
    assert linked.token_ids == full.token_ids


def test_smollm_answers_from_linked_chunks_in_any_order(smol_engine):
    smol_engine.compile(PASSAGES)
    for order in (PASSAGES, PASSAGES[::-1]):
        g = smol_engine.generate(
            RagRequest(question="What is the secret passcode for the archive room?", chunks=order),
            max_tokens=24,
            policy="legolink-16",
        )
        assert g.chunk_misses == 0 and g.chunk_hits == 3
        assert "7314" in g.text, g.text
        assert 0 < g.recomputed_tokens < g.prompt_tokens and g.linked_tokens > 0
