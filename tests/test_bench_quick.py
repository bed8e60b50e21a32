"""Smoke test of the benchmark harness in --quick mode (checks it works, not the speed)."""

from __future__ import annotations

import argparse
import json

import pytest

from epic_rag.bench.metrics import first_line, substring_match, token_f1

pytestmark = pytest.mark.smollm


def test_scores_follow_longbench_normalisation():
    assert substring_match("The code is 7314.", "7314") == 1.0
    assert token_f1("The Larkspur Bridge", "larkspur bridge") == 1.0
    assert token_f1("nothing", "7314") == 0.0
    assert first_line(" 7463343.  It's not magic\nmore") == "7463343."


def test_quick_bench_writes_every_policy_for_every_part(smol_engine, tmp_path):
    from epic_rag.bench.accuracy import ACCURACY_POLICIES, QUICK_SAMPLES, TASKS
    from epic_rag.bench.cli import parse_args, run
    from epic_rag.bench.latency import COMPARED_POLICIES

    args = parse_args(["all", "--quick", "--out", str(tmp_path), "--reps", "1", "--max-tokens", "4", "--no-progress"])
    report = run(args, engine=smol_engine)
    acc = json.loads((tmp_path / "accuracy.json").read_text())
    assert [r["policy"] for r in acc["summary"]] == ACCURACY_POLICIES
    assert all(r["n"] == acc["n_samples"] for r in acc["summary"])
    # every task, paired against full, with intervals; the open-ended task scored against full's answers
    assert acc["samples_per_task"] == {t: QUICK_SAMPLES for t in TASKS}
    assert list(acc["tasks"]) == ["niah", "multidoc", "docsqa", "lookalike", "overall"]
    for rows in acc["tasks"].values():
        assert [r["policy"] for r in rows] == ACCURACY_POLICIES
        assert all(r["acc_low"] <= r["acc"] <= r["acc_high"] for r in rows)
        assert all(0 <= r["p_value"] <= 1 and r["pairs"] == r["n"] for r in rows[1:])
    assert [r["policy"] for r in acc["open"]] == ACCURACY_POLICIES
    assert all(0 <= r["f1"] <= 100 and 0 <= r["rouge_l"] <= 100 for r in acc["open"][1:])
    acc_md = (tmp_path / "accuracy.md").read_text()
    assert "Commands: `" in acc_md and "## docsqa" in acc_md and "## open" in acc_md
    assert (tmp_path / "accuracy.png").exists()
    tasks_done = {json.loads(line)["task"] for line in (tmp_path / "accuracy_rows.jsonl").read_text().splitlines()}
    assert tasks_done == set(TASKS)
    sync = json.loads((tmp_path / "sync.json").read_text())
    assert {r["policy"] for r in sync} == set(COMPARED_POLICIES)
    assert all(r["ttft_median_s"] > 0 for r in sync)
    assert json.loads((tmp_path / "load.json").read_text())["summary"]
    assert "## Load to saturation" in report.read_text()
    assert json.loads((tmp_path / "scaling.json").read_text())
    link = json.loads((tmp_path / "link.json").read_text())
    assert [r["policy"] for r in link["ttft"]] == COMPARED_POLICIES and link["compile_vs_prefill"] > 0
    assert "| legolink-16 |" in (tmp_path / "link.md").read_text()
    store = json.loads((tmp_path / "store.json").read_text())
    assert len(store["tiers"]) == 8 and all(r["load_s_median"] > 0 for r in store["tiers"])
    assert (tmp_path / "store.md").exists()
    text = report.read_text()
    assert "## Accuracy" in text and "## TTFT, synchronous" in text and (tmp_path / "ttft_vs_context.png").exists()
    # Resuming finds everything done and generates nothing new.
    before = (tmp_path / "accuracy_rows.jsonl").read_text()
    run(argparse.Namespace(**{**vars(args), "what": "accuracy"}), engine=smol_engine)
    assert (tmp_path / "accuracy_rows.jsonl").read_text() == before


def test_quick_load_sweeps_each_policy_on_a_shared_ladder_with_fixed_length_streams(smol_engine, tmp_path):
    from epic_rag.bench.cli import parse_args, run
    from epic_rag.bench.latency import LOAD_POLICIES
    from epic_rag.bench.load import QUICK_SETTINGS as Q

    report = run(parse_args(["load", "--quick", "--out", str(tmp_path), "--no-progress"]), engine=smol_engine)
    data = json.loads((tmp_path / "load.json").read_text())
    assert list(data["policies"]) == list(LOAD_POLICIES)
    for d in data["policies"].values():
        unl = d["unloaded"]
        assert unl["completed"] == Q.unloaded_requests and unl["errors"] == 0
        assert unl["tokens_mean"] == Q.output_tokens  # EOS ignored: every answer has the same length
        assert unl["itl_p50_s"] > 0 and unl["ttft_p50_s"] > 0
        assert d["ended_by"] in ("saturation", "cap", "max-steps")
        assert 1 <= len(d["rows"]) <= Q.max_steps
        rates = [r["rate"] for r in d["rows"]]
        assert all(b == a * Q.factor for a, b in zip(rates, rates[1:]))  # one ladder, x factor per step
        for r in d["rows"]:
            assert r["errors"] == 0 and r["completed"] + r["cut"] == r["requests"]
            assert r["offered_rps"] == pytest.approx(r["rate"])  # the trace's rate is the step's
            if r["completed"] >= 2:
                assert r["tokens_mean"] == Q.output_tokens and r["itl_p50_s"] > 0 and r["completed_rps"] > 0
    assert [s["policy"] for s in data["summary"]] == list(LOAD_POLICIES)
    assert len(data["targets"]) == 3
    md = (tmp_path / "load.md").read_text()
    assert "Command: `" in md and "## Summary" in md and "## Every step" in md
    assert (tmp_path / "throughput_vs_rate.png").exists() and (tmp_path / "itl_vs_rate.png").exists()
    assert "## Load to saturation" in report.read_text()
