"""Load benchmark: open-loop Poisson arrivals at rising rates until each policy saturates, with TTFT,
inter-token latency (ITL) and end-to-end latency per rate.

    epic-rag bench load [--max-minutes 4.5] [--rate-factor 2] [--start-load 0.5] [--output-tokens 24]
                        [--policies ...]          (`bench async` is the same part under its old name)

Per policy:
1. Unloaded: a warm-up request, then `unloaded_requests` requests one at a time; their end-to-end median is
   the policy's service time, their ITL the reference for ITL under load.
2. Sweep: rates on one ladder shared by every policy, `factor**i` req/s; the first is the ladder rate nearest
   `start_load / service time`, each next one `factor` times higher. A policy serves at least 1 / service
   time req/s (one request at a time), so start_load 0.5 starts at about half its capacity or below; 0.25 would
   spend twice as long on a first step four times below it (32 service times: 2.5 min for full). Each step
   sends clamp(rate x window_s, min_requests, max_requests) requests with Poisson arrivals (open loop: a
   request is sent at its arrival time whatever is still in flight), each with k chunks (k uniform in
   [k_min, k_max]) drawn from one pool compiled up front. Arrivals and chunk draws are seeded by the ladder
   step, so every policy gets the same trace at a given rate. The sweep ends at saturation: completed req/s
   below `throughput_floor` x the offered req/s, or TTFT p50 above `ttft_blowup` x the unloaded one; or at
   the per-policy time budget (`ended_by: "cap"`: then the sweep did not reach saturation), or after errors.

Rates are measured, not taken from the settings: offered req/s = (n - 1) / (last arrival - first arrival)
of the trace sent (the step's rate: arrival_trace rescales it); completed req/s = completed / (last
completion - first arrival), over the step's makespan: the arrival rate below saturation (less one service
time's worth) and the service capacity above it. A policy's saturated throughput is the highest completed
req/s of its sweep (the saturating step included: past saturation it is the capacity).

Every request generates exactly `output_tokens` tokens (EOS ignored: the `ignore_eos` sampling option;
special tokens are streamed as text, `skip_special_tokens=False`, so that no token's delta is held back).
TTFT is counted from the request's scheduled arrival (its tokenization and chunk lookup included), ITL from
the engine's timestamps of consecutive token deltas (`Delta.t`), pooled over the step's requests; E2E from
arrival to the last token.

Results: <out>/load.json, <out>/load.md, <out>/throughput_vs_rate.png, <out>/itl_vs_rate.png.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Protocol

from ..types import Delta, Generation, RagRequest
from .common import command_line, corpus_chunks, machine, no_reuse, percentile, write
from .latency import LOAD_POLICIES, QUESTION

REFERENCES = ("full", "cacheblend-15")  # the summary's ratios are to these (its vs_<reference> columns)
TARGET_POLICY = "legolink-16"
# The targets: saturated req/s of TARGET_POLICY >= this many times the reference's.
THROUGHPUT_TARGETS = {"full": 8.0, "cacheblend-15": 3.0}
ITL_TARGET = 2.0  # ITL p99 at half saturation <= this many times the unloaded ITL p99


@dataclasses.dataclass(frozen=True)
class SweepSettings:
    """What a sweep to saturation needs, whatever its requests are (the load and trace parts share it)."""

    output_tokens: int = 24  # generated per request (fixed length)
    unloaded_requests: int = 8
    factor: float = 2.0  # rate ratio between steps
    start_load: float = 0.5  # first rate ~ start_load / service time: at most half the capacity
    window_s: float = 30.0  # a step's requests: rate x window_s, clamped to [min_requests, max_requests]
    min_requests: int = 8
    max_requests: int = 40
    max_minutes: float = 4.5  # per policy sweep budget
    cut_after: float = 1.25  # a step still running at this many times the per-policy budget is cut
    max_steps: int = 12
    throughput_floor: float = 0.8  # saturated when completed < floor x offered
    ttft_blowup: float = 10.0  # ... or TTFT p50 > blowup x the unloaded TTFT p50
    max_error_rate: float = 0.1  # a step with more errors ends the sweep
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class LoadSettings(SweepSettings):
    pool_size: int = 24  # chunks compiled up front
    chunk_tokens: int = 512
    k_min: int = 4  # chunks per request, uniform in [k_min, k_max]
    k_max: int = 8


QUICK_SETTINGS = LoadSettings(
    pool_size=6,
    chunk_tokens=128,
    k_min=2,
    k_max=3,
    output_tokens=4,
    unloaded_requests=2,
    window_s=2.0,
    min_requests=3,
    max_requests=4,
    max_minutes=0.5,
    max_steps=2,
)


# ---------------------------------------------------------------------- the rate ladder and the trace
def ladder_rate(i: int, factor: float) -> float:
    """The i-th rate of the ladder every policy shares: factor**i req/s (1 req/s at i = 0)."""
    return factor**i


def start_index(service_s: float, start_load: float, factor: float) -> int:
    """The ladder step nearest (in ratio) to start_load / service_s: a first rate well below saturation,
    since a policy serves at least 1 / service_s req/s by doing one request at a time."""
    return round(math.log(start_load / service_s) / math.log(factor))


def requests_for(rate: float, s: SweepSettings) -> int:
    """Requests in a step: about window_s seconds of arrivals, at least min_requests, at most max_requests."""
    return max(s.min_requests, min(s.max_requests, math.ceil(rate * s.window_s)))


def arrival_trace(rate: float, n: int, seed: str) -> list[float]:
    """n Poisson arrival times (seconds from the step's start, the first at 0), rescaled so that the trace's
    measured rate, (n - 1) / (last - first), is `rate` exactly: with a step's few requests a raw Poisson
    trace's rate is off by tens of percent, which would blur the ladder; the gaps keep their exponential shape
    (the burstiness of Poisson arrivals)."""
    rng = random.Random(f"arrivals:{seed}")
    t, raw = 0.0, [0.0]
    for _ in range(n - 1):
        t += rng.expovariate(1.0)
        raw.append(t)
    scale = (n - 1) / (rate * t) if n > 1 and t > 0 else 0.0
    return [x * scale for x in raw[:n]]


def chunk_draws(pool_size: int, n: int, k_min: int, k_max: int, seed: str) -> list[list[int]]:
    """n draws of k ~ U[k_min, k_max] distinct pool indices each, in random order."""
    rng = random.Random(f"chunks:{seed}")
    return [rng.sample(range(pool_size), rng.randint(k_min, min(k_max, pool_size))) for _ in range(n)]


# ---------------------------------------------------------------------- statistics of one step
def itl_gaps(times: Sequence[float], counts: Sequence[int]) -> list[float]:
    """Inter-token latencies of one request from its token deltas' times and token counts: the gap to the
    previous delta, split evenly over the tokens the delta carries (the first delta's tokens are the TTFT)."""
    gaps = []
    for i in range(1, len(times)):
        n = max(1, counts[i])
        gaps += [(times[i] - times[i - 1]) / n] * n
    return gaps


def event_rate(times: Sequence[float]) -> float:
    """Events per second over the span of `times`: (n - 1) / (last - first); NaN for fewer than 2 events
    or a zero span."""
    if len(times) < 2:
        return float("nan")
    span = max(times) - min(times)
    return (len(times) - 1) / span if span > 0 else float("nan")


def completed_rate(records: Sequence[dict]) -> float:
    """Completed requests per second over the step's makespan, first arrival to last completion: the
    arrival rate below saturation (less one service time's worth), the capacity above it. (A departure rate
    over the completions' own span is no measure here: a batch of requests finishing in the same engine
    steps has a span near zero.) NaN with no completion."""
    ok = [r for r in records if r["status"] == "ok"]
    if not ok:
        return float("nan")
    span = max(r["done"] for r in ok) - min(r["arrival"] for r in records)
    return len(ok) / span if span > 0 else float("nan")


def step_row(policy: str, index: int, rate: float, records: list[dict]) -> dict:
    """One step's figures from its request records: {"status": "ok"|"error"|"cut", "arrival", and for ok
    ones "ttft", "itl" (list), "e2e", "done" (completion time from the step's start), "tokens", "lag"}."""
    ok = [r for r in records if r["status"] == "ok"]
    itl = [g for r in ok for g in r["itl"]]
    offered = event_rate([r["arrival"] for r in records])
    completed = completed_rate(records)
    return {
        "policy": policy,
        "step": index,
        "rate": rate,
        "requests": len(records),
        "completed": len(ok),
        "errors": sum(r["status"] == "error" for r in records),
        "cut": sum(r["status"] == "cut" for r in records),
        "offered_rps": rate if math.isnan(offered) else offered,
        "completed_rps": 0.0 if math.isnan(completed) else completed,
        "ttft_p50_s": percentile([r["ttft"] for r in ok], 0.5),
        "ttft_p99_s": percentile([r["ttft"] for r in ok], 0.99),
        "itl_p50_s": percentile(itl, 0.5),
        "itl_p99_s": percentile(itl, 0.99),
        "e2e_p50_s": percentile([r["e2e"] for r in ok], 0.5),
        "e2e_p99_s": percentile([r["e2e"] for r in ok], 0.99),
        "tokens_mean": sum(r["tokens"] for r in ok) / len(ok) if ok else 0.0,
        "dispatch_lag_max_s": max((r["lag"] for r in ok), default=0.0),
        "wall_s": max((r["done"] for r in ok), default=0.0),
    }


def saturation_reason(row: dict, unloaded_ttft_p50: float, s: SweepSettings) -> str | None:
    """Why this step ends the sweep: "errors" (more than max_error_rate failed), "throughput" (completed
    req/s below throughput_floor x offered), "ttft" (TTFT p50 above ttft_blowup x unloaded), else None."""
    if row["errors"] > s.max_error_rate * row["requests"]:
        return "errors"
    if row["completed_rps"] < s.throughput_floor * row["offered_rps"]:
        return "throughput"
    if row["ttft_p50_s"] > s.ttft_blowup * unloaded_ttft_p50:
        return "ttft"
    return None


# ---------------------------------------------------------------------- the sweep
def sweep(
    run_step: Callable[[int, float, int, float], dict],
    service_s: float,
    unloaded_ttft_p50: float,
    s: SweepSettings,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[dict], str]:
    """Raise the rate from the start step by `factor` until saturation; returns the rows and what ended the
    sweep: "saturation", "errors", "cap" (budget: the next step would not fit, or a step was cut) or
    "max-steps". `run_step(index, rate, n, deadline_s)` runs one step and returns its row (step_row)."""
    budget = 60.0 * s.max_minutes
    t0 = clock()
    i = start_index(service_s, s.start_load, s.factor)
    rows: list[dict] = []
    for _ in range(s.max_steps):
        rate = ladder_rate(i, s.factor)
        n = requests_for(rate, s)
        left = budget - (clock() - t0)
        if n / rate + service_s > left:  # its arrivals and one service time do not fit the budget
            return rows, "cap"
        row = run_step(i, rate, n, s.cut_after * budget - (clock() - t0))
        reason = saturation_reason(row, unloaded_ttft_p50, s)
        row["saturated"] = reason
        rows.append(row)
        if reason == "errors":
            return rows, "errors"
        if reason:
            return rows, "saturation"
        if row["cut"]:
            return rows, "cap"
        i += 1
    return rows, "max-steps"


# ---------------------------------------------------------------------- summary and targets
def half_saturation_row(rows: list[dict], saturated_rps: float) -> dict | None:
    """The unsaturated step whose offered req/s is nearest (in ratio) to half the saturated throughput."""
    below = [r for r in rows if not r.get("saturated") and r["offered_rps"] > 0]
    if not below or not saturated_rps > 0:
        return None
    return min(below, key=lambda r: abs(math.log(r["offered_rps"] / (saturated_rps / 2))))


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else None


def summarize(policies: dict[str, dict], references: Sequence[str] = REFERENCES) -> list[dict]:
    """One row per policy from {policy: {"unloaded": {...}, "rows": [...], "ended_by": str}}: saturated req/s
    (highest completed req/s of the sweep), its ratio to each reference (vs_<reference>), the
    half-saturation step's TTFT and ITL, and its ITL p99 against the unloaded one."""
    sat = {p: max((r["completed_rps"] for r in d["rows"]), default=None) for p, d in policies.items()}
    out = []
    for p, d in policies.items():
        half = half_saturation_row(d["rows"], sat[p] or 0.0)
        unl = d["unloaded"]["itl_p99_s"]
        out.append(
            {
                "policy": p,
                "ended_by": d["ended_by"],
                "saturated_rps": sat[p],
                **{f"vs_{ref}": _ratio(sat[p], sat.get(ref)) for ref in references},
                "half_rate_rps": half["offered_rps"] if half else None,
                "half_ttft_p50_s": half["ttft_p50_s"] if half else None,
                "half_ttft_p99_s": half["ttft_p99_s"] if half else None,
                "half_itl_p50_s": half["itl_p50_s"] if half else None,
                "half_itl_p99_s": half["itl_p99_s"] if half else None,
                "unloaded_itl_p99_s": unl,
                "itl_p99_ratio": _ratio(half["itl_p99_s"], unl) if half else None,
            }
        )
    return out


def targets(summary: list[dict]) -> list[dict]:
    """The issue's targets for TARGET_POLICY: saturated throughput against full and cacheblend-15, ITL p99 at
    half saturation against unloaded. met is None where a policy is missing; a note says when a sweep ended
    by its time cap (the capped policy's saturated figure is then only a lower bound)."""
    by = {r["policy"]: r for r in summary}
    me = by.get(TARGET_POLICY)
    out = []
    for ref, need in THROUGHPUT_TARGETS.items():
        ratio = me.get(f"vs_{ref}") if me else None
        capped = [p for p in (TARGET_POLICY, ref) if p in by and by[p]["ended_by"] != "saturation"]
        out.append(
            {
                "target": f"{TARGET_POLICY} saturated req/s >= {need:g}x {ref}'s",
                "measured": ratio,
                "met": None if ratio is None else ratio >= need,
                "note": ", ".join(f"{p}'s sweep ended by {by[p]['ended_by']}" for p in capped),
            }
        )
    ratio = me["itl_p99_ratio"] if me else None
    out.append(
        {
            "target": f"{TARGET_POLICY} ITL p99 at half saturation <= {ITL_TARGET:g}x unloaded",
            "measured": ratio,
            "met": None if ratio is None else ratio <= ITL_TARGET,
            "note": "" if not me or me["ended_by"] == "saturation" else f"sweep ended by {me['ended_by']}",
        }
    )
    return out


# ---------------------------------------------------------------------- running it on an engine
@dataclasses.dataclass(frozen=True)
class Outgoing:
    """One request of a step: `make()` builds what EpicEngine.prepare takes (in the request's own thread, so
    its rendering counts in its TTFT as a server's would); `tag` names it in its record (e.g. a trace index)."""

    make: Callable[[], object]
    tag: int | None = None


class RequestSource(Protocol):
    """Where a sweep's requests come from: `unloaded(n)` for the one-at-a-time phase (its first a warm-up),
    `step(index, n)` for ladder step `index`."""

    def unloaded(self, n: int) -> list[Outgoing]: ...

    def step(self, index: int, n: int) -> list[Outgoing]: ...


@dataclasses.dataclass(frozen=True)
class PoolRequests:
    """The load part's requests: QUESTION over k chunks drawn from the compiled pool, seeded by the step, so
    every policy gets the same draws at a given rate."""

    pool: list[str]
    s: LoadSettings

    def _requests(self, n: int, seed: str) -> list[Outgoing]:
        draws = chunk_draws(len(self.pool), n, self.s.k_min, self.s.k_max, seed)
        return [Outgoing(partial(RagRequest, question=QUESTION, chunks=[self.pool[j] for j in d])) for d in draws]

    def unloaded(self, n: int) -> list[Outgoing]:
        return self._requests(n, f"{self.s.seed}:unloaded")

    def step(self, index: int, n: int) -> list[Outgoing]:
        return self._requests(n, f"{self.s.seed}:{index}")


async def _one(engine, policy: str, out: Outgoing, at: float, start: float, output_tokens: int, options: dict) -> dict:
    """One request sent at start + at; its record for step_row (times relative to `start`; "t" is the arrival
    on the perf_counter clock) with the Generation's cache figures."""
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter()
    arrival = start + at
    rec = {"arrival": at, "t": arrival, "lag": sent - arrival, "tag": out.tag}
    try:
        # exactly output_tokens tokens (EOS ignored), every token's delta streamed (special tokens as text)
        prep = await asyncio.to_thread(
            lambda: engine.prepare(
                out.make(),
                max_tokens=output_tokens,
                policy=policy,
                ignore_eos=True,
                skip_special_tokens=False,
                **options,
            )
        )
        times, counts, gen = [], [], None
        async for ev in engine.astream_events(prep):
            if isinstance(ev, Delta) and ev.token_ids:
                times.append(ev.t)
                counts.append(len(ev.token_ids))
            elif isinstance(ev, Generation):
                gen = ev
        if not times or gen is None:
            raise RuntimeError("no token streamed")
    except Exception as e:  # counted, not raised: one failure must not end the step
        return {**rec, "status": "error", "error": repr(e)[:200]}
    return {
        **rec,
        "status": "ok",
        "ttft": times[0] - arrival,
        "itl": itl_gaps(times, counts),
        "e2e": times[-1] - arrival,
        "done": times[-1] - start,
        "tokens": len(gen.token_ids),
        "prompt_tokens": gen.prompt_tokens,
        "prefix_cached": gen.prefix_cached_tokens,
        "recomputed": gen.recomputed_tokens,
        "chunk_hits": gen.chunk_hits,
        "chunk_misses": gen.chunk_misses,
        "ran": gen.policy,  # what `auto` picked
    }


async def _open_loop(
    engine, policy: str, requests: list[Outgoing], arrivals: list[float], tokens: int, deadline_s, options
) -> list[dict]:
    """Send every request at its arrival time; requests unfinished at deadline_s are cancelled ("cut")."""
    start = time.perf_counter() + 0.05
    tasks = [
        asyncio.ensure_future(_one(engine, policy, r, at, start, tokens, options()))
        for at, r in zip(arrivals, requests, strict=True)
    ]
    _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline_s))
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [
        {"arrival": at, "t": start + at, "status": "cut", "tag": r.tag} if t in pending else t.result()
        for t, at, r in zip(tasks, arrivals, requests, strict=True)
    ]


def unloaded_summary(policy: str, records: list[dict]) -> dict:
    """The unloaded phase's figures from its records (the warm-up left out by the caller)."""
    row = step_row(policy, -1, 0.0, records)
    if row["completed"] == 0:
        raise RuntimeError(f"{policy}: every unloaded request failed: {records[-1].get('error')}")
    keys = ("requests", "completed", "errors", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "e2e_p50_s")
    return {k: row[k] for k in keys} | {"tokens_mean": row["tokens_mean"]}


async def _unloaded(engine, policy: str, requests: list[Outgoing], s: SweepSettings, options) -> list[dict]:
    """The requests one at a time (the first is the warm-up)."""
    return [await _one(engine, policy, r, 0.0, time.perf_counter(), s.output_tokens, options()) for r in requests]


def run_policy(
    engine,
    policy: str,
    source: RequestSource,
    s: SweepSettings,
    bar=None,
    options: Callable[[], dict] | None = None,
    on_records: Callable[[int, list[dict]], None] | None = None,
) -> dict:
    """Unloaded figures (a warm-up, then `unloaded_requests` one at a time), then the sweep to saturation, for
    one policy. `options()` gives each request's extra keywords (default no_reuse: a salt of its own);
    `on_records(step, records)` sees every request's record (step -1: the unloaded phase, warm-up first)."""
    options = options or (lambda: no_reuse(policy))
    recs = asyncio.run(_unloaded(engine, policy, source.unloaded(s.unloaded_requests + 1), s, options))
    if on_records is not None:
        on_records(-1, recs)
    unloaded = unloaded_summary(policy, recs[1:])

    def run_step(i: int, rate: float, n: int, deadline_s: float) -> dict:
        arrivals = arrival_trace(rate, n, f"{s.seed}:{i}")
        requests = source.step(i, n)
        recs = asyncio.run(_open_loop(engine, policy, requests, arrivals, s.output_tokens, deadline_s, options))
        if on_records is not None:
            on_records(i, recs)
        row = step_row(policy, i, rate, recs)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(policy=policy, rate=f"{rate:g}", done=f"{row['completed_rps']:.2f}/s")
        return row

    t0 = time.perf_counter()
    rows, ended_by = sweep(run_step, unloaded["e2e_p50_s"], unloaded["ttft_p50_s"], s)
    return {"unloaded": unloaded, "rows": rows, "ended_by": ended_by, "sweep_s": time.perf_counter() - t0}


def run(engine, out: Path, model: str, policies=None, settings: LoadSettings | None = None, progress=True) -> dict:
    """Compile the pool, run every policy, write load.json, load.md and throughput_vs_rate.png."""
    from tqdm import tqdm

    from .report import load_markdown, load_plot

    s = settings or LoadSettings()
    policies = list(policies or LOAD_POLICIES)
    t0 = time.perf_counter()
    pool = corpus_chunks(engine.tokenizer, s.pool_size, s.chunk_tokens, offset=16)
    engine.compile(pool)
    compile_s = time.perf_counter() - t0
    per: dict[str, dict] = {}
    with tqdm(desc="load steps", disable=not progress) as bar:
        for p in policies:
            per[p] = run_policy(engine, p, PoolRequests(pool, s), s, bar)
    summary = summarize(per)
    data = {
        "command": command_line(),
        "machine": machine(),
        "model": model,
        "settings": dataclasses.asdict(s),
        "question": QUESTION,
        "compile_s": compile_s,
        "total_s": time.perf_counter() - t0,
        "policies": per,
        "rows": [r for d in per.values() for r in d["rows"]],
        "summary": summary,
        "targets": targets(summary),
    }
    plots = load_plot(out, data)
    write(out, "load", data, load_markdown(data, plots))
    return data
