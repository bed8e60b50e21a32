"""Store benchmark: load latency of one compiled chunk (512 tokens) from each tier (exact and int8)
against the time to compile it, and the bytes per token each tier stores.

    epic-rag bench store [--loads 20] [--compiles 5] [--chunk-tokens 512]

Real KV: the engine (SmolLM2-135M, fp32 by default) compiles pydoc text; each tier then holds that ChunkKV
and is read `--loads` times (every load checks the checksum, key, dtype and shape, and dequantizes int8).
"disk cold" drops the entry's pages from the page cache (posix_fadvise DONTNEED) before every load.
Redis is a local redis-server (no persistence) on 127.0.0.1. Results: <out>/store.json and <out>/store.md.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from .common import command_line, corpus_chunks, machine, median, table, write

FRESH_OFFSET = 160


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def run(
    engine, out: Path, model: str, loads: int = 20, compiles: int = 5, chunk_tokens: int = 512, release: bool = False
) -> dict:
    """`release`: shut the engine down once the chunk is compiled, so that it is gone while the tiers are
    timed (for an engine made for this benchmark alone)."""
    import torch

    from ..store import DiskStore, open_store
    from ..testing.localredis import LocalRedis

    load_before = os.getloadavg()
    T = chunk_tokens

    # Compile time of a fresh chunk (a new text each time: nothing cached). The texts lie past those the
    # other benchmarks compile (the link benchmark's reach 56 x 512 tokens), so a shared engine has none.
    texts = corpus_chunks(engine.tokenizer, compiles + 1, T, offset=FRESH_OFFSET)
    engine.compile([texts[-1]])  # warm-up
    compile_s, refs = [], []
    for text in texts[:-1]:
        t0 = time.perf_counter()
        refs += engine.compile([text])
        compile_s.append(time.perf_counter() - t0)
    kv = engine.store.get(refs[0].key)
    L, n_tok, H, D = kv.k.shape
    info = {
        "layers": L,
        "tokens": n_tok,
        "kv_heads": H,
        "head_dim": D,
        "dtype": str(kv.k.dtype).removeprefix("torch."),
        "kv_bytes": kv.nbytes,
    }
    print(f"compiled {n_tok}-token chunks: median {median(compile_s):.3f}s; KV {kv.nbytes / 2**20:.1f} MiB", flush=True)
    if release:
        engine.shutdown()

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp, LocalRedis(Path(tmp) / "redis") as redis:
        tiers = [
            ("memory", "memory", None),
            ("memory int8", "memory?quant=int8", None),
            ("disk (page cache)", f"disk:{tmp}/d", None),
            ("disk cold", f"disk:{tmp}/d", "cold"),
            ("disk int8 (page cache)", f"disk:{tmp}/q?quant=int8", None),
            ("disk int8 cold", f"disk:{tmp}/q?quant=int8", "cold"),
            ("redis (localhost)", redis.url, None),
            ("redis int8 (localhost)", f"{redis.url}?quant=int8", None),
        ]
        stores = []
        for name, spec, mode in tiers:
            store = open_store(spec)
            t0 = time.perf_counter()
            store.put(kv)
            stores.append((name, spec, mode, store, time.perf_counter() - t0, store.usage()[kv.key]))
        # Rounds interleave the tiers, so load from other jobs on the machine hits every tier alike.
        load_s: dict[str, list[float]] = {name: [] for name, *_ in stores}
        last = {}
        for _ in range(loads):
            for name, _spec, mode, store, _, _ in stores:
                if mode == "cold":
                    drop_cache(store._path(kv.key))
                t0 = time.perf_counter()
                last[name] = store.get(kv.key)
                load_s[name].append(time.perf_counter() - t0)
        for name, spec, _mode, store, put_s, size in stores:
            got, ls = last[name], load_s[name]
            assert got is not None and got.k.dtype == kv.k.dtype and got.token_ids == kv.token_ids
            if got.quant == "none":
                assert torch.equal(got.k, kv.k) and torch.equal(got.v, kv.v)
                err = {"k_rel_err": 0.0, "v_rel_err": 0.0}
            else:
                err = {
                    f"{t}_rel_err": float(
                        (getattr(got, t).float() - getattr(kv, t).float()).norm() / getattr(kv, t).float().norm()
                    )
                    for t in ("k", "v")
                }
            rows.append(
                {
                    "tier": name,
                    "spec": spec.replace(tmp, "$TMP"),
                    "load_s_median": median(ls),
                    "load_s_min": min(ls),
                    "load_s_max": max(ls),
                    "put_s": put_s,
                    "bytes": size,
                    "bytes_per_token": size / n_tok,
                    "speedup_vs_compile": median(compile_s) / median(ls),
                    **err,
                }
            )
            print(f"{name:24s} load {median(ls) * 1e3:8.2f} ms  {size / n_tok:8.0f} B/token", flush=True)
            if isinstance(store, DiskStore) or "redis" in name:
                store.clear()
            store.close()
        load_after = os.getloadavg()

    data = {
        "command": command_line(),
        "machine": machine(),
        "model": model,
        "chunk": info,
        "loadavg_1m_before": load_before[0],
        "loadavg_1m_after": load_after[0],
        "loads_per_tier": loads,
        "compile_s_median": median(compile_s),
        "compile_s": compile_s,
        "tiers": rows,
    }
    m = data["machine"]
    md = [
        f"# Store benchmark: one {n_tok}-token chunk ({model}; {info['dtype']} KV, {L} layers x {H} KV heads x {D})",
        "",
        f"Command: `{data['command']}`  ",
        f"Machine: {m['cpu']}, nproc {m['cores']}; date {m['date']}; commit {m['commit']}; "
        f"1-min load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (machine shared)  ",
        f"Medians over {loads} loads per tier, tiers interleaved round by round (each load verifies the sha256 "
        "checksum, key, dtype and shape;",
        f"int8 loads also dequantize to {info['dtype']}). Compile: median of "
        f"{compiles} fresh chunks through `engine.compile` = **{median(compile_s):.3f} s** "
        f"(min {min(compile_s):.3f}, max {max(compile_s):.3f}).",
        "",
    ]
    md += table(
        [
            "tier",
            "load median (ms)",
            "min",
            "max",
            "compile / load",
            "bytes per token",
            "KV rel. error (K / V)",
            "put (ms)",
        ],
        [
            [
                r["tier"],
                f"{r['load_s_median'] * 1e3:.2f}",
                f"{r['load_s_min'] * 1e3:.2f}",
                f"{r['load_s_max'] * 1e3:.2f}",
                f"{r['speedup_vs_compile']:.0f}x",
                f"{r['bytes_per_token']:.0f}",
                f"{r['k_rel_err']:.4f} / {r['v_rel_err']:.4f}",
                f"{r['put_s'] * 1e3:.1f}",
            ]
            for r in rows
        ],
    )
    md += [
        "",
        f"Exact KV is {info['kv_bytes'] / n_tok:.0f} B/token in memory ({info['dtype']}); files and Redis "
        "values add the safetensors header and token ids. The memory tier returns the stored object (no copy, "
        'no check); "page cache" disk loads read a file the OS already caches, "cold" ones read it from the '
        "device. Machine shared with other jobs: timings are noisy; compare ratios.",
        "",
    ]
    write(out, "store", data, "\n".join(md))
    return data
