"""Reliability harness for the demo: a bounded load/soak test and a schemathesis fuzz run, both against
`epic-rag demo` (its default model, FAISS + MiniLM retrieval, default store memory 2 GiB over disk) started here on
127.0.0.1 over a small generated corpus, with an API key.

    .venv/bin/python -m epic_rag.bench.soak soak [--duration 300] [--concurrency 16] [--max-tokens 48]
                                                 [--out docs/bench]
    .venv/bin/python -m epic_rag.bench.soak fuzz [--max-examples 100] [--out docs/bench]

soak: `concurrency` asyncio clients (httpx) send chats back to back for `duration` seconds: mostly streamed
answers over retrieved chunks with a mix of link policies, some non-streamed, some malformed on purpose
(must be refused with a 4xx and a message) and some that disconnect after the first token (must be
cancelled). Every request is classified; anything else (5xx, SSE error event, transport error, timeout,
a stream without [DONE]) is an error. The server's RSS is sampled every second. Results: <out>/soak.json
and soak.md; exit status 1 when any request errored, or when the RSS after the warm-up grew more than
--max-rss-growth-mib (512) beyond what chunk KV added to the memory tier explains.

fuzz: schemathesis' `st run` against the server's /openapi.json with the `not_a_server_error` check (any 5xx
or transport failure is a failure). It runs as `python -m epic_rag.bench.soak st run ...`: schemathesis' own command
line, after `register_fuzz_hooks` has added a hook that steers two thirds of the generated chat bodies into
the generation path (served model, a user message last, max_tokens at most 32) so that fuzzed content
reaches the engine rather than the route's first check. Importing this module registers nothing. Results:
<out>/fuzz.json and fuzz.md.

`run_load` and the fuzz helpers are imported by tests/test_reliability_soak.py and
tests/test_reliability_fuzz.py, which run both in tiny configurations.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from .common import DEFAULT_OUT, command_line, machine, percentile, write

ROOT = Path(__file__).resolve().parents[2]
MODULE = "epic_rag.bench.soak"
KEY = "soak-key"

# ---------------------------------------------------------------------- corpus and questions
_PLACES = [
    "Aldmoor",
    "Brackwater",
    "Caddon",
    "Dunhallow",
    "Eskby",
    "Fenwick",
    "Glasmere",
    "Harrowgate",
    "Ilsworth",
    "Jessop",
    "Kirkby",
    "Lowdown",
    "Marchbank",
    "Northey",
    "Oxcombe",
    "Pellworth",
]
_THINGS = [
    "bridge",
    "lighthouse",
    "library",
    "observatory",
    "mill",
    "ferry",
    "museum",
    "market",
    "tower",
    "harbour",
    "station",
    "theatre",
    "garden",
    "archive",
    "chapel",
    "school",
]


def corpus_docs() -> dict[str, tuple[str, str, str]]:
    """name -> (text, question, expected answer). About two 256-token chunks per document."""
    docs = {}
    for i, (place, thing) in enumerate(zip(_PLACES, _THINGS)):
        code = 1000 + (i * 7919) % 9000
        year = 1850 + (i * 13) % 150
        keeper = f"{['Ada', 'Bram', 'Cora', 'Dev', 'Edda', 'Finn', 'Gus', 'Hana'][i % 8]} {place[:3]}ley"
        filler = " ".join(
            f"In {year + k} the {thing} of {place} was repainted, and the records of that year "
            f"list {k * 3 + i} visitors on the first day."
            for k in range(8)
        )
        text = (
            f"The {thing} of {place} opened in {year}. Its keeper is {keeper}. "
            f"The access code of the {place} {thing} is {code}. {filler} "
            f"Visitors to {place} are asked to sign the book at the entrance of the {thing}."
        )
        docs[f"{place.lower()}-{thing}.txt"] = (text, f"What is the access code of the {place} {thing}?", str(code))
    return docs


def write_corpus(folder: Path) -> dict[str, tuple[str, str, str]]:
    folder.mkdir(parents=True, exist_ok=True)
    docs = corpus_docs()
    for name, (text, _, _) in docs.items():
        (folder / name).write_text(text)
    return docs


# ---------------------------------------------------------------------- the server
class DemoProcess:
    """`epic-rag demo` in its own process on 127.0.0.1 (a free port), logs to a file."""

    def __init__(
        self, corpus: Path, data_dir: Path, key: str = KEY, log: Path | None = None, extra_args: list[str] = ()
    ) -> None:
        from epic_rag.testing.localredis import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        self.log_path = log or data_dir / "demo.log"
        data_dir.mkdir(parents=True, exist_ok=True)
        exe = shutil.which("epic-rag", path=str(Path(sys.executable).parent)) or "epic-rag"
        self.cmd = [
            exe,
            "demo",
            "--corpus",
            str(corpus),
            "--data-dir",
            str(data_dir),
            "--port",
            str(self.port),
            "--api-key",
            key,
            "--no-browser-needed",
            "--log-level",
            "warning",
            *extra_args,
        ]
        self._log = open(self.log_path, "w")
        # The server runs this checkout's code (a worktree's too), not whatever the installed script maps to.
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def wait_ready(self, timeout: float = 1800) -> dict:
        import httpx

        end = time.monotonic() + timeout
        h = {"Authorization": f"Bearer {self.key}"}
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"epic-rag demo exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/healthz", timeout=5).json()["status"] == "ok":
                    st = httpx.get(self.url + "/api/status", headers=h, timeout=5).json()
                    if st["state"] == "ready" and st["chunks"] and st["compiled"] == st["chunks"]:
                        return st
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(1.0)
        raise TimeoutError("the demo server did not finish ingesting in time")

    def served_model(self) -> str:
        """The model the server reports (/healthz), for the reports: they say what actually ran."""
        import httpx

        return httpx.get(self.url + "/healthz", timeout=30).json()["model"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


def process_rss(pid: int) -> Callable[[], int]:
    import psutil

    p = psutil.Process(pid)
    return lambda: p.memory_info().rss


def store_probe(url: str, key: str) -> Callable[[], dict]:
    """A `run_load` probe: the server's store, in-flight and error metrics (the memory tier's bytes explain
    part of any RSS growth)."""

    def probe() -> dict:
        return {
            k: v
            for k, v in scrape_metrics(url, key).items()
            if k.startswith(("epic_rag_store_bytes", "epic_rag_store_entries", "epic_rag_inflight"))
        }

    return probe


def scrape_metrics(url: str, key: str) -> dict[str, float]:
    import httpx

    out = {}
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30).text
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith(
            ("epic_rag_store_", "epic_rag_inflight", "epic_rag_chat_completions_total", "epic_rag_errors_total")
        ):
            out[name] = float(value)
    return out


# ---------------------------------------------------------------------- the load
POLICIES = [("legolink-16", 6), ("naive", 1), ("cacheblend-15", 1), ("full", 1), ("legolink-0", 1)]
KINDS = [("stream", 0.72), ("json", 0.15), ("bad", 0.07), ("disconnect", 0.06)]
BAD = [
    (b'{"messages": [', "not valid JSON"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "policy": "warp-9"}).encode(), "unknown policy"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "chunk_ids": ["nope.txt#9"]}).encode(), "nope.txt#9"),
]


def _pick(rng: random.Random, weighted) -> str:
    return rng.choices([k for k, _ in weighted], weights=[w for _, w in weighted])[0]


def percentiles(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "n": len(xs),
        **{f"p{round(p * 100)}": round(percentile(xs, p), 4) for p in (0.5, 0.9, 0.99)},
        "max": round(max(xs), 4),
        "mean": round(statistics.fmean(xs), 4),
    }


async def _one(client, rng: random.Random, questions: list[tuple[str, str, str]], max_tokens: int, t0: float) -> dict:
    import httpx

    kind = _pick(rng, KINDS)
    rec: dict = {"t": round(time.monotonic() - t0, 3), "kind": kind}
    start = time.perf_counter()
    try:
        if kind == "bad":
            body, needle = rng.choice(BAD)
            r = await client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
            rec["status"] = r.status_code
            msg = (
                r.json().get("error", {}).get("message", "")
                if r.headers.get("content-type", "").startswith("application/json")
                else ""
            )
            ok = 400 <= r.status_code < 500 and needle in msg
            rec["outcome"] = "rejected" if ok else "error"
            if not ok:
                rec["error"] = f"bad request answered {r.status_code}: {r.text[:200]}"
            return rec
        _, question, expected = rng.choice(questions)
        rec["policy"] = policy = _pick(rng, POLICIES)
        body = {
            "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens,
            "policy": policy,
            "temperature": 0.0,
        }
        if kind == "json":
            r = await client.post("/v1/chat/completions", json=body)
            rec["status"] = r.status_code
            rec["latency_s"] = time.perf_counter() - start
            if r.status_code != 200:
                rec.update(outcome="error", error=f"status {r.status_code}: {r.text[:200]}")
                return rec
            j = r.json()
            rec.update(
                outcome="ok",
                server_ttft_s=j["epic"]["ttft_s"],
                tokens=j["usage"]["completion_tokens"],
                correct=expected in j["choices"][0]["message"]["content"],
            )
            return rec
        body.update(stream=True, stream_options={"include_usage": True})
        text, done, final = [], False, None
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                await r.aread()
                rec.update(outcome="error", error=f"status {r.status_code}: {r.text[:200]}")
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                ev = json.loads(line[6:])
                if "error" in ev:
                    rec.update(outcome="error", error=f"SSE error event: {ev['error']}")
                    return rec
                if ev.get("choices"):
                    delta = ev["choices"][0]["delta"].get("content")
                    if delta:
                        if "ttft_s" not in rec:
                            rec["ttft_s"] = time.perf_counter() - start
                            if kind == "disconnect":
                                rec["outcome"] = "cancelled"  # leave after the first token
                                return rec
                        text.append(delta)
                    if ev["choices"][0].get("finish_reason"):
                        final = ev
                elif ev.get("usage"):
                    rec["tokens"] = ev["usage"]["completion_tokens"]
        rec["latency_s"] = time.perf_counter() - start
        if not done or final is None:
            rec.update(outcome="error", error="stream ended without a finish chunk and [DONE]")
            return rec
        rec.update(outcome="ok", server_ttft_s=final["epic"]["ttft_s"], correct=expected in "".join(text))
        return rec
    except (httpx.HTTPError, ValueError, KeyError) as e:
        rec.update(outcome="error", error=f"{type(e).__name__}: {e}", latency_s=time.perf_counter() - start)
        return rec


async def run_load(
    url: str,
    key: str,
    questions: list[tuple[str, str, str]],
    duration_s: float,
    concurrency: int,
    max_tokens: int = 48,
    rss: Callable[[], int] | None = None,
    seed: int = 0,
    request_timeout: float = 300.0,
    rss_every_s: float = 1.0,
    probe: Callable[[], dict] | None = None,
    probe_every_s: float = 5.0,
) -> dict:
    """Closed-loop load: `concurrency` clients send requests back to back until `duration_s` has passed
    (requests in flight then finish). Returns every request record, the RSS samples and the `probe`
    samples (e.g. the server's store metrics), each with its time."""
    import httpx

    t0 = time.monotonic()
    end = t0 + duration_s
    records: list[dict] = []
    samples: list[tuple[float, int]] = []
    probes: list[tuple[float, dict]] = []
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency * 2)

    async def sampler():
        while True:
            if rss is not None:
                samples.append((round(time.monotonic() - t0, 2), rss()))
            await asyncio.sleep(rss_every_s)

    async def prober():
        while probe is not None:
            t = round(time.monotonic() - t0, 2)
            try:
                probes.append((t, await asyncio.to_thread(probe)))
            except Exception as e:  # a failed scrape is recorded, not fatal
                probes.append((t, {"error": f"{type(e).__name__}: {e}"}))
            await asyncio.sleep(probe_every_s)

    async with httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {key}"},
        limits=limits,
        timeout=httpx.Timeout(request_timeout, connect=30),
    ) as client:

        async def worker(w: int):
            rng = random.Random(seed * 1000 + w)
            while time.monotonic() < end:
                records.append(await _one(client, rng, questions, max_tokens, t0))

        tasks = [asyncio.ensure_future(sampler()), asyncio.ensure_future(prober())]
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        wall = time.monotonic() - t0
        await asyncio.sleep(min(2.0, rss_every_s * 2))
        for t in tasks:
            t.cancel()
    return {"records": records, "rss": samples, "probes": probes, "wall_s": wall}


def summarize(load: dict, warmup_s: float) -> dict:
    recs = load["records"]
    outcomes = Counter(r["outcome"] for r in recs)
    ok = [r for r in recs if r["outcome"] == "ok"]
    streamed = [r for r in ok if r["kind"] == "stream"]
    statuses = Counter(str(r.get("status", "none")) for r in recs)
    rss = load["rss"]
    after = [v for t, v in rss if t >= warmup_s] or [v for _, v in rss]
    graded = [r["correct"] for r in ok if "correct" in r]
    out = {
        "requests": len(recs),
        "outcomes": dict(outcomes),
        "statuses": dict(statuses),
        "kinds": dict(Counter(r["kind"] for r in recs)),
        "errors": outcomes.get("error", 0),
        "error_rate": round(outcomes.get("error", 0) / max(1, len(recs)), 5),
        "answered_ok": len(ok),
        "throughput_rps": round(len(ok) / load["wall_s"], 3),
        "tokens_per_s": round(sum(r.get("tokens", 0) for r in ok) / load["wall_s"], 2),
        "ttft_client_stream_s": percentiles([r["ttft_s"] for r in streamed]),
        "ttft_server_s": percentiles([r["server_ttft_s"] for r in ok if "server_ttft_s" in r]),
        "latency_s": percentiles([r["latency_s"] for r in ok if "latency_s" in r]),
        "ttft_by_policy_p50_s": {
            p: percentiles([r["server_ttft_s"] for r in ok if r.get("policy") == p])["p50"]
            for p in sorted({r.get("policy") for r in ok if r.get("policy")})
        },
        "answers_with_expected_fact": round(sum(graded) / len(graded), 3) if graded else None,
        "error_examples": [r.get("error") for r in recs if r["outcome"] == "error"][:10],
    }
    mem = [  # KV the server holds in memory on purpose: the memory tier and the leading-glue cache
        (t, sum(p.get(f'epic_rag_store_bytes{{tier="{tier}"}}', 0.0) for tier in ("memory", "glue")))
        for t, p in load.get("probes", [])
        if 'epic_rag_store_bytes{tier="memory"}' in p
    ]
    if mem:
        warm = [b for t, b in mem if t >= warmup_s] or [mem[-1][1]]
        out["memory_tier_mib"] = {
            "after_warmup": _mib(warm[0]),
            "end": _mib(mem[-1][1]),
            "growth_after_warmup": _mib(mem[-1][1] - warm[0]),
        }
    if rss:
        out["rss_mib"] = {
            "first": _mib(rss[0][1]),
            "after_warmup": _mib(after[0]),
            "peak": _mib(max(v for _, v in rss)),
            "end": _mib(rss[-1][1]),
            "growth_after_warmup": _mib(rss[-1][1] - after[0]),
            "max_after_warmup_minus_warm": _mib(max(after) - after[0]),
        }
        # What a per-request leak would show: growth after the warm-up that chunk KV added to the memory
        # tier does not explain (the tier has its own budget), at its highest point.
        tier = out.get("memory_tier_mib", {}).get("growth_after_warmup", 0.0)
        out["rss_mib"]["unexplained_growth_after_warmup"] = round(
            out["rss_mib"]["max_after_warmup_minus_warm"] - max(tier, 0.0), 1
        )
    return out


def memory_problem(summary: dict, max_growth_mib: float) -> str | None:
    """None when the server's RSS growth after the warm-up, less the memory tier's growth, stayed within
    `max_growth_mib`; else what went over. A run without RSS samples is a problem too (nothing was checked)."""
    r = summary.get("rss_mib")
    if not r:
        return "no RSS samples: memory was not checked"
    grew = r["unexplained_growth_after_warmup"]
    if grew > max_growth_mib:
        return (
            f"RSS grew {grew} MiB after the warm-up beyond what the memory tier explains "
            f"(bound {max_growth_mib:g} MiB): a leak?"
        )
    return None


def _mib(n: float) -> float:
    return round(n / 2**20, 1)


def soak_markdown(data: dict) -> str:
    s, c, m = data["summary"], data["config"], data["machine"]
    t, ts = s["ttft_client_stream_s"], s["ttft_server_s"]
    r = s.get("rss_mib", {})
    lines = [
        "# Soak test: `epic-rag demo` under concurrent chats",
        "",
        f"Command: `{data['command']}`  ",
        f"Machine: {m.get('cpu', '?')}, {m.get('cores', '?')} cores; {data.get('machine_note', '')}  ",
        f"Date: {m.get('date', '?')}, commit {m.get('commit', '?')}",
        "",
        f"Server: `{' '.join(data['server_cmd'])}` ({data.get('model', '?')}, fp32 on CPU, store "
        f"memory 2 GiB + disk under the data dir); corpus: {c['documents']} generated documents, "
        f"{c['chunks']} chunks, compiled at start-up in {c['ingest_s']:.0f} s.",
        "",
        f"Load: {c['concurrency']} concurrent clients for {c['duration_s']} s (closed loop), max_tokens "
        f"{c['max_tokens']}, temperature 0; request mix {c['kinds']}; policies {c['policies']}.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests | {s['requests']} ({', '.join(f'{k} {v}' for k, v in sorted(s['kinds'].items()))}) |",
        f"| outcomes | {', '.join(f'{k} {v}' for k, v in sorted(s['outcomes'].items()))} |",
        f"| HTTP statuses | {', '.join(f'{k}: {v}' for k, v in sorted(s['statuses'].items()))} |",
        f"| errors (5xx, SSE error, transport, timeout, broken stream) | {s['errors']} "
        f"({100 * s['error_rate']:.2f} %) |",
        f"| answered requests per second | {s['throughput_rps']} |",
        f"| generated tokens per second (all clients) | {s['tokens_per_s']} |",
        f"| TTFT seen by streaming clients p50 / p90 / p99 / max | "
        f"{t['p50']} / {t['p90']} / {t['p99']} / {t['max']} s |",
        f"| TTFT measured by the engine p50 / p99 | {ts['p50']} / {ts['p99']} s |",
        f"| end-to-end latency p50 / p99 | {s['latency_s']['p50']} / {s['latency_s']['p99']} s |",
        f"| engine TTFT p50 by policy | {', '.join(f'{k} {v}' for k, v in s['ttft_by_policy_p50_s'].items())} |",
        f"| answers containing the expected fact | {s['answers_with_expected_fact']} |",
    ]
    if r:
        lines += [
            f"| server RSS: at start of load / after {c['warmup_s']} s warm-up / peak / end | "
            f"{r['first']} / {r['after_warmup']} / {r['peak']} / {r['end']} MiB |",
            f"| RSS growth after warm-up (end - warm; max - warm) | {r['growth_after_warmup']} MiB; "
            f"{r['max_after_warmup_minus_warm']} MiB |",
        ]
    mt = s.get("memory_tier_mib")
    if mt and r:
        lines.append(
            f"| KV added to the memory tier and glue cache after warm-up (explains RSS growth) | "
            f"{mt['growth_after_warmup']} MiB ({mt['after_warmup']} -> {mt['end']} MiB) |"
        )
        lines.append(
            f"| RSS growth after warm-up not explained by the memory tier | "
            f"{round(r['growth_after_warmup'] - mt['growth_after_warmup'], 1)} MiB |"
        )
    if r and "max_rss_growth_mib" in c:
        bound = c["max_rss_growth_mib"]
        verdict = memory_problem(s, bound) or "within the bound"
        lines.append(
            f"| memory check: highest RSS after warm-up less the memory tier's growth, bound {bound:g} MiB | "
            f"{r['unexplained_growth_after_warmup']} MiB: {verdict} |"
        )
    st = data.get("metrics_end", {})
    mem = st.get('epic_rag_store_bytes{tier="memory"}')
    entries = int(st.get('epic_rag_store_entries{tier="memory"}', 0))
    if mem is not None:
        lines.append(f"| memory tier at the end (budget 2048 MiB) | {_mib(mem)} MiB, {entries} entries |")
    if "inflight_after" in data:
        lines.append(f"| chats in flight on the server after the load | {data['inflight_after']} |")
    lines += ["", "RSS over time (s, MiB): " + ", ".join(f"{t:.0f}: {_mib(v)}" for t, v in data["rss_timeline"]), ""]
    if s["error_examples"]:
        lines += ["Errors:", ""] + [f"- {e}" for e in s["error_examples"]] + [""]
    return "\n".join(lines) + "\n"


def _load_note() -> str:
    try:
        la = os.getloadavg()
        return f"load average at start {la[0]:.1f} (other jobs share the machine)"
    except OSError:
        return ""


def cmd_soak(args) -> int:
    work = Path(tempfile.mkdtemp(prefix="epic-soak-"))
    docs = write_corpus(work / "corpus")
    questions = [(n, q, a) for n, (_, q, a) in docs.items()]
    note = _load_note()
    t0 = time.monotonic()
    server = DemoProcess(work / "corpus", work / "data", extra_args=args.demo_arg)
    try:
        st = server.wait_ready()
        ingest_s = time.monotonic() - t0
        model = server.served_model()
        print(
            f"server ready in {ingest_s:.0f} s: {st['chunks']} chunks compiled; load for {args.duration} s", flush=True
        )

        load = asyncio.run(
            run_load(
                server.url,
                KEY,
                questions,
                args.duration,
                args.concurrency,
                args.max_tokens,
                rss=process_rss(server.proc.pid),
                seed=args.seed,
                probe=store_probe(server.url, KEY),
                probe_every_s=5.0,
            )
        )
        time.sleep(2.0)
        metrics = scrape_metrics(server.url, KEY)
        inflight = metrics.get("epic_rag_inflight_requests")
    finally:
        server.stop()
    summary = summarize(load, args.warmup)
    step = max(1, len(load["rss"]) // 60)
    data = {
        "command": command_line(MODULE),
        "model": model,
        "server_cmd": ["epic-rag"]
        + server.cmd[1:3]
        + ["<corpus>", "--data-dir", "<tmp>", "--port", "<free>", "--api-key", "<key>", "--no-browser-needed"],
        "machine": machine(),
        "machine_note": note,
        "config": {
            "concurrency": args.concurrency,
            "duration_s": args.duration,
            "max_tokens": args.max_tokens,
            "warmup_s": args.warmup,
            "max_rss_growth_mib": args.max_rss_growth_mib,
            "seed": args.seed,
            "documents": len(docs),
            "chunks": st["chunks"],
            "ingest_s": round(ingest_s, 1),
            "kinds": dict(KINDS),
            "policies": dict(POLICIES),
        },
        "summary": summary,
        "metrics_end": metrics,
        "inflight_after": inflight,
        "rss_timeline": load["rss"][::step],
        "store_timeline": load["probes"],
        "records": load["records"],
    }
    write(Path(args.out), "soak", data, soak_markdown(data))
    problem = memory_problem(summary, args.max_rss_growth_mib)
    if problem:
        print(f"memory check failed: {problem}", file=sys.stderr)
    return 1 if summary["errors"] or problem else 0


# ---------------------------------------------------------------------- fuzz
FUZZ_MAX_TOKENS = 32


def fuzz_command(url: str, key: str, max_examples: int, seed: int, report: Path, workers: int = 1) -> list[str]:
    """The `st run` command line, run through this module's `st` command so that the steering hook is
    registered first."""
    return [
        sys.executable,
        "-m",
        MODULE,
        "st",
        "run",
        f"{url}/openapi.json",
        "--header",
        f"Authorization: Bearer {key}",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        str(max_examples),
        "--seed",
        str(seed),
        "--workers",
        str(workers),
        "--request-timeout",
        "300",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]


def summarize_fuzz_report(rep: dict) -> dict:
    ops = rep.get("operations", {})
    tc = rep.get("test_cases", {})
    failures = [f if isinstance(f, (str, int, float)) else json.dumps(f)[:500] for f in rep.get("failures", [])]
    errors = [e if isinstance(e, (str, int, float)) else json.dumps(e)[:500] for e in rep.get("errors", [])]
    return {
        "cases": tc.get("generated", 0),
        "cases_with_failures": tc.get("with_failures", 0),
        "unique_failures": tc.get("unique_failures", 0),
        "errored_cases": tc.get("errored", 0),
        "operations": ops.get("tested", 0),
        "operations_total": ops.get("total", 0),
        "failures": failures + errors,
        "phases": {k: v.get("status") for k, v in rep.get("phases", {}).items()},
        "valid_rates": rep.get("valid_rates", {}),
        "running_time_s": round(rep.get("running_time", 0.0), 1),
        "warnings": {k: v for k, v in rep.get("warnings", {}).items() if v},
    }


def register_fuzz_hooks() -> None:
    """Add the steering hook to schemathesis' global hooks (once per process: `st` below calls it)."""
    import schemathesis

    @schemathesis.hook
    def map_body(context, body):
        """Steer 2 of 3 generated chat bodies past the route's first checks, into the engine."""
        op = getattr(context, "operation", None)
        if op is None or op.path != "/v1/chat/completions" or not isinstance(body, dict):
            return body
        body = dict(body)
        for k in ("max_tokens", "max_completion_tokens"):  # bounded generation (time, not safety)
            if isinstance(body.get(k), int) and not isinstance(body.get(k), bool) and body[k] > FUZZ_MAX_TOKENS:
                body[k] = FUZZ_MAX_TOKENS
        if zlib.crc32(repr(sorted(body.items(), key=str)).encode("utf-8", "surrogatepass")) % 3 == 0:
            return body
        body.pop("model", None)
        msgs = body.get("messages")
        if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict):
            last = dict(msgs[-1])
            last["role"] = "user"
            if not isinstance(last.get("content"), (str, list)) or not last.get("content"):
                last["content"] = "What does the archive hold?"
            body["messages"] = msgs[:-1] + [last]
        return body


def cmd_st(args) -> int:
    """schemathesis' `st` command line with the steering hook registered."""
    from schemathesis.cli import schemathesis

    register_fuzz_hooks()
    return schemathesis.main(args=args.st_args, prog_name="st")


def fuzz_markdown(data: dict) -> str:
    s = data["summary"]
    lines = [
        "# Fuzz run: schemathesis against the demo server's OpenAPI schema",
        "",
        f"Command: `{data['command']}`  ",
        f"schemathesis command (run by it): `{data['st_command']}`  ",
        f"Machine: {data['machine'].get('cpu', '?')}, {data['machine'].get('cores', '?')} cores; "
        f"date {data['machine'].get('date', '?')}, commit {data['machine'].get('commit', '?')}",
        "",
        f"Server: `epic-rag demo` on 127.0.0.1 ({data.get('model', '?')}, MiniLM retrieval, API key), corpus of "
        f"{data['documents']} generated documents. Check: `not_a_server_error` (5xx or transport failure). "
        f"Chat bodies: 2 of 3 steered into the engine by the hook in epic_rag/bench/soak.py "
        f"(max_tokens <= {FUZZ_MAX_TOKENS}).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| operations tested | {s['operations']} of {s['operations_total']} |",
        f"| test cases generated | {s['cases']} (max {data['max_examples']} examples per operation and phase) |",
        f"| phases | {', '.join(f'{k}: {v}' for k, v in s['phases'].items())} |",
        f"| cases with failures | {s['cases_with_failures']} (unique failures {s['unique_failures']}) |",
        f"| errored cases | {s['errored_cases']} |",
        f"| running time | {s['running_time_s']} s |",
        f"| server alive and answering afterwards | {data['alive_after']} |",
        f"| server RSS before / after | {data['rss_before_mib']} / {data['rss_after_mib']} MiB |",
        "",
        "Generated data accepted (2xx) / rejected (4xx) per operation (fuzzing phase):",
        "",
        "| operation | accepted | rejected |",
        "|---|---|---|",
    ]
    for op, v in sorted(s["valid_rates"].items()):
        f = v.get("fuzzing", {})
        lines.append(f"| {op} | {f.get('accepted', 0)} | {f.get('rejected', 0)} |")
    if s["failures"]:
        lines += ["", "Failures:", ""] + [f"- {f}" for f in s["failures"]]
    if s["warnings"]:
        lines += ["", "schemathesis warnings: " + "; ".join(f"{k}: {v}" for k, v in s["warnings"].items())]
    return "\n".join(lines) + "\n"


def cmd_fuzz(args) -> int:
    import httpx

    work = Path(tempfile.mkdtemp(prefix="epic-fuzz-"))
    docs = write_corpus(work / "corpus")
    server = DemoProcess(work / "corpus", work / "data")
    report = work / "st-report.json"
    try:
        server.wait_ready()
        model = server.served_model()
        rss = process_rss(server.proc.pid)
        rss_before = rss()
        cmd = fuzz_command(server.url, KEY, args.max_examples, args.seed, report, args.workers)
        print(" ".join(cmd), flush=True)
        r = subprocess.run(cmd, cwd=work, text=True, capture_output=True)
        print(r.stdout[-6000:], flush=True)
        h = {"Authorization": f"Bearer {KEY}"}
        ok = (
            httpx.post(
                server.url + "/v1/chat/completions",
                headers=h,
                timeout=120,
                json={
                    "messages": [{"role": "user", "content": "What is the access code of the Aldmoor bridge?"}],
                    "max_tokens": 8,
                },
            ).status_code
            == 200
        )
        alive = ok and server.proc.poll() is None
        rss_after = rss()
    finally:
        server.stop()
    rep = json.loads(report.read_text())
    data = {
        "command": command_line(MODULE),
        "model": model,
        "st_command": " ".join([".venv/bin/python"] + cmd[1:])
        .replace(KEY, "<key>")
        .replace(server.url, "http://127.0.0.1:<port>"),
        "machine": machine(),
        "documents": len(docs),
        "max_examples": args.max_examples,
        "exit_code": r.returncode,
        "alive_after": alive,
        "rss_before_mib": _mib(rss_before),
        "rss_after_mib": _mib(rss_after),
        "summary": summarize_fuzz_report(rep),
    }
    write(Path(args.out), "fuzz", data, fuzz_markdown(data))
    return 0 if (r.returncode == 0 and alive) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("soak", help="bounded load test against epic-rag demo")
    s.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    s.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default 16)")
    s.add_argument("--max-tokens", type=int, default=48)
    s.add_argument("--warmup", type=float, default=30.0, help="seconds before the RSS baseline (default 30)")
    s.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=512.0,
        help="fail when server RSS after the warm-up grows more than this beyond the memory tier's growth "
        "(default 512)",
    )
    s.add_argument("--seed", type=int, default=0)
    s.add_argument(
        "--demo-arg",
        action="append",
        default=[],
        help="an extra `epic-rag demo` argument (repeatable), e.g. --demo-arg=--multiprocess",
    )
    s.add_argument("--out", default=str(DEFAULT_OUT))
    s.set_defaults(func=cmd_soak)
    f = sub.add_parser("fuzz", help="schemathesis against epic-rag demo's OpenAPI schema")
    f.add_argument("--max-examples", type=int, default=100)
    f.add_argument("--seed", type=int, default=1)
    f.add_argument(
        "--workers",
        type=int,
        default=1,
        help="schemathesis workers (default 1: with 2, CPython 3.11 ast.parse races inside hypothesis)",
    )
    f.add_argument("--out", default=str(DEFAULT_OUT))
    f.set_defaults(func=cmd_fuzz)
    t = sub.add_parser(
        "st", add_help=False, help="schemathesis' st command line with the fuzz run's steering hook (what fuzz runs)"
    )
    t.add_argument("st_args", nargs=argparse.REMAINDER)
    t.set_defaults(func=cmd_st)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
