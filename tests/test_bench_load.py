"""The load benchmark's pure parts on synthetic numbers (no model): the rate ladder and traces, ITL and
rate statistics, the saturation decision and sweep on a simulated server, the summary and the target
verdicts, the Markdown and the command line."""

from __future__ import annotations

import json
import math

import pytest

from epic_rag.bench import load as L
from epic_rag.bench.load import LoadSettings


# ---------------------------------------------------------------------- ladder and traces
def test_start_step_is_the_ladder_rate_nearest_start_load_over_service_time():
    assert L.start_index(4.0, 0.25, 2.0) == -4  # 0.25 / 4 s = 1/16 req/s = 2**-4
    assert L.ladder_rate(-4, 2.0) == 0.0625
    assert L.start_index(1.0, 0.25, 2.0) == -2
    assert L.start_index(1.1, 0.25, 2.0) == -2  # 0.227 req/s: nearest ladder rate 0.25
    i = L.start_index(0.7, 0.25, 1.5)
    assert abs(math.log(L.ladder_rate(i, 1.5) / (0.25 / 0.7))) <= math.log(1.5) / 2


def test_requests_per_step_cover_the_window_within_the_bounds():
    s = LoadSettings(window_s=30, min_requests=8, max_requests=40)
    assert L.requests_for(0.0625, s) == 8  # 1.9 requests in 30 s: raised to the minimum
    assert L.requests_for(0.5, s) == 15
    assert L.requests_for(8.0, s) == 40  # 240: capped


def test_trace_and_chunk_draws_depend_only_on_the_step_seed():
    a = L.arrival_trace(0.5, 20, "0:3"), L.chunk_draws(24, 20, 4, 8, "0:3")
    b = L.arrival_trace(0.5, 20, "0:3"), L.chunk_draws(24, 20, 4, 8, "0:3")
    assert a == b  # every policy gets the same trace at a given step
    assert L.arrival_trace(0.5, 20, "0:4") != a[0]
    draws = a[1]
    assert all(4 <= len(d) <= 8 and len(set(d)) == len(d) and all(0 <= j < 24 for j in d) for d in draws)
    assert {len(d) for d in L.chunk_draws(24, 400, 4, 8, "x")} == {4, 5, 6, 7, 8}  # k uniform over [4, 8]


def test_arrival_trace_is_poisson_rescaled_to_the_rate_asked_exactly():
    for n in (8, 15, 40):
        t = L.arrival_trace(0.25, n, f"0:{n}")
        assert t[0] == 0.0 and t == sorted(t) and L.event_rate(t) == pytest.approx(0.25)
    assert L.arrival_trace(1.0, 1, "one") == [0.0]
    t = L.arrival_trace(2.0, 4000, "big")
    gaps = [b - a for a, b in zip(t, t[1:])]
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert sd / mean == pytest.approx(1.0, abs=0.08)  # exponential gaps: coefficient of variation 1


# ---------------------------------------------------------------------- statistics of a step
def test_itl_skips_the_first_token_and_splits_a_multi_token_delta():
    assert L.itl_gaps([1.0, 1.1, 1.3, 1.6], [1, 1, 1, 1]) == pytest.approx([0.1, 0.2, 0.3])
    assert L.itl_gaps([1.0, 1.1, 1.5], [1, 1, 2]) == pytest.approx([0.1, 0.2, 0.2])
    assert L.itl_gaps([2.0], [1]) == []


def test_event_rate_is_intervals_over_span():
    assert L.event_rate([0.0, 1.0, 2.0, 4.0]) == pytest.approx(0.75)
    assert math.isnan(L.event_rate([3.0]))


def _records(arrivals, done, ttft=0.2, gaps=(0.05, 0.05, 0.06)):
    return [
        {"status": "ok", "arrival": a, "ttft": ttft, "itl": list(gaps), "e2e": d - a, "done": d, "tokens": 4, "lag": 0}
        for a, d in zip(arrivals, done)
    ]


def test_below_saturation_completed_rate_equals_offered_rate():
    arrivals = [0.0, 1.0, 3.0, 4.0, 8.0]
    row = L.step_row("p", 0, 0.5, _records(arrivals, [a + 1.5 for a in arrivals]))
    assert row["offered_rps"] == pytest.approx(0.5)  # 4 intervals over 8 s
    # makespan 0 -> 9.5 s: the arrival rate, less one service time's worth
    assert row["completed_rps"] == pytest.approx(5 / 9.5)
    assert row["completed_rps"] >= 0.8 * row["offered_rps"]
    assert (row["requests"], row["completed"], row["errors"], row["cut"]) == (5, 5, 0, 0)
    assert row["itl_p50_s"] == pytest.approx(0.05) and row["itl_p99_s"] == pytest.approx(0.06)
    assert row["e2e_p50_s"] == pytest.approx(1.5)


def test_past_saturation_completed_rate_is_the_capacity():
    arrivals = [0.1 * i for i in range(10)]  # 10 req/s offered
    done, free = [], 0.0
    for a in arrivals:  # one server, 1 s per request: capacity 1 req/s
        free = max(free, a) + 1.0
        done.append(free)
    row = L.step_row("p", 0, 10.0, _records(arrivals, done))
    assert row["offered_rps"] == pytest.approx(10.0)
    assert row["completed_rps"] == pytest.approx(1.0)


def test_requests_finishing_together_in_one_batch_read_as_few_per_second_not_a_burst():
    # full's 8 requests at 0.25 req/s, all done in the same engine steps ~54 s in: 8 over 54 s, not 7 over ~0 s
    arrivals = [4.0 * i for i in range(8)]
    row = L.step_row("full", 0, 0.25, _records(arrivals, [54.0 + 0.01 * i for i in range(8)]))
    assert row["completed_rps"] == pytest.approx(8 / 54.07)
    assert L.saturation_reason(row, 7.0, L.LoadSettings()) == "throughput"


def test_failed_and_cut_requests_are_counted_not_timed():
    recs = _records([0.0, 1.0], [1.0, 2.0]) + [
        {"status": "error", "arrival": 2.0, "error": "x"},
        {"status": "cut", "arrival": 3.0},
    ]
    row = L.step_row("p", 0, 1.0, recs)
    assert (row["requests"], row["completed"], row["errors"], row["cut"]) == (4, 2, 1, 1)
    assert row["offered_rps"] == pytest.approx(1.0) and row["completed_rps"] == pytest.approx(1.0)


def _row(offered, completed, ttft=0.3, errors=0, n=10, cut=0):
    return {
        "requests": n,
        "errors": errors,
        "cut": cut,
        "offered_rps": offered,
        "completed_rps": completed,
        "ttft_p50_s": ttft,
    }


def test_saturation_is_throughput_below_the_floor_or_ttft_blowup_or_errors():
    s = LoadSettings(throughput_floor=0.8, ttft_blowup=10, max_error_rate=0.1)
    assert L.saturation_reason(_row(1.0, 0.95), 0.3, s) is None
    assert L.saturation_reason(_row(1.0, 0.79), 0.3, s) == "throughput"
    assert L.saturation_reason(_row(1.0, 0.95, ttft=3.1), 0.3, s) == "ttft"
    assert L.saturation_reason(_row(1.0, 0.95, errors=2), 0.3, s) == "errors"
    assert L.saturation_reason(_row(1.0, 0.95, errors=1), 0.3, s) is None  # 10 %: tolerated


# ---------------------------------------------------------------------- the sweep on a simulated server
class FakeServer:
    """Completes min(rate, capacity) req/s; TTFT grows as the load nears capacity; advances a fake clock by
    the step's duration."""

    def __init__(self, capacity, ttft=0.3, errors=0):
        self.capacity, self.ttft, self.errors, self.now, self.calls = capacity, ttft, errors, 0.0, []

    def clock(self):
        return self.now

    def run_step(self, i, rate, n, deadline_s):
        self.calls.append((i, rate, n, deadline_s))
        done = min(rate, self.capacity)
        self.now += n / done
        rho = min(rate / self.capacity, 0.99)
        return _row(rate, done, ttft=self.ttft / (1 - rho), errors=self.errors, n=n)


def test_sweep_raises_the_rate_until_throughput_falls_below_the_offered_rate():
    s = LoadSettings(factor=2, start_load=0.25, max_minutes=1000)
    srv = FakeServer(capacity=3.0)
    rows, ended = L.sweep(srv.run_step, 1.0, 0.3, s, clock=srv.clock)
    assert ended == "saturation"
    assert [r["offered_rps"] for r in rows] == [0.25, 0.5, 1.0, 2.0, 4.0]  # from 0.25 / 1 s, x2 per step
    assert [r["saturated"] for r in rows] == [None] * 4 + ["throughput"]
    assert max(r["completed_rps"] for r in rows) == 3.0


def test_sweep_ends_when_ttft_blows_up_before_throughput_falls():
    s = LoadSettings(factor=2, start_load=0.25, ttft_blowup=5, max_minutes=1000)
    srv = FakeServer(capacity=2.1)  # at 2 req/s: throughput keeps up, TTFT 0.3 / (1 - 0.95) = 6 s
    rows, ended = L.sweep(srv.run_step, 1.0, 0.3, s, clock=srv.clock)
    assert ended == "saturation" and rows[-1]["offered_rps"] == 2.0 and rows[-1]["saturated"] == "ttft"


def test_sweep_records_a_cap_when_the_budget_ends_it_before_saturation():
    s = LoadSettings(factor=2, start_load=0.25, window_s=30, min_requests=8, max_requests=40, max_minutes=3)
    srv = FakeServer(capacity=100.0)
    rows, ended = L.sweep(srv.run_step, 4.0, 1.0, s, clock=srv.clock)
    assert ended == "cap"
    assert all(r["saturated"] is None for r in rows)
    assert srv.now <= 180  # no step was started that would not fit the budget
    # each step's cut deadline is 1.25x the budget less the time already spent
    assert srv.calls[0][3] == pytest.approx(s.cut_after * 180)


def test_sweep_stops_on_a_cut_step_and_on_errors():
    s = LoadSettings(max_minutes=1000)
    cut = FakeServer(capacity=100.0)
    run = cut.run_step
    cut.run_step = lambda *a: {**run(*a), "cut": 2}
    rows, ended = L.sweep(cut.run_step, 1.0, 0.3, s, clock=cut.clock)
    assert ended == "cap" and len(rows) == 1
    bad = FakeServer(capacity=100.0, errors=5)
    rows, ended = L.sweep(bad.run_step, 1.0, 0.3, s, clock=bad.clock)
    assert ended == "errors" and rows[0]["saturated"] == "errors"


def test_sweep_is_bounded_by_max_steps():
    s = LoadSettings(max_minutes=1e9, max_steps=3)
    srv = FakeServer(capacity=1e9)
    rows, ended = L.sweep(srv.run_step, 1.0, 0.3, s, clock=srv.clock)
    assert ended == "max-steps" and len(rows) == 3


# ---------------------------------------------------------------------- summary and targets
def _policy(rates_done, ended="saturation", itl_p99=(0.05,), unloaded_itl_p99=0.04):
    """A policy's record: steps (offered, completed), the last one saturated when ended by saturation."""
    rows = []
    for j, (offered, done) in enumerate(rates_done):
        last = j == len(rates_done) - 1 and ended == "saturation"
        rows.append(
            {
                "policy": "p",
                "offered_rps": offered,
                "completed_rps": done,
                "ttft_p50_s": 0.3 + j,
                "ttft_p99_s": 0.5 + j,
                "itl_p50_s": 0.03,
                "itl_p99_s": itl_p99[min(j, len(itl_p99) - 1)],
                "saturated": "throughput" if last else None,
            }
        )
    return {"unloaded": {"itl_p99_s": unloaded_itl_p99}, "rows": rows, "ended_by": ended}


def test_half_saturation_step_is_the_unsaturated_rate_nearest_half_the_saturated_throughput():
    rows = _policy([(0.25, 0.25), (0.5, 0.5), (1.0, 0.98), (2.0, 1.5)])["rows"]
    assert L.half_saturation_row(rows, 1.5)["offered_rps"] == 1.0  # half 0.75: 1.0 is 1.33x off, 0.5 1.5x
    assert L.half_saturation_row(rows, 1.2)["offered_rps"] == 0.5  # half 0.6: 0.5 is 1.2x off, 1.0 1.67x
    assert L.half_saturation_row([rows[-1]], 1.5) is None  # saturated at its first step: no half point


def test_summary_gives_saturated_throughput_ratios_and_itl_at_half_saturation():
    per = {
        "full": _policy([(0.0625, 0.06), (0.125, 0.12), (0.25, 0.2)]),
        "cacheblend-15": _policy([(0.25, 0.25), (0.5, 0.49), (1.0, 0.6)]),
        "legolink-16": _policy(
            [(0.25, 0.25), (0.5, 0.5), (1.0, 1.0), (2.0, 1.9), (4.0, 2.5)],
            itl_p99=(0.04, 0.05, 0.07, 0.2, 0.5),
            unloaded_itl_p99=0.04,
        ),
    }
    by = {r["policy"]: r for r in L.summarize(per)}
    ll = by["legolink-16"]
    assert ll["saturated_rps"] == 2.5
    assert ll["vs_full"] == pytest.approx(12.5) and ll["vs_cacheblend-15"] == pytest.approx(2.5 / 0.6)
    assert by["full"]["vs_full"] == pytest.approx(1.0)
    assert ll["half_rate_rps"] == 1.0  # nearest 1.25
    assert ll["half_itl_p99_s"] == 0.07 and ll["itl_p99_ratio"] == pytest.approx(1.75)
    assert ll["half_ttft_p50_s"] == pytest.approx(2.3)
    verdicts = {t["target"]: t for t in L.targets(list(by.values()))}
    assert [t["met"] for t in verdicts.values()] == [True, True, True]
    assert all(t["note"] == "" for t in verdicts.values())


def test_targets_fail_when_ratios_miss_and_say_when_a_cap_ended_a_sweep():
    per = {
        "full": _policy([(0.125, 0.12), (0.25, 0.24)], ended="cap"),  # never saturated: a lower bound
        "cacheblend-15": _policy([(0.5, 0.5), (1.0, 0.7)]),
        "legolink-16": _policy([(0.5, 0.5), (1.0, 1.0), (2.0, 1.2)], itl_p99=(0.2,), unloaded_itl_p99=0.05),
    }
    t = L.targets(L.summarize(per))
    assert [x["met"] for x in t] == [False, False, False]  # 5x full, 1.7x cacheblend-15, ITL 4x unloaded
    assert t[0]["measured"] == pytest.approx(5.0) and "full's sweep ended by cap" in t[0]["note"]
    assert t[1]["note"] == ""
    assert t[2]["measured"] == pytest.approx(4.0)


def test_targets_are_undecided_without_the_policies_they_compare():
    t = L.targets(L.summarize({"naive": _policy([(0.5, 0.5), (1.0, 0.6)])}))
    assert [x["met"] for x in t] == [None, None, None]


# ---------------------------------------------------------------------- request, report, command line
def _load_data():
    per = {
        "full": _policy([(0.125, 0.12), (0.25, 0.2)]),
        "legolink-16": _policy([(0.5, 0.5), (1.0, 1.0), (2.0, 1.5)]),
    }
    for p, d in per.items():
        d["unloaded"].update(completed=6, ttft_p50_s=0.3, itl_p50_s=0.03, e2e_p50_s=1.0)
        for r in d["rows"]:
            r.update(
                policy=p, rate=r["offered_rps"], requests=8, completed=8, errors=0, cut=0, e2e_p50_s=1.0, e2e_p99_s=2.0
            )
    summary = L.summarize(per)
    return {
        "command": "epic-rag bench load",
        "machine": {"cpu": "CPU", "cores": 2, "date": "d", "commit": "c"},
        "model": "m",
        "settings": json.loads(json.dumps(LoadSettings().__dict__)),
        "compile_s": 5.0,
        "total_s": 600.0,
        "policies": per,
        "rows": [r for d in per.values() for r in d["rows"]],
        "summary": summary,
        "targets": L.targets(summary),
    }


def test_load_markdown_has_the_summary_targets_and_every_step(tmp_path):
    from epic_rag.bench.report import load_markdown, load_plot

    data = _load_data()
    plots = load_plot(tmp_path, data)
    assert plots == ["throughput_vs_rate.png", "itl_vs_rate.png"] and all((tmp_path / p).exists() for p in plots)
    md = load_markdown(data, plots)
    assert "Command: `epic-rag bench load`" in md and "## Summary" in md and "## Every step" in md
    assert "| legolink-16 | 1.500 | 7.50x | n/a |" in md  # no cacheblend-15 in this run: its ratio is n/a
    assert "legolink-16 saturated req/s >= 3x cacheblend-15's | n/a | n/a |" in md
    assert "legolink-16 saturated req/s >= 8x full's | 7.50x | **NO** |" in md
    assert md.count("| throughput |") == 2 and "![throughput_vs_rate.png](throughput_vs_rate.png)" in md


def test_report_reads_load_json_for_its_section_and_plots(tmp_path):
    from epic_rag.bench.common import save_json
    from epic_rag.bench.report import write_report

    save_json(tmp_path, "load", _load_data())
    text = write_report(tmp_path).read_text()
    assert "## Load to saturation" in text and "[load.md](load.md)" in text
    assert "![throughput_vs_rate.png](throughput_vs_rate.png)" in text and (tmp_path / "itl_vs_rate.png").exists()


def test_async_is_the_load_part_under_its_old_name_and_options_override_the_defaults():
    from epic_rag.bench.cli import ALIASES, load_settings, parse_args

    args = parse_args(["async", "--max-minutes", "2", "--rate-factor", "1.5", "--output-tokens", "16"])
    assert ALIASES[args.what] == "load"
    s = load_settings(args)
    assert (s.max_minutes, s.factor, s.output_tokens, s.start_load) == (2.0, 1.5, 16, LoadSettings.start_load)
    quick = load_settings(parse_args(["load", "--quick"]))
    assert quick == L.QUICK_SETTINGS
    for bad in (["--rate-factor", "1"], ["--output-tokens", "1"], ["--max-minutes", "0"], ["--start-load", "-1"]):
        with pytest.raises(SystemExit):
            load_settings(parse_args(["load", *bad]))


def test_default_sweep_settings_follow_the_issue():
    s = LoadSettings()
    assert (s.k_min, s.k_max, s.pool_size, s.chunk_tokens) == (4, 8, 24, 512)
    assert 16 <= s.output_tokens <= 32 and 1.5 <= s.factor <= 2 and s.throughput_floor == 0.8
