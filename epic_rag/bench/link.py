"""Link benchmark: TTFT per policy for `chunks` chunks of `chunk_tokens` tokens + a question, in one
process on identical prompts (the synchronous-latency loop at one context), and compile throughput against
vLLM's plain prefill throughput on the same number of tokens.

    epic-rag bench link [--reps 5] [--chunks 8] [--chunk-tokens 512] [--policies ...]

Results: <out>/link.json and <out>/link.md.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import command_line, corpus_chunks, machine, median, table, write
from .latency import COMPARED_POLICIES, sync_latency


def plain_prefill_tps(engine, texts: list[str]) -> float:
    """Tokens per second of plain vLLM prefill: one `full` request per text (literal text, nothing linked,
    nothing cached), all in flight at once so that vLLM batches them as it batches a compile."""
    with ThreadPoolExecutor(max_workers=len(texts)) as pool:
        t0 = time.perf_counter()
        gens = list(pool.map(lambda t: engine.generate([t], max_tokens=1, policy="full"), texts))
        wall = time.perf_counter() - t0
    return sum(g.prompt_tokens for g in gens) / wall


def throughput(engine, n: int, chunk_tokens: int, rounds: int = 3) -> tuple[list[float], list[float]]:
    """Compile and plain-prefill tokens per second, `rounds` times each, on fresh texts every round (no
    cache hits): n chunks compiled in one call against n plain requests of the same size. One untimed round
    first: the first batches of a new size build their CPU kernels (a cold round measured 0.63x where the
    warm ones measured 0.98-1.02x)."""
    compile_tps, prefill_tps = [], []
    warm = corpus_chunks(engine.tokenizer, 2 * n, chunk_tokens, offset=(2 * rounds + 1) * n)
    engine.compile(warm[:n])
    plain_prefill_tps(engine, warm[n:])
    for r in range(rounds):
        fresh = corpus_chunks(engine.tokenizer, n, chunk_tokens, offset=(r + 1) * n)
        t0 = time.perf_counter()
        refs = engine.compile(fresh)
        compile_tps.append(sum(x.num_tokens for x in refs) / (time.perf_counter() - t0))
        other = corpus_chunks(engine.tokenizer, n, chunk_tokens, offset=(r + 1 + rounds) * n)
        prefill_tps.append(plain_prefill_tps(engine, other))
    return compile_tps, prefill_tps


def run(
    engine,
    out: Path,
    model: str,
    chunks: int = 8,
    chunk_tokens: int = 512,
    reps: int = 5,
    policies=None,
    rounds: int = 3,
    progress: bool = True,
) -> dict:
    policies = list(policies or COMPARED_POLICIES)
    n, T = chunks, chunk_tokens
    compile_tps, prefill_tps = throughput(engine, n, T, rounds)
    sync = sync_latency(engine, contexts=(n * T,), chunk_tokens=T, policies=policies, reps=reps, progress=progress)
    rows = [
        {
            "policy": r["policy"],
            "ttft_median_s": round(r["ttft_median_s"], 4),
            "ttft_min_s": round(r["ttft_min_s"], 4),
            "ttft_max_s": round(r["ttft_max_s"], 4),
            "ratio_to_full": round(r["ratio_to_full"], 4),
            "prompt_tokens": r["prompt_tokens"],
            "recomputed_tokens": r["recomputed_tokens"],
            "linked_tokens": r["linked_tokens"],
        }
        for r in sync
    ]
    by = {r["policy"]: r for r in rows}
    data = {
        "command": command_line(),
        "machine": machine(),
        "model": model,
        "chunks": n,
        "chunk_tokens": T,
        "reps": reps,
        "ttft": rows,
        "ttft_samples": {r["policy"]: r["samples"] for r in sync},
        "compile_tokens_per_s_median": round(median(compile_tps), 1),
        "plain_prefill_tokens_per_s_median": round(median(prefill_tps), 1),
        "compile_vs_prefill": round(median(compile_tps) / median(prefill_tps), 3),
    }
    targets = []
    if {"full", "legolink-16", "naive"} <= by.keys():
        full = by["full"]["ttft_median_s"]
        ll, nv = by["legolink-16"]["ttft_median_s"], by["naive"]["ttft_median_s"]
        targets = [
            ("legolink-16 TTFT <= 1/8 of full", f"{ll / full:.3f}", ll / full <= 1 / 8),
            ("legolink-16 TTFT <= 1.5x naive", f"{ll / nv:.2f}x", ll / nv <= 1.5),
            (
                "compile throughput >= 0.8x plain prefill",
                f"{data['compile_vs_prefill']:.2f}x",
                data["compile_vs_prefill"] >= 0.8,
            ),
        ]
    data["targets"] = [{"target": t, "measured": m, "met": ok} for t, m, ok in targets]
    mc = data["machine"]
    md = [
        f"# Link benchmark: {n} chunks x {T} tokens + question ({model})",
        "",
        f"Command: `{data['command']}`  ",
        f"Machine: {mc['cpu']}, {mc['cores']} cores; date {mc['date']}; commit {mc['commit']}  ",
        f"Medians over {reps} prompts (chunk order shuffled per prompt, same prompts for every policy), "
        "max_tokens=1, policies interleaved.",
        "",
    ]
    md += table(
        ["policy", "TTFT median (s)", "min", "max", "ratio to full", "prompt tokens", "recomputed", "linked"],
        [
            [
                r["policy"],
                f"{r['ttft_median_s']:.3f}",
                f"{r['ttft_min_s']:.3f}",
                f"{r['ttft_max_s']:.3f}",
                f"{r['ratio_to_full']:.3f}",
                r["prompt_tokens"],
                r["recomputed_tokens"],
                r["linked_tokens"],
            ]
            for r in rows
        ],
    )
    md += [
        "",
        f"Compile throughput: {data['compile_tokens_per_s_median']} tok/s; plain vLLM prefill of the same "
        f"token count: {data['plain_prefill_tokens_per_s_median']} tok/s; ratio {data['compile_vs_prefill']}.",
        "",
    ]
    if targets:
        md += table(["target", "measured", "met"], [[t, m, "yes" if ok else "NO"] for t, m, ok in targets])
    write(out, "link", data, "\n".join(md) + "\n")
    return data
