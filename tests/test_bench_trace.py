"""The RAG trace benchmark's pure parts, without an engine: Zipf popularity, questions from pydoc chunks, the
trace's conversations and follow-up turns, the trace as a request source, hit rates over time and their
steadiness, agreement with full, the follow-up figures, the target verdicts and the command line."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter

import pytest

from epic_rag.bench import trace as T
from epic_rag.bench import trace_run as R
from epic_rag.bench.trace import Question, TraceSettings


# ---------------------------------------------------------------------- popularity
def test_zipf_weights_fall_as_a_power_of_the_rank_and_sum_to_one():
    w = T.zipf_weights(300, 1.0)
    assert sum(w) == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(2.0) and w[0] / w[9] == pytest.approx(10.0)
    assert w[0] == pytest.approx(1 / sum(1 / r for r in range(1, 301)))
    assert T.zipf_weights(4, 0.0) == pytest.approx([0.25] * 4)  # exponent 0: uniform
    w2 = T.zipf_weights(10, 2.0)
    assert w2[0] / w2[2] == pytest.approx(9.0)


def test_zipf_draws_follow_the_weights_and_repeat_with_the_seed():
    draws = T.zipf_draws(50, 20000, 1.0, random.Random(3))
    assert draws == T.zipf_draws(50, 20000, 1.0, random.Random(3))
    assert min(draws) == 0 and max(draws) <= 49
    freq = Counter(draws)
    w = T.zipf_weights(50, 1.0)
    for r in (0, 1, 4, 20):
        assert freq[r] / 20000 == pytest.approx(w[r], abs=0.012)
    flat = Counter(T.zipf_draws(5, 20000, 0.0, random.Random(1)))
    assert all(abs(c / 20000 - 0.2) < 0.02 for c in flat.values())


def test_popularity_ranks_are_a_seeded_shuffle_of_the_chunks():
    order = T.popularity_order(300, 0)
    assert sorted(order) == list(range(300)) and order == T.popularity_order(300, 0)
    assert order != list(range(300)) and order != T.popularity_order(300, 1)


# ---------------------------------------------------------------------- questions from chunks
FUNCS = """FUNCTIONS
    dump(obj, fp, *, indent=None)
        Serialize ``obj`` as a JSON formatted stream to ``fp``.  More text follows
        on a second line.

    loads(s, *, cls=None)
        Deserialize ``s`` to a Python object.

    _private(x)
        Never asked about.
"""

CLASS = """class JSONDecoder(builtins.object)
     |  JSONDecoder(*, object_hook=None)
     |
     |  Simple JSON decoder that reads documents.
     |
     |  decode(self, s)
     |      Return the Python representation of ``s``.
     |
     |  __repr__(self, /)
     |      Return repr(self) for this object.
"""

DUNDERS = """     |  __index__(self, /)
     |      Return self converted to an integer, if suitable.
"""

PROSE = """The following documentation is automatically generated from the Python source files.

DESCRIPTION
    JSON (JavaScript Object Notation) is a subset of JavaScript syntax used as a lightweight data
    interchange format.
"""


def test_documented_functions_and_methods_are_found_with_their_first_sentence():
    entries = {f.name: f for f in T.chunk_entries("json", FUNCS)}
    assert set(entries) == {"dump", "loads"}  # private names are left out
    assert entries["dump"].summary == "Serialize obj as a JSON formatted stream to fp"
    assert entries["dump"].entry == "dump(obj, fp, *, indent=None)"
    methods = {f.name: f.summary for f in T.chunk_entries("json", CLASS)}
    assert methods == {
        "JSONDecoder": "Simple JSON decoder that reads documents",  # the class's signature line
        "JSONDecoder.decode": "Return the Python representation of s",
        "JSONDecoder.__repr__": "Return repr(self) for this object",
    }


def test_questions_come_from_public_entries_else_dunders_else_prose_else_the_module():
    qs = T.chunk_questions("json", FUNCS)
    assert [q.text for q in qs] == [
        "How do I serialize obj as a JSON formatted stream to fp with json?",
        "How do I deserialize s to a Python object with json?",
    ]
    dump = "`json.dump` (dump(obj, fp, *, indent=None)): Serialize obj as a JSON formatted stream to fp."
    assert qs[0].answer == dump
    assert all("__repr__" not in q.answer for q in T.chunk_questions("json", CLASS))  # dunders only when alone
    assert "__index__" in T.chunk_questions("re", DUNDERS)[0].answer
    (prose,) = T.chunk_questions("json", PROSE)  # the pydoc boilerplate is skipped
    assert prose.text.startswith('What does the json documentation mean by "JSON (JavaScript Object Notation)')
    assert prose.text.endswith(' ..."?')  # quoted up to QUESTION_WORDS words
    (bare,) = T.chunk_questions("json", "NAME\n    json\n")
    assert bare.text == "What is documented here about the json module?"
    assert T.chunk_questions("json", FUNCS) == qs  # deterministic


# ---------------------------------------------------------------------- the trace
def _questions(n_chunks: int, per: int = 3) -> list[list[Question]]:
    return [[Question(f"q{c}.{j}", f"a{c}.{j}") for j in range(per)] for c in range(n_chunks)]


def _retrieve(queries: list[str], k: int) -> list[list[int]]:
    """A stand-in for embedding search: chunk c's questions retrieve c first, then the next chunks."""
    out = []
    for q in queries:
        c = int(q[1:].split(".")[0])
        out.append([(c + i) % 40 for i in range(k)])
    return out


def test_the_trace_is_deterministic_and_depends_on_the_seed():
    s = TraceSettings(chunks=40)
    a = T.build_trace(_questions(40), _retrieve, 300, s)
    assert a == T.build_trace(_questions(40), _retrieve, 300, s)
    assert T.trace_digest(a) == T.trace_digest(T.build_trace(_questions(40), _retrieve, 300, s))
    other = T.build_trace(_questions(40), _retrieve, 300, dataclasses.replace(s, seed=1))
    assert T.trace_digest(other) != T.trace_digest(a)
    # a longer trace begins with the shorter one: the follow-up measurement's tail changes nothing before it
    assert T.build_trace(_questions(40), _retrieve, 400, s)[:300] == a


def test_follow_ups_repeat_their_conversations_chunks_in_order_with_the_earlier_turns():
    s = TraceSettings(chunks=40, follow_share=0.3, max_turns=3, min_gap=2, max_gap=24)
    trace = T.build_trace(_questions(40), _retrieve, 2000, s)
    assert [r.index for r in trace] == list(range(2000))
    convs = T.conversations(trace)
    last: dict[int, int] = {}
    for r in trace:
        first = convs[r.conversation][0]
        assert s.k_min <= len(r.chunks) <= s.k_max and len(set(r.chunks)) == len(r.chunks)
        assert r.chunks[0] == r.topic  # the stand-in retrieval puts the topic first
        assert len(r.questions) == r.turn + 1 and len(r.answers) == r.turn <= s.max_turns - 1
        if r.turn:
            assert r.chunks == first.chunks and r.topic == first.topic  # same chunks, same order
            prev = convs[r.conversation][r.turn - 1]
            assert r.questions[:-1] == prev.questions and r.answers[:-1] == prev.answers
            assert r.answers[-1] == "a" + prev.questions[-1][1:]  # the previous question's reference answer
            assert r.questions[-1] not in r.questions[:-1]  # a new question
            assert s.min_gap <= r.index - last[r.conversation] <= s.max_gap
        last[r.conversation] = r.index
    share = sum(r.turn > 0 for r in trace) / len(trace)
    assert 0.25 <= share <= 0.3  # the asked share, less the requests with no open conversation
    assert {len(r.chunks) for r in trace if r.turn == 0} == set(range(s.k_min, s.k_max + 1))
    assert T.build_trace(_questions(40), _retrieve, 300, dataclasses.replace(s, follow_share=0.0))[-1].turn == 0


def test_a_topic_whose_questions_are_used_up_gets_generic_follow_ups_answered_by_its_first_answer():
    s = TraceSettings(chunks=40, follow_share=0.5, max_turns=3, min_gap=1)
    trace = T.build_trace(_questions(40, per=1), _retrieve, 300, s)
    later = [r for r in trace if r.turn > 0]
    assert later and all(q in T.FOLLOW_UPS for r in later for q in r.questions[1:])
    assert all(r.answers[0] == "a" + r.questions[0][1:] for r in later)
    assert all(len(set(r.questions)) == len(r.questions) for r in later)


def test_topics_follow_zipf_popularity():
    s = TraceSettings(chunks=40, follow_share=0.0, zipf_s=1.0)
    trace = T.build_trace(_questions(40), _retrieve, 4000, s)
    freq = Counter(r.topic for r in trace)
    order = T.popularity_order(40, s.seed)
    w = T.zipf_weights(40, 1.0)
    assert freq[order[0]] / 4000 == pytest.approx(w[0], abs=0.02)
    assert freq[order[0]] > 5 * freq[order[9]] > 0  # 10x apart in expectation
    uniform = Counter(r.topic for r in T.build_trace(_questions(40), _retrieve, 4000, dataclasses.replace(s, zipf_s=0)))
    assert max(uniform.values()) < 2.5 * 4000 / 40


def test_a_follow_ups_chat_begins_with_its_first_turns_message_and_holds_the_documents_in_order():
    s = TraceSettings(chunks=40, follow_share=0.5, max_turns=3, min_gap=1)
    trace = T.build_trace(_questions(40), _retrieve, 200, s)
    texts = [f"chunk text {c}" for c in range(40)]
    third = next(r for r in trace if r.turn == 2)
    first = T.conversations(trace)[third.conversation][0]
    msgs = third.messages(texts)
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    assert msgs[0] == first.messages(texts)[0]  # the first turn's prompt is the follow-up's prefix
    body = msgs[0]["content"]
    assert body.startswith("Read the documents and answer the question briefly.\n\nDocument 1:\nchunk text ")
    positions = [body.index(f"Document {i + 1}:\n{texts[c]}\n\n") for i, c in enumerate(third.chunks)]
    assert positions == sorted(positions) and body.endswith(f"Question: {third.questions[0]}")
    turns = [third.answers[0], third.questions[1], third.answers[1], third.questions[2]]
    assert [m["content"] for m in msgs[1:]] == turns


def test_the_retrieved_chunks_are_refined_behind_their_nearest_corpus_chunks_the_nearest_last():
    import faiss
    import numpy as np

    from epic_rag.bench.pydocqa import Retriever

    # five chunks on a circle: each one's nearest are its two sides, the one beside it nearer
    angles = np.array([0.0, 0.3, 0.7, 2.0, 3.5])
    emb = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)  # [5, 2], normalised
    index = faiss.IndexFlatIP(2)
    index.add(emb)
    texts = [f"chunk {i}" for i in range(5)]
    calls = []

    class Recorder:  # EpicEngine.refine's arguments, nothing compiled
        def refine(self, chunks, neighbours):
            calls.append((list(chunks), [list(n) for n in neighbours]))

    trace = [T.TraceRequest(0, 0, 0, 1, (1, 2), ("q",), ()), T.TraceRequest(1, 1, 0, 1, (1, 3), ("q",), ())]
    assert R.refine_retrieved(Recorder(), Retriever(texts, index), trace, 2) == 3
    (chunks, near) = calls[0]
    assert chunks == ["chunk 1", "chunk 2", "chunk 3"]  # the retrieved ones only, never chunk 0 or 4
    assert near == [["chunk 2", "chunk 0"], ["chunk 0", "chunk 1"], ["chunk 4", "chunk 2"]]  # nearest last
    assert R.refine_retrieved(Recorder(), Retriever(texts, index), trace, 0) == 0 and len(calls) == 1


def test_the_trace_source_hands_out_the_trace_in_order_and_refuses_to_run_past_it():
    trace = T.build_trace(_questions(40), _retrieve, 10, TraceSettings(chunks=40))
    src = R.TraceRequests(trace, [f"t{c}" for c in range(40)], render=lambda msgs: msgs)
    got = src.unloaded(3) + src.step(0, 4) + src.step(1, 3)
    assert [o.tag for o in got] == list(range(10))
    assert got[5].make() == trace[5].messages(src.texts)  # rendered when sent
    with pytest.raises(RuntimeError, match="holds 10 requests"):
        src.step(2, 1)


# ---------------------------------------------------------------------- hit rates over time
def _req(t, prompt=1000, cached=0, hits=0, misses=0, status="ok", turn=0):
    return {
        "t": t,
        "status": status,
        "prompt_tokens": prompt,
        "prefix_cached": cached,
        "chunk_hits": hits,
        "chunk_misses": misses,
        "turn": turn,
    }


def test_hit_rates_are_pooled_per_window_by_arrival_over_completed_requests():
    reqs = [
        _req(5, 1000, 500, 4, 0),
        _req(50, 3000, 0, 3, 1),
        _req(70, 2000, 1000, 2, 2),
        _req(80, status="error"),
        _req(200, 1000, 1000, 4, 0),
    ]
    w = R.hit_windows(reqs, 60.0)
    assert [(x["start_s"], x["requests"]) for x in w] == [(0.0, 2), (60.0, 1), (180.0, 1)]  # empty windows left out
    assert w[0]["prefix_hit_rate"] == pytest.approx(500 / 4000)  # tokens, not a mean of per-request rates
    assert w[0]["store_hit_rate"] == pytest.approx(7 / 8)
    assert w[1]["prefix_hit_rate"] == 0.5 and w[1]["store_hit_rate"] == 0.5
    assert all(0 <= x["prefix_hit_rate"] <= 1 for x in w)
    unlinked = R.hit_windows([_req(1, 100, 0)], 60.0)
    assert unlinked[0]["store_hit_rate"] is None  # nothing linked: no store rate, not 0


def test_a_hit_rate_that_holds_is_steady_and_one_that_decays_is_not():
    def windows(rates):
        return R.hit_windows([_req(30 + 60 * i, 1000, int(1000 * r), 10, 0) for i, r in enumerate(rates)], 60.0)

    steady = R.steadiness(windows([0.1, 0.5, 0.52, 0.48, 0.5, 0.49]), "prefix_hit_rate", 60.0, 0.05)
    assert steady["steady"] is True and steady["windows"] == 5  # the first minute is left out
    assert steady["earlier"] == pytest.approx(0.51) and steady["later"] == pytest.approx((0.48 + 0.5 + 0.49) / 3)
    decays = R.steadiness(windows([0.6, 0.6, 0.6, 0.3, 0.2]), "prefix_hit_rate", 60.0, 0.05)
    assert decays["steady"] is False and decays["decay"] == pytest.approx(0.6 - 0.25)
    assert R.steadiness(windows([0.1, 0.1, 0.9]), "prefix_hit_rate", 60.0, 0.05)["steady"] is True  # rising
    assert R.steadiness(windows([0.5, 0.5]), "prefix_hit_rate", 60.0, 0.05)["steady"] is None  # one window after
    assert R.steadiness(windows([1, 1, 1]), "store_hit_rate", 60.0, 0.05)["later"] == 1.0


# ---------------------------------------------------------------------- agreement, follow-ups, targets
def test_agreement_compares_first_lines_after_normalisation_and_whole_answers_by_f1():
    answers = {
        "full": ["The json.dumps function.\nMore text", "Use re.sub.", "It returns a list."],
        "prefix": ["the json.dumps function!\nOther text", "Use re.sub.", "It returns a list."],
        "query-20": ["Use json.loads.", "Use re.sub.", "It returns a tuple."],
    }
    rows = {r["policy"]: r for r in R.agreement_rows(answers)}
    assert rows["full"]["first_line_match"] == 100.0 and rows["full"]["token_f1"] == 100.0
    assert rows["prefix"]["first_line_match"] == 100.0 and rows["prefix"]["token_f1"] < 100.0
    assert rows["query-20"]["first_line_match"] == pytest.approx(100 / 3)
    assert 0 < rows["query-20"]["token_f1"] < rows["prefix"]["token_f1"]
    assert R.agreement_rows({"prefix": ["a"]}) == []  # without full there is nothing to agree with


def _f(ttft, cached=0, recomputed=0, prompt=1500):
    return {"ttft_s": ttft, "prompt_tokens": prompt, "prefix_cached": cached, "recomputed": recomputed}


def test_the_follow_up_summary_gives_medians_and_what_the_cached_link_saves():
    rows = [
        {"linked": _f(0.30, 1280, 150), "exact": _f(0.25, 1408), "cold": _f(1.5, 0, 420)},
        {"linked": _f(0.40, 1152, 200), "exact": _f(0.30, 1280), "cold": _f(1.7, 0, 500)},
        {"linked": _f(0.35, 1280, 180), "exact": _f(0.35, 1408), "cold": _f(1.6, 0, 470)},
    ]
    s = R.followup_summary(rows)
    assert (s["linked_ttft_s"], s["exact_ttft_s"], s["cold_ttft_s"]) == (0.35, 0.30, 1.6)
    assert s["linked_vs_exact"] == pytest.approx(0.35 / 0.30)
    assert s["linked_prefix_cached"] == 1280 and s["cold_vs_linked"] == pytest.approx(1.6 / 0.35)
    assert R.followup_summary([])["linked_vs_exact"] is None


def _summary(acc_rps, ref_rps, acc_ttft, ref_ttft, ended="saturation"):
    return [
        {"policy": "prefix", "ended_by": "saturation", "vs_prefix": 1.0, "unloaded_ttft_p50_s": ref_ttft},
        {"policy": "query-20", "ended_by": ended, "vs_prefix": acc_rps / ref_rps, "unloaded_ttft_p50_s": acc_ttft},
    ]


def _per(rates):
    windows = R.hit_windows([_req(30 + 60 * i, 1000, int(1000 * r), 5, 0) for i, r in enumerate(rates)], 60.0)
    return {"query-20": {"steady": [R.steadiness(windows, k, 60.0, 0.05) for k in R.RATES]}}


def test_the_targets_are_met_or_missed_on_the_measured_figures():
    agree = {"rows": R.agreement_rows({"full": ["a", "b"], "prefix": ["a", "b"], "query-20": ["a", "b"]})}
    follow = {"linked_vs_exact": 1.1, "conversations": 8}
    met = R.targets(_summary(1.0, 0.4, 1.0, 2.5), _per([0.2, 0.5, 0.5, 0.5]), agree, follow, "query-20")
    assert [t["met"] for t in met] == [True, True, True, True, True]
    agree_off = {"rows": R.agreement_rows({"full": ["a", "b"], "prefix": ["a", "b"], "query-20": ["a", "c"]})}
    missed = R.targets(
        _summary(1.0, 0.6, 2.0, 2.5, ended="cap"),
        _per([0.2, 0.6, 0.6, 0.3, 0.3]),
        agree_off,
        {"linked_vs_exact": 1.5, "conversations": 8},
        "query-20",
    )
    assert [t["met"] for t in missed] == [False, False, False, False, False]
    assert "query-20's sweep ended by cap" in missed[0]["note"] and missed[2]["measured"] == 50.0
    assert missed[3]["measured"] == pytest.approx(30.0)
    # prefix's sweep cut before saturation: its req/s is a floor, so a ratio over the target decides nothing
    prefix_cut = _summary(1.0, 0.4, 1.0, 2.5)
    prefix_cut[0]["ended_by"] = "cap"
    cut = R.targets(prefix_cut, _per([0.2, 0.5, 0.5, 0.5]), agree, follow, "query-20")
    assert cut[0]["met"] is None and "prefix's sweep ended by cap" in cut[0]["note"]
    undecided = R.targets([], {}, {"rows": []}, {}, "query-20")
    assert [t["met"] for t in undecided] == [None] * 5


# ---------------------------------------------------------------------- command line
def test_trace_runs_the_demos_model_by_default_and_its_options_override_the_settings():
    from epic_rag.bench.cli import PART_MODEL, parse_args, trace_settings

    args = parse_args(["trace", "--trace-chunks", "200", "--zipf", "1.2", "--follow-share", "0.4", "--max-minutes=5"])
    assert args.model is None and PART_MODEL["trace"] == "qwen2.5-coder-0.5b-instruct"
    s = trace_settings(args)
    assert (s.chunks, s.zipf_s, s.follow_share, s.max_minutes, s.chunk_tokens) == (200, 1.2, 0.4, 5.0, 256)
    assert args.accurate_policy == "auto" and R.trace_policies() == ["prefix", "auto", "legolink-16", "full"]
    assert s.refine_neighbours == 2  # the retrieved chunks refined, as the demo refines its corpus
    assert trace_settings(parse_args(["trace", "--refine-neighbours", "0"])).refine_neighbours == 0
    assert R.trace_policies("legolink-16") == ["prefix", "legolink-16", "full"]
    assert trace_settings(parse_args(["trace", "--quick"])) == T.QUICK_SETTINGS
    for bad in (["--follow-share", "1.5"], ["--zipf", "-1"], ["--trace-chunks", "3"], ["--chunk-tokens", "8"]):
        with pytest.raises(SystemExit):
            trace_settings(parse_args(["trace", *bad]))
    for bad in (["--accurate-policy", "query"], ["--scored", "-1"], ["--refine-neighbours", "-1"]):
        with pytest.raises(SystemExit):
            trace_settings(parse_args(["trace", *bad]))


def test_the_default_trace_follows_the_issue_and_fits_its_time():
    s = TraceSettings()
    assert (s.k_min, s.k_max, s.chunks, s.chunk_tokens, s.zipf_s, s.follow_share) == (4, 8, 300, 256, 1.0, 0.3)
    # four policies' sweeps within their budgets (x the cut allowance) leave room for the rest in an hour
    assert 4 * s.max_minutes * s.cut_after <= 40 and s.hit_window_s <= s.max_minutes * 60 / 4
    assert T.trace_length(s) >= 1 + s.unloaded_requests + s.max_steps * s.max_requests
    assert math.isclose(sum(T.zipf_weights(s.chunks, s.zipf_s)), 1.0)


# ---------------------------------------------------------------------- report
def _policy_run(policy, steps, unloaded_ttft, cached_share, linked=True):
    """A policy's entry of trace.json: sweep rows (offered, completed req/s), its requests' cache figures."""
    rows = [
        {
            "policy": policy,
            "step": i,
            "rate": off,
            "requests": 8,
            "completed": 8,
            "errors": 0,
            "cut": 0,
            "offered_rps": off,
            "completed_rps": done,
            "ttft_p50_s": 1.0,
            "ttft_p99_s": 2.0,
            "itl_p50_s": 0.05,
            "itl_p99_s": 0.1,
            "e2e_p50_s": 3.0,
            "e2e_p99_s": 4.0,
            "dispatch_lag_max_s": 0.001,
            "saturated": None if done >= 0.8 * off else "throughput",
        }
        for i, (off, done) in enumerate(steps)
    ]
    reqs = [
        _req(20 * i, 1600, int(1600 * cached_share), 6 if linked else 0, 0, turn=i % 3 == 2) | {"i": i}
        for i in range(24)
    ]
    windows = R.hit_windows(reqs, 60.0)
    unloaded = {"ttft_p50_s": unloaded_ttft, "ttft_p99_s": 2 * unloaded_ttft, "itl_p99_s": 0.1}
    ok = [r for r in reqs if r["status"] == "ok"]
    return {
        "unloaded": unloaded,
        "rows": rows,
        "ended_by": "saturation",
        "sent": list(range(24)),
        "hit_rates": {
            "all": R._rates(ok),
            "first_turns": R._rates([r for r in ok if not r["turn"]]),
            "follow_ups": R._rates([r for r in ok if r["turn"]]),
        },
        "windows": windows,
        "steady": [R.steadiness(windows, k, 60.0, 0.05) for k in R.RATES],
    }


def _trace_data():
    per = {
        # every sweep saturated at its first step: no half-saturation figure anywhere (a short run's case)
        "prefix": _policy_run("prefix", [(0.125, 0.08)], 6.0, 0.2, linked=False),
        "query-20": _policy_run("query-20", [(0.25, 0.1)], 2.0, 0.3),
        "full": _policy_run("full", [(0.125, 0.05)], 7.0, 0.0, linked=False),
    }
    answers = {"prefix": ["a b", "c"], "query-20": ["a b", "d"], "full": ["a b", "c"]}
    rows = [{"linked": _f(0.5, 1280, 100), "exact": _f(0.45, 1280), "cold": _f(2.0, 0, 400)}]
    follow = {"policy": "query-20", "rows": [{**rows[0], "conversation": 3}], **R.followup_summary(rows)}
    agree = {"requests": [{"i": 0, "turn": 0}, {"i": 5, "turn": 1}], "answers": answers}
    agree["rows"] = [r | {"prefix_cached_tokens": 0} for r in R.agreement_rows(answers)]
    summary = R.summarize(per)
    return {
        "command": "epic-rag bench trace",
        "machine": {"cpu": "CPU", "cores": 2, "date": "d", "commit": "c"},
        "model": "qwen (float32)",
        "dtype": "float32",
        "settings": dataclasses.asdict(TraceSettings()),
        "accurate_policy": "query-20",
        "policies": per,
        "trace": {"digest": "x", "chunks": 300, "follow_up_share": 0.28, "mean_chunks_per_request": 6.0},
        "workload_s": 30.0,
        "compile_s": 200.0,
        "total_s": 2400.0,
        "rows": [r for d in per.values() for r in d["rows"]],
        "summary": summary,
        "agreement": agree,
        "followups": follow,
        "targets": R.targets(summary, per, agree, follow, "query-20"),
    }


def test_the_report_prints_the_targets_summary_hit_rates_and_a_picture_even_where_a_figure_is_missing(tmp_path):
    from epic_rag.bench.trace_report import trace_markdown, trace_plot

    data = _trace_data()
    by = {r["policy"]: r for r in data["summary"]}
    assert all(r["half_ttft_p50_s"] is None for r in data["summary"])
    assert by["query-20"]["vs_prefix"] == pytest.approx(1.25)
    assert by["prefix"]["store_hit_rate"] is None and by["query-20"]["prefix_hit_rate"] == pytest.approx(0.3)
    plot = trace_plot(tmp_path, data)
    assert plot == "trace.png" and (tmp_path / plot).stat().st_size > 10_000
    md = trace_markdown(data, plot)
    assert "Command: `epic-rag bench trace`" in md and "dtype float32" in md
    assert "| query-20 saturated req/s >= 2x prefix's | 1.25x | **NO** |" in md
    assert "| query-20 TTFT p50 (one request at a time) <= 0.5x prefix's | 0.33x | yes |" in md
    assert "first lines equal to full's for >= 90 % of the scored subset | 50.0 % | **NO** |" in md
    assert "| query-20 | 0.100 | 1.25x |" in md and "| prefix | 0.080 | 1.00x |" in md
    assert "| full | 0-60 | 3 | 0.0 % | n/a |" in md and "| query-20 | 0-60 | 3 | 30.0 % | 100.0 % |" in md
    assert "## Agreement with full" in md and "| query-20 | 2 | 50.0 % |" in md
    assert "| 3 | 1500 | 0.500 (1280 cached, 100 recomp.) |" in md and "![trace.png](trace.png)" in md
