#!/usr/bin/env python
"""Device check of epic_rag's torch-level GPU code path (issue 15): needs torch only, not vLLM.

    python scripts/device_check.py                       # CUDA, bf16, Llama-3-8B shapes (< 5 min on an H200)
    python scripts/device_check.py --out docs/device_check_h200.json
    python scripts/device_check.py --device cpu --dtype fp32 --quick   # the logic, on CPU (tests run this)

Checks (each prints PASS/FAIL with its max error and tolerance; the JSON summary holds them all):
1. rotation: KeyRotator re-rotates keys computed with RoPE at p by shifts s (positive and negative) on the
   device, in the target dtype; they must equal keys computed with RoPE at p + s (fp32 reference, compared
   after rounding both to the dtype); the cos/sin tables live on the keys' device.
2. layout: FlashAttnLayout writes and reads vLLM FlashAttention-shaped caches (logical [B, H, N, 2D], both
   a contiguous and an NHD-strided physical layout) at Llama-3-8B's shape: ranges with partial blocks and
   scattered slots round-trip exactly, vLLM's own K/V views see the same values, nothing else is touched.
3. attention: queries of a LegoLink-like recompute set R (first 16 tokens of each 512-token chunk plus a
   question tail) attend causally over all T keys: the linker's buffer path (_LinkAttention) and the
   runs-as-sequences plan (layout.query_runs: torch SDPA per run with a bottom-right causal mask, and
   where available torch's varlen FlashAttention, packed and paged over the FlashAttnLayout cache, and the
   flash_attn package) against a dense masked SDPA reference; a mask off by one must miss it by far.
   FlashAttnLayout's own kernel path (the linker's CUDA adapter: RunPlan, cache write, one varlen call) with
   a kernel written from FlashAttention's contract and, on CUDA, torch's paged FlashAttention.
4. timings (medians, ms) of the torch-level pieces for an 8B-shaped layer: rotating a 4096-token chunk's
   keys for 32 layers, FlashAttnLayout writes of 4096 tokens in 32 layers, the buffer-path attention of R,
   the per-run SDPA plan, the dense reference.

The script blocks `import vllm` when run as a script: it must not depend on it.
Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # the repository's epic_rag, not installed on the device machine

from device_attention import (  # noqa: E402  (beside this script: the attention references it checks against)
    TorchVarlenKernels,
    dense_reference,
    flash_attn_pkg,
    per_run_sdpa,
    torch_varlen,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128; vLLM's default block of 16 tokens.
LAYERS, HQ, HK, D, BLOCK = 32, 32, 8, 128, 16


class _NoVllm(importlib.abc.MetaPathFinder):
    """Makes `import vllm` fail, as on the device machine."""

    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (device_check runs without vLLM)", name=name)
        return None


def block_vllm() -> None:
    if not any(isinstance(f, _NoVllm) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoVllm())


class Llama3RotaryEmbedding(torch.nn.Module):
    """Stand-in for vLLM's rotary module of this name (KeyRotator accepts it by name): the fields and the
    fp32 cos||sin table KeyRotator reads, computed as vLLM does (Llama-3.1 scaling, theta 500000)."""

    def __init__(self, head_size: int, max_position: int, is_neox_style: bool = True) -> None:
        super().__init__()
        self.rotary_dim, self.is_neox_style, self.max_position = head_size, is_neox_style, max_position
        self.base, self.factor, self.low, self.high, self.orig = 500000.0, 8.0, 1.0, 4.0, 8192

    def inv_freq(self) -> torch.Tensor:
        inv = 1.0 / (self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        wave_len = 2 * math.pi / inv
        smooth = (self.orig / wave_len - self.low) / (self.high - self.low)
        return torch.where(
            wave_len < self.orig / self.high,
            inv,
            torch.where(
                wave_len > self.orig / self.low, inv / self.factor, (1 - smooth) * inv / self.factor + smooth * inv
            ),
        )

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        freqs = torch.einsum("i,j->ij", torch.arange(self.max_position, dtype=torch.float), self.inv_freq())
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)  # [P, rot]


def rope_fp32(x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, neox: bool) -> torch.Tensor:
    """RoPE at `pos`, written out as vLLM's forward_native does, in fp32.  # x: [..., n, H, D], pos: [n]"""
    cos, sin = table[pos].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # [n, 1, D/2]
    if neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


class Report:
    def __init__(self) -> None:
        self.checks: list[dict] = []
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []
        self.timings_shape: dict[str, int] = {}

    def check(self, name: str, err: float, tol: float, **details) -> bool:
        ok = bool(err <= tol)  # NaN fails
        self.checks.append({"name": name, "passed": ok, "max_err": err, "tol": tol, **details})
        extra = " ".join(f"{k}={v}" for k, v in details.items())
        print(f"{'PASS' if ok else 'FAIL'}  {name}: max_err={err:.3g} tol={tol:.3g} {extra}".rstrip(), flush=True)
        return ok

    def flag(self, name: str, ok: bool, **details) -> bool:
        self.checks.append({"name": name, "passed": bool(ok), **details})
        extra = " ".join(f"{k}={v}" for k, v in details.items())
        print(f"{'PASS' if ok else 'FAIL'}  {name} {extra}".rstrip(), flush=True)
        return bool(ok)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"NOTE  {text}", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(report: Report, name: str, fn, device: torch.device, reps: int, warmup: int = 1) -> None:
    for _ in range(warmup):
        fn()
    _sync(device)
    ms = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ms.append((time.perf_counter() - t0) * 1e3)
    report.timings[name] = round(statistics.median(ms), 4)
    print(f"TIME  {name}: {statistics.median(ms):.3f} ms (median of {reps})", flush=True)


# ---------------------------------------------------------------------------------------------- 1. rotation


def check_rotation(report: Report, device: torch.device, dtype: torch.dtype, quick: bool) -> None:
    from epic_rag.engine.link.rope import KeyRotator

    max_pos = 8192
    eps = torch.finfo(dtype).eps
    g = torch.Generator().manual_seed(11)
    L, n = (2, 24) if quick else (4, 128)
    # (compiled at base b, shifted by s): into place, far, back to 0 behind the sink, across the table.
    cases = [(1, 511), (1, 4095), (0, 7000), (1, -1), (600, -599), (4000, -2500), (300, 1)]
    for neox in (True, False):
        rotary = Llama3RotaryEmbedding(D, max_pos, is_neox_style=neox)
        rot = KeyRotator(rotary)
        table = rotary._compute_cos_sin_cache()
        raw = torch.randn((L, n, HK, D), generator=g) * 2  # pre-RoPE keys, fp32
        worst, scale, top = 0.0, 0.0, 0
        for b, s in cases:
            at_b = rope_fp32(raw, torch.arange(b, b + n), table, neox).to(dtype).to(device)  # as cached
            want = rope_fp32(raw, torch.arange(b + s, b + s + n), table, neox).to(dtype).to(device)
            got = rot.rotate(at_b, s)
            if got.device != at_b.device or got.dtype != torch.float32:
                report.flag(f"rotation/neox={neox}/output", False, device=str(got.device), dtype=str(got.dtype))
            worst = max(worst, float((got.to(dtype).float() - want.float()).abs().max()))
            scale = max(scale, float(want.float().abs().max()))
            top = max(top, b + s + n)
        # Both sides round to the dtype (an ulp of the largest key), plus fp32 angle rounding at large positions.
        tol = (2 * eps + 4 * top * 2.0**-24) * scale
        report.check(f"rotation/neox={neox}", worst, tol, shifts=[s for _, s in cases], dtype=str(dtype))
        tables_dev = rot.tables(device)
        report.flag(
            f"rotation/neox={neox}/tables_on_keys_device",
            tables_dev[0].device.type == device.type
            and tables_dev[0].dtype == torch.float32
            and rot.tables(device)[0] is tables_dev[0],
            table_device=str(tables_dev[0].device),
        )


# ------------------------------------------------------------------------------------------------ 2. layout


def _flash_cache(B: int, dtype: torch.dtype, device: torch.device, physical: str) -> torch.Tensor:
    """A FlashAttention per-layer cache: logical [B, H, N, 2D]; physical BHNC (contiguous) or BNHC (NHD)."""
    if physical == "BHNC":
        return torch.full((B, HK, BLOCK, 2 * D), float("nan"), dtype=dtype, device=device)
    return torch.full((B, BLOCK, HK, 2 * D), float("nan"), dtype=dtype, device=device).permute(0, 2, 1, 3)


def check_layout(report: Report, device: torch.device, dtype: torch.dtype, quick: bool) -> None:
    from epic_rag.engine.link.layout import FlashAttnLayout, slots_for
    from epic_rag.testing.varlen import ReferenceFlashKernels

    layout = FlashAttnLayout(ReferenceFlashKernels())  # the start-up check runs the kernels: the stand-in here
    T = 512 if quick else 4096
    nblk = -(-T // BLOCK)
    B = nblk * 2
    g = torch.Generator().manual_seed(5)
    for physical in ("BHNC", "BNHC"):
        cache = _flash_cache(B, dtype, device, physical)
        layout.self_check(cache)  # raises LayoutError on a mismatch
        block_ids = torch.randperm(B, generator=g)[:nblk].tolist()
        # The linker's buffers: fp32 [Hkv, T, D], written as transposed views (as Linker.link does).
        K = torch.randn((HK, T, D), generator=g).to(device)
        V = torch.randn((HK, T, D), generator=g).to(device)
        # Partial blocks at either end, a range within one block, whole aligned blocks (T >= 512).
        ranges = [(0, 5), (5, 37), (55, 16 * 9 + 2), (16 * 13, 16 * 17), (T - 150, T - 3)]
        written = torch.zeros(T, dtype=torch.bool)
        for a, e in ranges:
            layout.write_range(cache, block_ids, a, e, K[:, a:e].transpose(0, 1), V[:, a:e].transpose(0, 1))
            written[a:e] = True
        # Scattered single slots (CacheBlend-like picks) through write().
        free = torch.nonzero(~written).flatten()
        picks = free[torch.randperm(len(free), generator=g)[:40]].sort().values
        slots = slots_for(block_ids, picks, BLOCK).to(device)
        layout.write(cache, slots, K[:, picks.to(device)].transpose(0, 1), V[:, picks.to(device)].transpose(0, 1))
        written[picks] = True
        bad = 0
        for a, e in ranges:
            rk, rv = layout.read_range(cache, block_ids, a, e)
            bad += int(not torch.equal(rk, K[:, a:e].transpose(0, 1).to(dtype)))
            bad += int(not torch.equal(rv, V[:, a:e].transpose(0, 1).to(dtype)))
        rk, rv = layout.read(cache, slots)
        bad += int(not torch.equal(rk, K[:, picks.to(device)].transpose(0, 1).to(dtype)))
        bad += int(not torch.equal(rv, V[:, picks.to(device)].transpose(0, 1).to(dtype)))
        # vLLM's own view of the same cache: (B, H, N, 2D) -> (B, N, H, D) each.
        key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)
        pos = torch.nonzero(written).flatten()
        s = slots_for(block_ids, pos, BLOCK).to(device)
        vk, vv = key_cache[s // BLOCK, s % BLOCK], value_cache[s // BLOCK, s % BLOCK]  # [n, H, D]
        pd = pos.to(device)
        view_ok = torch.equal(vk, K[:, pd].transpose(0, 1).to(dtype)) and torch.equal(
            vv, V[:, pd].transpose(0, 1).to(dtype)
        )
        # Nothing outside the addressed slots: every other slot still holds the NaN fill.
        addressed = torch.zeros(B * BLOCK, dtype=torch.bool, device=device)
        addressed[s] = True
        per_slot = cache.transpose(1, 2).reshape(B * BLOCK, HK * 2 * D)  # [slots, H*2D]
        outside_ok = bool(torch.isnan(per_slot[~addressed]).all()) and not bool(torch.isnan(per_slot[addressed]).any())
        report.flag(
            f"layout/{physical}",
            bad == 0 and view_ok and outside_ok,
            mismatched_reads=bad,
            vllm_view_equal=view_ok,
            untouched_outside=outside_ok,
            tokens=int(written.sum()),
            shape=list(cache.shape),
            dtype=str(dtype),
        )


# --------------------------------------------------------------------------------------------- 3. attention


def legolink_R(T: int, chunks: int = 8, head: int = 16, tail: int = 32) -> torch.Tensor:
    """First `head` tokens of each chunk (chunks of T // chunks, the last cut short by the question tail)
    plus the question tail [T - tail, T)."""
    size = T // chunks
    parts = [torch.arange(i * size, min(i * size + head, T - tail)) for i in range(chunks)]
    return torch.unique(torch.cat(parts + [torch.arange(T - tail, T)]))


def check_flash_adapter(report: Report, s, device, dtype, T: int, tol: float, ref: torch.Tensor) -> None:
    """FlashAttnLayout's own kernel path (RunPlan on the device, cache write, one varlen call), as the linker
    calls it, with a kernel written from FlashAttention's contract and, on CUDA, torch's FlashAttention."""
    from epic_rag.engine.link.layout import FlashAttnLayout, LayoutError
    from epic_rag.testing.varlen import ReferenceFlashKernels

    nR = len(s.R)
    attn = SimpleNamespace(num_heads=HQ, num_kv_heads=HK, head_size=D, impl=SimpleNamespace(scale=s.scale))
    kernels = [("reference", ReferenceFlashKernels())]
    if device.type == "cuda" and dtype != torch.float32:
        kernels.append(("torch_varlen", TorchVarlenKernels()))
    for name, kern in kernels:
        try:
            layout, nblk = FlashAttnLayout(kern), -(-T // BLOCK)
            cache = torch.zeros((2 * nblk, BLOCK, HK, 2 * D), dtype=dtype, device=device).permute(0, 2, 1, 3)
            block_ids = torch.randperm(2 * nblk, generator=torch.Generator().manual_seed(9))[:nblk].tolist()
            layout.write_range(cache, block_ids, 0, T, s.K0.transpose(0, 1), s.V0.transpose(0, 1))  # cached KV
            assert layout.can_attend(s.R, 0, T)
            plan = layout.attention_plan(cache, [(block_ids, s.R)], attn)
            args = (s.q.to(dtype).reshape(nR, -1), s.k.to(dtype).reshape(nR, -1), s.v.to(dtype).reshape(nR, -1))
            out = layout.attend(plan, attn, cache, *args).view(nR, HQ, D).float()
            report.check(f"attention/flash_layout_adapter_{name}", float((out - ref).abs().max()), tol)
            # the start-up check the connector runs (vLLM's kernels there; these here) on this cache's strides
            try:
                layout.self_check(cache)
                report.flag(f"layout/start_up_self_check_{name}", True)
            except LayoutError as e:
                report.flag(f"layout/start_up_self_check_{name}", False, error=str(e)[:300])
            if name == "torch_varlen":
                timed(
                    report,
                    f"flash_layout_attend_{T}_tokens",
                    lambda: layout.attend(plan, attn, cache, *args),
                    device,
                    20,
                    3,
                )
        except Exception as e:
            report.note(
                f"FlashAttnLayout adapter with {name} kernels failed to run: {type(e).__name__}: {str(e)[:200]}"
            )


def attention_setup(device, dtype, T, seed=3):
    from epic_rag.engine.link.linker import _LinkAttention, _Seq

    g = torch.Generator().manual_seed(seed)
    R = legolink_R(T).to(device)
    nR, G = len(R), HQ // HK
    scale = D**-0.5

    def rnd(x):  # the values every path sees: rounded to the model dtype, held in fp32
        return x.to(dtype).float().to(device)

    K0, V0 = rnd(torch.randn((HK, T, D), generator=g)), rnd(torch.randn((HK, T, D), generator=g))  # cached KV
    k = rnd(torch.randn((nR, HK, D), generator=g))  # R's fresh keys/values
    v = rnd(torch.randn((nR, HK, D), generator=g))
    # Queries lean towards their own key, so a mask off by one position changes the output measurably.
    q = rnd(0.6 * k.cpu().repeat_interleave(G, dim=1) + torch.randn((nR, HQ, D), generator=g))
    Kf, Vf = K0.clone(), V0.clone()  # the layer's final K/V: cached, with R's fresh ones in place
    Kf[:, R], Vf[:, R] = k.transpose(0, 1), v.transpose(0, 1)
    real = SimpleNamespace(num_heads=HQ, num_kv_heads=HK, head_size=D, impl=SimpleNamespace(scale=scale))

    def buffer_path():
        # One request, one layer, on the buffer path: the linker gathers the layer's K/V from its pages (here the
        # cached K0/V0, [T, Hkv, D]) and the shim writes R's fresh K/V in; R lives on the host, as in the linker.
        Kb, Vb = K0.transpose(0, 1).contiguous(), V0.transpose(0, 1).contiguous()
        load = SimpleNamespace(job=SimpleNamespace(token_ids=range(T)), block_ids=None)
        seq = _Seq(load=load, R=R.cpu(), cached=None, candidate=None)
        linker = SimpleNamespace(
            attn=[(None, None, real)],
            cache_of=lambda li: None,
            gather=lambda cache, block_ids, n: (Kb[:n], Vb[:n]),
            layout=SimpleNamespace(write=lambda *a: None),  # the pages' copy of R's K/V: none here
        )
        shim = _LinkAttention(linker, 0, SimpleNamespace(seqs=[seq], plan=None, kernel_rows=None))
        return shim(q.to(dtype).reshape(nR, -1), k.to(dtype).reshape(nR, -1), v.to(dtype).reshape(nR, -1))

    return SimpleNamespace(R=R, q=q, k=k, v=v, K0=K0, V0=V0, Kf=Kf, Vf=Vf, scale=scale, buffer_path=buffer_path)


def check_attention(report: Report, device: torch.device, dtype: torch.dtype, quick: bool) -> None:
    from epic_rag.engine.link.layout import FlashAttnLayout, query_runs

    T = 512 if quick else 4096
    s = attention_setup(device, dtype, T)
    R, nR = s.R, len(s.R)
    qsl, seq_lens = query_runs(R)
    ref = dense_reference(s.q, s.Kf, s.Vf, R, s.scale)  # fp32 dense
    # The fp32 SDPA reference against plain fp64 math on the same inputs.
    G = HQ // HK
    sc = torch.einsum("nhd,htd->hnt", s.q.double(), s.Kf.double().repeat_interleave(G, 0)) * s.scale
    sc.masked_fill_(torch.arange(T, device=device)[None, None, :] > R[None, :, None], float("-inf"))
    ref64 = torch.einsum("hnt,htd->nhd", torch.softmax(sc, -1), s.Vf.double().repeat_interleave(G, 0))
    mag = max(1.0, float(ref.abs().max()))
    report.check("attention/dense_sdpa_vs_fp64", float((ref.double() - ref64).abs().max()), 1e-4 * mag)
    # Outputs are rounded to the dtype (half an ulp of the largest) and 16-bit kernels round P: 2 ulps.
    tol = (2e-4 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps) * mag
    # A mask one position off either way must miss the reference by well over the tolerance, or the
    # checks below could not see such a bug.
    for name, off in (("self_excluded", -1), ("one_future_key", 1)):
        miss = float((dense_reference(s.q, s.Kf, s.Vf, R, s.scale, off) - ref).abs().max())
        report.flag(f"attention/mask_sensitivity/{name}", miss > 2 * tol, miss=round(miss, 4), needs_over=2 * tol)
    info = {"T": T, "nR": nR, "runs": len(seq_lens), "dtype": str(dtype)}
    out = s.buffer_path().view(nR, HQ, D).float()
    report.check("attention/buffer_path(_LinkAttention)", float((out - ref).abs().max()), tol, **info)
    qd, Kd, Vd = s.q.to(dtype), s.Kf.to(dtype), s.Vf.to(dtype)
    out = per_run_sdpa(qd, Kd, Vd, qsl, seq_lens, s.scale).float()
    report.check("attention/runs_plan_sdpa", float((out - ref).abs().max()), tol, runs=len(seq_lens))
    check_flash_adapter(report, s, device, dtype, T, tol, ref)
    if device.type != "cuda" or dtype == torch.float32:
        report.note("varlen FlashAttention variants need CUDA and bf16/fp16: not run")
        return
    try:
        out = torch_varlen(qd, Kd, Vd, qsl, seq_lens, s.scale).float()
        report.check("attention/runs_plan_torch_varlen", float((out - ref).abs().max()), tol)
    except Exception as e:  # an API this torch lacks is not a failure of epic_rag's logic
        report.note(f"torch varlen_attn (packed) unavailable: {type(e).__name__}: {str(e)[:200]}")
    try:
        # The paged form: R's fresh and the cached K/V written into a FlashAttention cache by
        # FlashAttnLayout, the kernel reading the pages through vLLM's (B, N, H, D) views.
        layout, nblk = FlashAttnLayout(), -(-T // BLOCK)
        cache = torch.zeros((2 * nblk, BLOCK, HK, 2 * D), dtype=dtype, device=device).permute(0, 2, 1, 3)
        block_ids = torch.randperm(2 * nblk, generator=torch.Generator().manual_seed(8))[:nblk].tolist()
        layout.write_range(cache, block_ids, 0, T, s.Kf.transpose(0, 1), s.Vf.transpose(0, 1))
        kp, vp = cache.transpose(1, 2).split(D, dim=-1)
        bt = torch.as_tensor(block_ids, dtype=torch.int32, device=device).expand(len(seq_lens), nblk).contiguous()
        out = torch_varlen(qd, Kd, Vd, qsl, seq_lens, s.scale, paged=(kp, vp, bt)).float()
        report.check("attention/runs_plan_torch_varlen_paged", float((out - ref).abs().max()), tol, block=BLOCK)
    except Exception as e:
        report.note(f"torch varlen_attn (paged, block {BLOCK}) unavailable: {type(e).__name__}: {str(e)[:200]}")
    try:
        out = flash_attn_pkg(qd, Kd, Vd, qsl, seq_lens, s.scale).float()
        report.check("attention/runs_plan_flash_attn", float((out - ref).abs().max()), tol)
    except ImportError:
        report.note("flash_attn package not installed: not run")
    except Exception as e:
        report.note(f"flash_attn varlen failed to run: {type(e).__name__}: {str(e)[:200]}")


# ----------------------------------------------------------------------------------------------- 4. timings


def _time_rotation(report, device, dtype, L, T, reps, warmup) -> None:
    from epic_rag.engine.link.rope import KeyRotator

    rot = KeyRotator(Llama3RotaryEmbedding(D, 8192))
    keys = torch.randn((L, T, HK, D), generator=torch.Generator().manual_seed(21)).to(dtype).to(device)
    timed(report, f"rotate_{T}_tokens_{L}_layers", lambda: rot.rotate(keys, 1234), device, reps, warmup)


def _time_layout_write(report, device, dtype, L, T, reps, warmup) -> None:
    from epic_rag.engine.link.layout import FlashAttnLayout

    g = torch.Generator().manual_seed(22)
    layout, nblk = FlashAttnLayout(), -(-T // BLOCK)
    caches = [torch.zeros((nblk + 8, HK, BLOCK, 2 * D), dtype=dtype, device=device) for _ in range(L)]
    block_ids = torch.randperm(nblk + 8, generator=g)[:nblk].tolist()
    K = torch.randn((HK, T, D), generator=g).to(device)  # the linker's fp32 buffers, written transposed
    V = torch.randn((HK, T, D), generator=g).to(device)

    def write_all():
        for c in caches:
            layout.write_range(c, block_ids, 0, T, K.transpose(0, 1), V.transpose(0, 1))

    timed(report, f"layout_write_{T}_tokens_{L}_layers", write_all, device, reps, warmup)


def _time_attention(report, device, dtype, T, reps, warmup) -> int:
    from epic_rag.engine.link.layout import query_runs

    s = attention_setup(device, dtype, T, seed=4)
    qsl, seq_lens = query_runs(s.R)
    qd, Kd, Vd = s.q.to(dtype), s.Kf.to(dtype), s.Vf.to(dtype)
    timed(report, f"buffer_path_attention_1_layer_nR{len(s.R)}_T{T}", s.buffer_path, device, reps, warmup)
    plan = f"runs_plan_sdpa_1_layer_{len(seq_lens)}_runs"
    timed(report, plan, lambda: per_run_sdpa(qd, Kd, Vd, qsl, seq_lens, s.scale), device, reps, warmup)
    dense = lambda: dense_reference(s.q, s.Kf, s.Vf, s.R, s.scale)
    timed(report, "dense_reference_fp32_1_layer", dense, device, reps, warmup)
    return len(s.R)


def run_timings(report: Report, device: torch.device, dtype: torch.dtype, quick: bool) -> None:
    L, T, reps, warmup = (2, 512, 1, 0) if quick else (LAYERS, 4096, 5, 1)
    _time_rotation(report, device, dtype, L, T, reps, warmup)
    _time_layout_write(report, device, dtype, L, T, reps, warmup)
    nR = _time_attention(report, device, dtype, T, reps, warmup)
    report.timings_shape = {"layers": L, "T": T, "nR": nR, "Hq": HQ, "Hkv": HK, "D": D, "block": BLOCK}


# -------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--out", default=None, help="write the JSON summary here")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repetitions (the logic, not timings)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    env = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": str(dtype),
        "quick": args.quick,
        "python": platform.python_version(),
        "vllm_importable": _vllm_importable(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    print(f"device_check: {json.dumps(env)}", flush=True)
    report = Report()
    sections = (
        ("rotation", check_rotation),
        ("layout", check_layout),
        ("attention", check_attention),
        ("timings", run_timings),
    )
    with torch.inference_mode():
        for name, fn in sections:
            try:
                fn(report, device, dtype, args.quick)
            except Exception as e:  # a crash is a failed check, and the later sections still run
                report.flag(f"{name}/crashed", False, error=f"{type(e).__name__}: {e}"[:500])
    passed = all(c["passed"] for c in report.checks)
    summary = {
        "script": "scripts/device_check.py",
        "argv": sys.argv[1:] if argv is None else list(argv),
        "env": env,
        "all_passed": passed,
        "checks": report.checks,
        "notes": report.notes,
        "timings_ms": report.timings,
        "timings_shape": report.timings_shape,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    n_fail = sum(not c["passed"] for c in report.checks)
    print(f"{'ALL PASSED' if passed else f'{n_fail} FAILED'}: {len(report.checks)} checks in {summary['elapsed_s']} s")
    return 0 if passed else 1


def _vllm_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


if __name__ == "__main__":
    block_vllm()
    sys.exit(main())
