"""`epic-rag bench trace --quick` on SmolLM2: the whole harness runs, and its JSON holds what the report claims
(checks the harness and the cache accounting, not the speed)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.smollm


def test_quick_trace_sends_every_policy_the_same_trace_and_reports_hits_where_caching_can_give_them(
    smol_engine, tmp_path
):
    from epic_rag.bench.cli import parse_args, run
    from epic_rag.bench.trace import QUICK_SETTINGS as Q
    from epic_rag.bench.trace_run import trace_policies

    run(parse_args(["trace", "--quick", "--out", str(tmp_path), "--no-progress"]), engine=smol_engine)
    data = json.loads((tmp_path / "trace.json").read_text())
    assert list(data["policies"]) == trace_policies() == ["prefix", "auto", "legolink-16", "full"]
    # every chunk the trace retrieves was refined behind its nearest: auto links all of them fast
    assert data["refine"]["neighbours"] == Q.refine_neighbours and 0 < data["refine"]["chunks"] <= Q.chunks
    assert data["refine"]["seconds"] > 0
    assert {r["ran"] for r in data["policies"]["auto"]["requests"]} == {"legolink-16"}
    assert {r["ran"] for r in data["policies"]["full"]["requests"]} == {"full"}
    assert data["trace"]["chunks"] == Q.chunks and data["compile_s"] > 0 and data["dtype"] == "float32"

    # the same trace for every policy: each was sent its first requests, in order, each answered
    for p, d in data["policies"].items():
        n = len(d["sent"])
        assert d["sent"] == list(range(n)) and n >= 1 + Q.unloaded_requests + Q.min_requests, p
        assert [r["i"] for r in d["requests"]] == d["sent"]
        assert all(r["status"] == "ok" for r in d["requests"]), p
        assert d["ended_by"] in ("saturation", "cap", "max-steps") and 1 <= len(d["rows"]) <= Q.max_steps
        for w in d["windows"]:
            assert 0 <= w["prefix_hit_rate"] <= 1
            assert w["store_hit_rate"] is None or 0 <= w["store_hit_rate"] <= 1
        assert sum(w["requests"] for w in d["windows"]) == n
    full, prefix, acc = (data["policies"][p] for p in ("full", "prefix", "auto"))
    assert all(r["prefix_cached"] == 0 for r in full["requests"])  # full reuses nothing
    assert full["hit_rates"]["all"]["store_hit_rate"] is None and prefix["hit_rates"]["all"]["store_hit_rate"] is None
    assert acc["hit_rates"]["all"]["store_hit_rate"] == 1.0  # every chunk compiled up front
    assert all(r["chunk_misses"] == 0 for r in acc["requests"])

    # follow-up turns: the accurate policy reuses its linked first turn's blocks, as prefix its exact ones
    f = data["followups"]
    assert f["conversations"] >= 1 and f["policy"] == "auto"
    for row in f["rows"]:
        assert row["linked"]["prompt_tokens"] == row["exact"]["prompt_tokens"]  # the same length
        assert row["linked"]["prefix_cached"] >= 128 and row["exact"]["prefix_cached"] >= 128  # full blocks
        assert row["cold"]["prefix_cached"] < 128  # no first turn: nothing of the link to reuse
        # the first turn's blocks serve what they hold; vLLM computes the rest exactly (no second link)
        assert row["linked"]["recomputed"] == row["linked"]["prompt_tokens"] - row["linked"]["prefix_cached"]
    assert f["linked_vs_exact"] > 0 and f["cold_vs_linked"] > 0

    # agreement: every policy answered the scored requests, full agrees with itself
    agree = {r["policy"]: r for r in data["agreement"]["rows"]}
    assert list(agree) == list(data["policies"])
    assert all(r["n"] == len(data["agreement"]["requests"]) > 0 for r in agree.values())
    assert agree["full"]["first_line_match"] == 100.0 and agree["full"]["prefix_cached_tokens"] == 0
    assert agree["auto"]["ran"] == {"legolink-16": agree["auto"]["n"]}
    assert all(0 <= r["token_f1"] <= 100 for r in agree.values())

    assert [r["policy"] for r in data["summary"]] == list(data["policies"])
    assert all(r["saturated_rps"] > 0 for r in data["summary"])
    assert len(data["targets"]) == 5 and all(t["met"] in (True, False, None) for t in data["targets"])
    md = (tmp_path / "trace.md").read_text()
    assert "## Targets" in md and "## Hit rates over time" in md and "## Follow-up turns" in md
    assert "![trace.png](trace.png)" in md and (tmp_path / "trace.png").stat().st_size > 10_000
