#!/usr/bin/env python
"""The real Linker end to end on one GPU at Llama-3-8B shapes (issue 24): torch + Triton + epic_rag, no vLLM.

    python scripts/device_link.py --out docs/bench/gpu/link_h200.json          # CUDA, bf16 (~1-2 min)
    python scripts/device_link.py --before /path/to/linker_8a1e6d1.py ...     # also time the linker before
    TRITON_INTERPRET=1 python scripts/device_link.py --device cpu --tiny      # the logic, on a CPU (tests)

One link of 8 x 512-token chunks behind 8 tokens of glue and a 32-token question tail (LegoLink-16: the first 16
tokens of each chunk recomputed with the glue), through epic_rag's Linker (begin + advance) over a stub model
whose 32 decoder layers run the recompute's real GEMMs (QKV, O, gated MLP; one weight set shared by every layer)
and FlashAttnLayout with the backend's kernels stubbed (R's K/V written with an index copy, attention zeroed:
as in ../shared/device/bench_link_gpu.py). Rows (median wall ms, device synchronised after each run):
- the linker from pinned host records (the memory tier on a GPU machine), fused Triton filler;
  (the staging ring sized as the engine sizes it: 2 x max_model_len = 16384 tokens, one layer per slot);
- the same from GPU-tier records (device-resident: no host-to-device copy);
- the same from pageable host records (a store without pinning: one extra host copy per record per link);
- the torch filler (the fallback where Triton is missing) from pinned host records;
- with --before: the linker as it was (a copy of epic_rag/engine/link/linker.py from an older commit), pinned and
  pageable records;
- references: the recompute GEMMs alone (the same rows through 32 layers), a full prefill of the 4136 tokens
  (GEMMs + causal SDPA), a pinned host-to-device copy of the records' bytes, a device-to-device copy.
Pages written by every path are compared with the fused path's (all positions; 1 bf16 ulp allowed: FMA).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from epic_rag.engine.jobs import LinkJob, LinkSpan  # noqa: E402
from epic_rag.engine.link import kernels  # noqa: E402
from epic_rag.engine.link import linker as lk  # noqa: E402
from epic_rag.engine.link.layout import FlashAttnLayout  # noqa: E402
from epic_rag.engine.link.rope import KeyRotator  # noqa: E402
from epic_rag.policy import parse_policy  # noqa: E402
from epic_rag.store import ChunkKV  # noqa: E402
from epic_rag.testing.stub_model import StubModel  # noqa: E402

N = 16  # tokens per block (vLLM's default)


class StubKernels:
    """The backend's two kernels, cheap: R's fresh K/V indexed into the pages, attention output zero."""

    def cache_write(self, attn, k, v, key_cache, value_cache, slots) -> None:
        n = key_cache.shape[1]
        key_cache[slots // n, slots % n] = k.to(key_cache.dtype)
        value_cache[slots // n, slots % n] = v.to(value_cache.dtype)

    def varlen(self, attn, q, key_cache, value_cache, out, plan) -> None:
        out.zero_()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        fn()
    sync(device)
    host, wall = [], []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
    return {"wall_ms": round(statistics.median(wall), 3), "host_ms": round(statistics.median(host), 3)}


def check_budget(new_linker, link_fn, records, stack, h, dev) -> dict:
    """The asynchronous link budget on the device's clock: a few busy steps, each a forward then a share of a
    link (budget.py), with real events polled, never waited for."""
    from epic_rag.engine.link.budget import link_budget

    ln, _ = new_linker(lk)
    _, j = link_fn(ln, lk, *records("gpu"))
    budget = link_budget(dev, 1.0)
    steps, p = [], None
    while True:
        budget.bound()
        stack(h[:512], lambda q, k, v, n: torch.zeros(n, q.shape[1], dtype=q.dtype, device=q.device))  # a forward
        budget.start(idle=False)
        if p is None:
            p, _ = ln.begin([lk.LinkLoad(j, list(range(len(j.token_ids) // N + 1)), 0, len(j.token_ids))])
        before = p.layer
        done = ln.advance(p, budget.more)
        budget.end()
        steps.append(p.layer - before)
        if done or len(steps) > 64:
            break
    est = getattr(budget, "forward_ms", None), getattr(budget, "layer_ms", None)
    return {"kind": type(budget).__name__, "layers_per_step": steps, "forward_ms": est[0], "layer_ms": est[1]}


def check_capture(new_linker, link_fn, records, block_ids, T, dev) -> dict:
    """A compile's capture: pages copied into page-locked host buffers asynchronously, one wait at the end;
    the buffers must hold the pages bit for bit."""
    ln, kv = new_linker(lk)
    run, _ = link_fn(ln, lk, *records("gpu"))
    run()  # pages to capture
    L, H, D = len(ln.layers), ln.attn[0][2].num_kv_heads, ln.attn[0][2].head_size
    k = torch.empty((L, T, H, D), dtype=ln.cache_of(0).dtype, pin_memory=dev.type == "cuda")
    v = torch.empty_like(k, pin_memory=dev.type == "cuda")
    t0 = time.perf_counter()
    landed = [ln.capture(block_ids, 0, T // 2, k, v, 0)]
    landed.append(ln.capture(block_ids, T // 2, T, k, v, T // 2))
    issue_ms = (time.perf_counter() - t0) * 1e3
    ln.captured(landed)
    total_ms = (time.perf_counter() - t0) * 1e3
    equal = True
    for li in range(L):
        rk, rv = ln.layout.read_range(ln.cache_of(li), block_ids, 0, T)
        equal = equal and torch.equal(rk.cpu(), k[li]) and torch.equal(rv.cpu(), v[li])
    return {"equal": bool(equal), "issue_ms": round(issue_ms, 3), "total_ms": round(total_ms, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes (a logic dry run)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--before", default=None, help="a copy of an older epic_rag/engine/link/linker.py to time too")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if a.tiny:
        L, HQ, HK, D, CH, NCH, HID, FF, dt, reps = 2, 4, 2, 32, 48, 3, 64, 128, torch.float32, 1
    else:
        L, HQ, HK, D, CH, NCH, HID, FF, dt, reps = 32, 32, 8, 128, 512, 8, 4096, 14336, torch.bfloat16, a.reps
    GLUE, TAIL = 8, 32
    T = GLUE + CH * NCH + TAIL
    WS = T + 64 if a.tiny else 16384  # the engine's default pass size: 2 x max_model_len (8192)
    B = T // N + 16
    g = torch.Generator().manual_seed(0)
    model = StubModel(L, HQ, HK, D, dtype=dt, device=dev, gemms=True, hidden=HID, ffn=FF)
    rot = KeyRotator(model.rotary)
    recs_k = [torch.randn(L, CH + 1, HK, D, generator=g).to(dt) for _ in range(NCH)]  # sink row + chunk
    recs_v = [torch.randn(L, CH + 1, HK, D, generator=g).to(dt) for _ in range(NCH)]
    block_ids = torch.randperm(B, generator=g)[: -(-T // N)].tolist()
    policy = parse_policy("legolink-16")

    def records(kind: str):
        if kind == "pinned" and dev.type == "cuda":
            return [r.pin_memory() for r in recs_k], [r.pin_memory() for r in recs_v]
        if kind == "gpu":
            return [r.to(dev) for r in recs_k], [r.to(dev) for r in recs_v]
        return recs_k, recs_v

    def job(ks, vs) -> LinkJob:
        spans = []
        for c in range(NCH):
            kv = ChunkKV(f"c{c}", list(range(CH + 1)), ks[c], vs[c], base_pos=GLUE - 1)
            spans.append(LinkSpan(GLUE + c * CH, kv.slice(1)))  # the sink form: the chunk's own tokens
        return LinkJob(list(range(T)), spans, policy)

    def caches():
        return {
            f"model.layers.{i}.self_attn.attn": torch.zeros(B, N, HK, 2 * D, dtype=dt, device=dev).permute(0, 2, 1, 3)
            for i in range(L)
        }

    def new_linker(module, fused=None):
        kw = {"fused": fused} if fused is not None else {}
        kv = caches()
        ln = module.Linker(
            model=model,
            kv_caches=kv,
            layout=FlashAttnLayout(StubKernels()),
            rotator=rot,
            block_size=N,
            workspace_tokens=WS,
            **kw,
        )
        return ln, kv

    def link_fn(ln, module, ks, vs):
        j = job(ks, vs)

        def run():
            ln.link_many([module.LinkLoad(j, block_ids, 0, T)])
            assert j.error is None, j.error

        return run, j

    rows, pages = {}, {}
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dt),
        "shapes": {"L": L, "Hq": HQ, "Hkv": HK, "D": D, "chunks": NCH, "chunk_tokens": CH, "T": T, "hidden": HID},
    }
    print(f"device_link: {json.dumps(env)}", flush=True)
    fused_ok = kernels.available(dev)
    paths = []
    if fused_ok:
        paths += [("fused, pinned host records", lk, True, "pinned"), ("fused, GPU-tier records", lk, True, "gpu")]
        paths += [("fused, pageable host records", lk, True, "pageable")]
    paths += [("torch filler, pinned host records", lk, False, "pinned")]
    if a.before:
        spec = importlib.util.spec_from_file_location("epic_rag.engine._linker_before", a.before)
        before = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = before
        spec.loader.exec_module(before)
        paths += [("before (8a1e6d1), pinned host records", before, None, "pinned")]
        paths += [("before (8a1e6d1), pageable host records", before, None, "pageable")]
    nR = None
    with torch.inference_mode():
        for name, module, fused, kind in paths:
            try:
                ln, kv = new_linker(module, fused)
                run, j = link_fn(ln, module, *records(kind))
                rows[name] = timed(run, dev, reps)
                nR = j.recomputed
                pages[name] = kv
                if hasattr(ln, "filler"):
                    rows[name]["filler"] = type(ln.filler).__name__
                print(f"  {name:42s} {rows[name]}", flush=True)
            except Exception as e:  # one path failing must not hide the others
                rows[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
                print(f"  {name:42s} FAILED {rows[name]['error']}", flush=True)
        nR = nR or GLUE + 16 * NCH + TAIL
        h0 = torch.randn(nR, HID, generator=g).to(dt).to(dev)
        hT = torch.randn(T, HID, generator=g).to(dt).to(dev)
        w = model.weights

        def gemms(h, attn):
            q, k, v = (h @ w["qkv"]).split([HQ * D, HK * D, HK * D], dim=-1)
            x = attn(q, k, v, h.shape[0]) @ w["o"]
            gu = x @ w["gu"]
            return (F.silu(gu[:, :FF]) * gu[:, FF:]) @ w["down"]

        def no_attn(q, k, v, n):
            return torch.zeros(n, HQ * D, dtype=dt, device=dev)

        def causal(q, k, v, n):
            qh = q.view(n, HQ, D).transpose(0, 1)
            kh, vh = k.view(n, HK, D).transpose(0, 1), v.view(n, HK, D).transpose(0, 1)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
            return o.transpose(0, 1).reshape(n, HQ * D)

        def stack(h, attn):
            for _ in range(L):
                h = gemms(h, attn)
            return h

        rows["reference: recompute GEMMs alone"] = timed(lambda: stack(h0, no_attn), dev, reps)
        rows["reference: full prefill (GEMMs + causal SDPA)"] = timed(lambda: stack(hT, causal), dev, max(3, reps // 3))
        nbytes = 2 * L * NCH * CH * HK * D * torch.finfo(dt).bits // 8
        if dev.type == "cuda":
            src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
            dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            h2d = timed(lambda: dst.copy_(src, non_blocking=True), dev, reps)
            rows["reference: H2D pinned copy of the records"] = h2d
            dst2 = torch.empty_like(dst)
            rows["reference: D2D copy of the records"] = timed(lambda: dst2.copy_(dst), dev, reps)
        extra = {}
        try:
            extra["budget"] = check_budget(new_linker, link_fn, records, stack, hT, dev)
        except Exception as e:
            extra["budget"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        try:
            extra["capture"] = check_capture(new_linker, link_fn, records, block_ids, T, dev)
        except Exception as e:
            extra["capture"] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(f"  budget: {extra['budget']}\n  capture: {extra['capture']}", flush=True)
    for k in [r for r in rows if r.startswith("reference")]:
        print(f"  {k:42s} {rows[k]}", flush=True)
    # pages: every path against the fused one from pinned records (or the first that ran)
    base_name = next(iter(pages))
    base = pages[base_name]
    compare = {}
    for name, kv in pages.items():
        worst, nbad = 0.0, 0
        for key, c in kv.items():
            x, y = c.float(), base[key].float()
            ulp = torch.finfo(dt).eps * y.abs().clamp_min(torch.finfo(dt).tiny)
            d = (x - y).abs()
            nbad += int((d > ulp * 1.0001).sum())
            worst = max(worst, float(d.max()))
        compare[name] = {"max_abs_diff": worst, "elements_beyond_1_ulp": nbad}
        print(f"  pages {name:36s} vs {base_name}: {compare[name]}", flush=True)

    def ms(name):
        return rows.get(name, {}).get("wall_ms")

    full, gem = ms("reference: full prefill (GEMMs + causal SDPA)"), ms("reference: recompute GEMMs alone")
    h2d = ms("reference: H2D pinned copy of the records")
    summary = {}
    for name in ("fused, pinned host records", "fused, GPU-tier records"):
        t = ms(name)
        if t and full and gem:
            summary[name] = {
                "link_ms": t,
                "full_over_link": round(full / t, 2),
                "overhead_beyond_gemms_ms": round(t - gem, 3),
            }
    if h2d and "fused, pinned host records" in summary:
        summary["fused, pinned host records"]["overhead_over_h2d"] = round(
            summary["fused, pinned host records"]["overhead_beyond_gemms_ms"] / h2d, 2
        )
    ok = all("error" not in r for r in [*rows.values(), *extra.values()]) and extra["capture"]["equal"]
    ok = ok and all(c["elements_beyond_1_ulp"] == 0 for n, c in compare.items() if not n.startswith("before"))
    out = {
        "script": "scripts/device_link.py",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "env": env,
        "recomputed_rows": nR,
        "rows": rows,
        "pages_vs": base_name,
        "pages": compare,
        "summary": summary,
        **extra,
        "all_passed": ok,
    }
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print("ALL PASSED" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
