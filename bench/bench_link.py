"""Link benchmark (issue 2): TTFT per policy for 8 chunks of 512 tokens + a question, on SmolLM2, in one
process on identical prompts; and compile throughput against vLLM's plain prefill throughput.

    .venv/bin/python bench/bench_link.py [--reps 5] [--chunks 8] [--chunk-tokens 512]
"""
from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command, machine, median, write  # noqa: E402



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--policies", nargs="*", default=None, help="default: every compared policy")
    args = ap.parse_args()

    from epic_rag import EngineConfig, EpicEngine, RagRequest
    from epic_rag.bench.latency import COMPARED_POLICIES, compile_for, corpus_chunks
    from epic_rag.engine.engine import _event_sink

    policies = args.policies or COMPARED_POLICIES

    engine = EpicEngine(EngineConfig(model="smollm2-135m-instruct", dtype="float32", max_model_len=8192,
                                     kv_cache_gib=4, max_num_seqs=16))
    n, T = args.chunks, args.chunk_tokens
    chunks = corpus_chunks(engine.tokenizer, n, T)
    question = "Which function in these documents serializes an object to a JSON formatted string?"

    # Compile throughput vs plain prefill, both batched by vLLM: fresh texts each round (no cache hits).
    compile_tps, prefill_tps = [], []
    for r in range(3):
        fresh = corpus_chunks(engine.tokenizer, n, T, offset=(r + 1) * n)
        t0 = time.perf_counter()
        refs = engine.compile(fresh)
        compile_tps.append(sum(x.num_tokens for x in refs) / (time.perf_counter() - t0))
        fresh2 = corpus_chunks(engine.tokenizer, n, T, offset=(r + 4) * n)
        ids = [engine.tokenizer.encode(t, add_special_tokens=False) for t in fresh2]
        done = [threading.Event() for _ in ids]
        t0 = time.perf_counter()
        for tok, ev in zip(ids, done):   # plain prefill of the same amount of tokens, one request per chunk
            engine._submit(tok, 1, 0.0, uuid.uuid4().hex, None, _event_sink(ev))
        for ev in done:
            ev.wait()
        prefill_tps.append(sum(len(t) for t in ids) / (time.perf_counter() - t0))

    compile_for(engine, chunks, policies)
    rng = random.Random(0)
    orders = [rng.sample(chunks, len(chunks)) for _ in range(args.reps)]
    # warm-up (and prefix-cache warm-up with another order)
    for pol in policies:
        engine.generate(RagRequest(question=question, chunks=chunks), max_tokens=1, policy=pol)
    ttft: dict[str, list[float]] = {p: [] for p in policies}
    info: dict[str, dict] = {}
    for order in orders:                      # interleave policies: same prompts, same machine noise
        for pol in policies:
            g = engine.generate(RagRequest(question=question, chunks=order), max_tokens=1, policy=pol)
            ttft[pol].append(g.ttft_s)
            info[pol] = {"prompt_tokens": g.prompt_tokens, "recomputed_tokens": g.recomputed_tokens,
                         "linked_tokens": g.linked_tokens}
    full = median(ttft["full"])
    rows = []
    for pol in policies:
        m = median(ttft[pol])
        rows.append({"policy": pol, "ttft_median_s": round(m, 4), "ttft_min_s": round(min(ttft[pol]), 4),
                     "ttft_max_s": round(max(ttft[pol]), 4), "ratio_to_full": round(m / full, 4), **info[pol]})
    by = {r["policy"]: r for r in rows}
    data = {
        "command": command(), "machine": machine(), "model": "SmolLM2-135M-Instruct (fp32, vLLM CPU)",
        "chunks": n, "chunk_tokens": T, "reps": args.reps, "ttft": rows, "ttft_samples": ttft,
        "compile_tokens_per_s_median": round(median(compile_tps), 1),
        "plain_prefill_tokens_per_s_median": round(median(prefill_tps), 1),
        "compile_vs_prefill": round(median(compile_tps) / median(prefill_tps), 3),
    }
    targets = []
    if "legolink-16" in by and "naive" in by:
        ll, nv = by["legolink-16"]["ttft_median_s"], by["naive"]["ttft_median_s"]
        targets = [
            ("legolink-16 TTFT <= 1/8 of full", f"{ll / full:.3f}", ll / full <= 1 / 8),
            ("legolink-16 TTFT <= 1.5x naive", f"{ll / nv:.2f}x", ll / nv <= 1.5),
            ("compile throughput >= 0.8x plain prefill", f"{data['compile_vs_prefill']:.2f}x",
             data["compile_vs_prefill"] >= 0.8),
        ]
    data["targets"] = [{"target": t, "measured": m, "met": ok} for t, m, ok in targets]
    md = [f"# Link benchmark: {n} chunks x {T} tokens + question (SmolLM2-135M, fp32, CPU)", "",
          f"Command: `{data['command']}`  ", f"Machine: {data['machine']['cpu']}, {data['machine']['cores']} cores; "
          f"date {data['machine']['date']}; commit {data['machine']['commit']}  ",
          f"Medians over {args.reps} prompts (chunk order shuffled per prompt, same prompts for every policy), "
          "max_tokens=1, policies interleaved.", "",
          "| policy | TTFT median (s) | min | max | ratio to full | prompt tokens | recomputed | linked |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['policy']} | {r['ttft_median_s']:.3f} | {r['ttft_min_s']:.3f} | {r['ttft_max_s']:.3f} | "
                  f"{r['ratio_to_full']:.3f} | {r['prompt_tokens']} | {r['recomputed_tokens']} | {r['linked_tokens']} |")
    md += ["", f"Compile throughput: {data['compile_tokens_per_s_median']} tok/s; plain vLLM prefill of the same "
           f"token count: {data['plain_prefill_tokens_per_s_median']} tok/s; ratio {data['compile_vs_prefill']}.", ""]
    if targets:
        md += ["| target | measured | met |", "|---|---|---|"] + [f"| {t} | {m} | {'yes' if ok else 'NO'} |"
                                                               for t, m, ok in targets]
    write("link", data, "\n".join(md) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    main()
