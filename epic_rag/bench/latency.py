"""Latency benchmarks: synchronous TTFT per context length, chunk-count scaling (the open-loop load
benchmark is load.py)."""

from __future__ import annotations

import random
import resource

from ..types import RagRequest
from .common import corpus_chunks, median, no_reuse

# EPIC's comparison: every policy in the accuracy and synchronous tables; the load and scaling tests keep four.
COMPARED_POLICIES = [
    "full",
    "prefix",
    "naive",
    "cacheblend-5",
    "cacheblend-15",
    "legolink-0",
    "legolink-2",
    "legolink-16",
    "legolink-32",
]
LOAD_POLICIES = ("full", "naive", "cacheblend-15", "legolink-16")
QUESTION = "Which function in these documents serializes an object to a JSON formatted string?"


def sync_latency(
    engine, contexts=(1024, 2048, 4096, 7168), chunk_tokens=512, policies=COMPARED_POLICIES, reps=3, progress=True
) -> list[dict]:
    """TTFT per policy and context; prompts identical across policies (chunk order shuffled per rep)."""
    from tqdm import tqdm

    rows = []
    rng = random.Random(0)
    bar = tqdm(total=len(contexts) * len(policies) * (reps + 1), desc="sync latency", disable=not progress)
    for ctx in contexts:
        n = max(1, ctx // chunk_tokens)
        chunks = corpus_chunks(engine.tokenizer, n, chunk_tokens)
        engine.compile(chunks)
        orders = [rng.sample(chunks, n) for _ in range(reps)]
        samples = {p: [] for p in policies}
        info = {}
        for p in policies:  # warm-up (prefix: warms its cache with the unshuffled order)
            engine.generate(RagRequest(question=QUESTION, chunks=chunks), max_tokens=1, policy=p)
            bar.update(1)
        for order in orders:
            for p in policies:
                req = RagRequest(question=QUESTION, chunks=order)
                g = engine.generate(req, max_tokens=1, policy=p, **no_reuse(p))
                samples[p].append(g.ttft_s)
                info[p] = {
                    "prompt_tokens": g.prompt_tokens,
                    "recomputed_tokens": g.recomputed_tokens,
                    "linked_tokens": g.linked_tokens,
                }
                bar.update(1)
        full = median(samples.get("full", []))
        for p in policies:
            m = median(samples[p])
            rows.append(
                {
                    "context": ctx,
                    "chunks": n,
                    "policy": p,
                    "ttft_median_s": m,
                    "ttft_min_s": min(samples[p]),
                    "ttft_max_s": max(samples[p]),
                    "ratio_to_full": m / full,
                    **info[p],
                    "samples": samples[p],
                }
            )
    bar.close()
    return rows


def scaling(
    engine, counts=(4, 8, 16, 32), chunk_tokens=224, policies=LOAD_POLICIES, reps=2, progress=True
) -> list[dict]:
    """TTFT and memory against the number of chunks (224-token chunks keep 32 of them, with the template,
    inside SmolLM2's 8192-token window)."""
    from tqdm import tqdm

    rows = []
    bar = tqdm(total=len(counts) * len(policies), desc="scaling", disable=not progress)
    for n in counts:
        chunks = corpus_chunks(engine.tokenizer, n, chunk_tokens, offset=40)
        engine.compile(chunks)
        for p in policies:
            engine.generate(RagRequest(question=QUESTION, chunks=chunks), max_tokens=1, policy=p)
            ts = []
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            for _ in range(reps):
                req = RagRequest(question=QUESTION, chunks=chunks)
                g = engine.generate(req, max_tokens=1, policy=p, **no_reuse(p))
                ts.append(g.ttft_s)
            rows.append(
                {
                    "chunks": n,
                    "context": g.prompt_tokens,
                    "policy": p,
                    "ttft_median_s": median(ts),
                    "recomputed_tokens": g.recomputed_tokens,
                    "linker_workspace_mb": (
                        2
                        * 4
                        * g.prompt_tokens
                        * engine.kv_info["num_layers"]
                        * engine.kv_info["num_kv_heads"]
                        * engine.kv_info["head_size"]
                        / 2**20
                    )
                    if p != "full" and p != "prefix"
                    else 0.0,
                    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                    "peak_rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
                }
            )
            bar.update(1)
    bar.close()
    return rows
