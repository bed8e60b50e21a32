"""Sampling options through the engine on the tiny random Llama: they reach vLLM, a seed repeats a sampled
answer, logprobs come back per token, and an unknown or bad option is an error naming it."""

from __future__ import annotations

import math

import pytest

from epic_rag import RagRequest

CHUNKS = ["def add(a, b):\n    return a + b\n", "class Stack:\n    def push(self, x):\n        self.items.append(x)\n"]


def _req():
    return RagRequest(question="which function adds?", chunks=list(CHUNKS))


def test_unknown_sampling_option_is_an_error_naming_it(tiny_engine):
    with pytest.raises(ValueError, match="'best_of'"):
        tiny_engine.prepare(_req(), best_of=2)
    with pytest.raises(ValueError, match="'tools'"):
        tiny_engine.generate(_req(), max_tokens=2, tools=[])


@pytest.mark.parametrize(
    "option, value",
    [
        ("top_p", 0.0),
        ("temperature", 3.0),  # vLLM's limit is 2: refused here, not by a vLLM error inside generation
        ("top_k", -2),
        ("min_p", 1.5),
        ("presence_penalty", 3),
        ("repetition_penalty", 0),
        ("seed", 1.5),
        ("seed", 2**64),
        ("repetition_penalty", float("inf")),
        ("top_p", float("nan")),
        ("min_tokens", -1),
        ("min_tokens", 2.0),
        ("ignore_eos", 1),
        ("skip_special_tokens", "no"),
    ],
)
def test_bad_sampling_values_are_errors_naming_the_option(tiny_engine, option, value):
    with pytest.raises(ValueError, match=option):
        tiny_engine.prepare(_req(), **{option: value})


def test_prepare_keeps_the_options_for_vllm(tiny_engine):
    prep = tiny_engine.prepare(_req(), top_p=0.9, top_k=20, seed=3, repetition_penalty=1.1, min_p=None)
    assert prep.options == {"top_p": 0.9, "top_k": 20, "seed": 3, "repetition_penalty": 1.1}


def test_seed_repeats_a_sampled_linked_answer_and_another_seed_differs(tiny_engine):
    kw = dict(max_tokens=24, temperature=1.5, top_k=0, top_p=1.0, policy="legolink-16")
    a = tiny_engine.generate(_req(), seed=11, **kw)
    b = tiny_engine.generate(_req(), seed=11, **kw)
    others = [tiny_engine.generate(_req(), seed=s, **kw).token_ids for s in (12, 13, 14)]
    assert b.chunk_hits == len(CHUNKS) and a.token_ids == b.token_ids
    assert any(o != a.token_ids for o in others)


def test_top_k_one_is_greedy(tiny_engine):
    greedy = tiny_engine.generate(_req(), max_tokens=12, temperature=0.0)
    top1 = tiny_engine.generate(_req(), max_tokens=12, temperature=1.5, top_k=1, seed=5)
    assert top1.token_ids == greedy.token_ids


def test_logprobs_come_back_per_generated_token_with_k_alternatives(tiny_engine):
    g = tiny_engine.generate(_req(), max_tokens=6, logprobs=3)
    assert g.logprobs is not None and len(g.logprobs) == len(g.token_ids)
    for tid, lp in zip(g.token_ids, g.logprobs):
        assert lp["token_id"] == tid and isinstance(lp["token"], str)
        assert lp["logprob"] <= 0.0 and not math.isnan(lp["logprob"])
        alts = lp["top_logprobs"]
        assert len(alts) == 3 and alts[0]["logprob"] >= alts[1]["logprob"] >= alts[2]["logprob"]
        assert alts[0]["token_id"] == tid  # greedy: the chosen token is the most likely one
    assert tiny_engine.generate(_req(), max_tokens=2).logprobs is None


def test_streamed_logprobs_match_the_tokens(tiny_engine):
    events = list(tiny_engine.stream_events(_req(), max_tokens=5, logprobs=0))
    g = events[-1]
    assert [lp["token_id"] for lp in g.logprobs] == g.token_ids
    assert all(lp["top_logprobs"] == [] for lp in g.logprobs)


def test_a_request_that_links_nothing_says_so_in_stats_and_the_debug_log(tiny_engine, caplog):
    import logging

    with caplog.at_level(logging.DEBUG, logger="epic_rag.engine.request"):
        g = tiny_engine.generate("a prompt holding no compiled chunk text at all", max_tokens=2, policy="legolink-16")
    assert g.chunk_hits == g.chunk_misses == g.linked_tokens == 0 and g.recomputed_tokens == g.prompt_tokens
    assert "linked nothing under legolink-16" in caplog.text


def test_ignore_eos_generates_exactly_max_tokens_and_min_tokens_reach_vllm(tiny_engine):
    fixed = tiny_engine.generate(_req(), max_tokens=40, ignore_eos=True, skip_special_tokens=False)
    assert len(fixed.token_ids) == 40 and fixed.finish_reason == "length"
    eos = tiny_engine.tokenizer.eos_token_id
    banned = tiny_engine.generate(_req(), max_tokens=12, min_tokens=12, stop=None)
    assert len(banned.token_ids) == 12 and eos not in banned.token_ids
