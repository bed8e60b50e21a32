"""Attention references for scripts/device_check.py (torch only, no vLLM): a dense masked reference, the
runs-as-sequences plan through SDPA, torch's varlen FlashAttention (packed and paged) and the flash_attn
package, and FlashAttnLayout's two kernels written with torch alone."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


def _expand(x: torch.Tensor, G: int) -> torch.Tensor:
    """[Hk, T, D] -> [1, Hk*G, T, D]: kv head j serves query heads j*G .. j*G+G-1."""
    return x.repeat_interleave(G, dim=0)[None]


def dense_reference(q, K, V, R, scale, offset: int = 0) -> torch.Tensor:
    """Dense masked SDPA: query at position R[i] attends keys t <= R[i] + offset.  # -> [nR, Hq, D]"""
    Hq, Hk = q.shape[1], K.shape[0]
    T = K.shape[1]
    mask = torch.arange(T, device=q.device)[None, :] <= (R[:, None] + offset)  # [nR, T]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], _expand(K, Hq // Hk), _expand(V, Hq // Hk), attn_mask=mask, scale=scale
    )
    return out[0].transpose(0, 1)


def per_run_sdpa(q, K, V, qsl, seq_lens, scale) -> torch.Tensor:
    """The runs-as-sequences plan with torch SDPA: run i's queries over keys [0, seq_lens[i]), causal
    aligned bottom-right (torch.nn.attention.bias.causal_lower_right).  # q: [nR, Hq, D] -> [nR, Hq, D]"""
    from torch.nn.attention.bias import causal_lower_right

    G = q.shape[1] // K.shape[0]
    out = torch.empty_like(q)
    for i in range(len(seq_lens)):
        a, b, n = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        o = F.scaled_dot_product_attention(
            q[a:b].transpose(0, 1)[None],
            _expand(K[:, :n], G),
            _expand(V[:, :n], G),
            attn_mask=causal_lower_right(b - a, n),
            scale=scale,
        )
        out[a:b] = o[0].transpose(0, 1)
    return out


def _packed_keys(K, V, seq_lens):
    """Each run's keys [0, seq_len) packed one after the other.  # -> k, v: [sum, Hk, D], cu_seq_k"""
    k = torch.cat([K[:, : int(n)].transpose(0, 1) for n in seq_lens])
    v = torch.cat([V[:, : int(n)].transpose(0, 1) for n in seq_lens])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(seq_lens, 0).to(torch.int32)])
    return k.contiguous(), v.contiguous(), cu.to(K.device)


def torch_varlen(q, K, V, qsl, seq_lens, scale, paged=None) -> torch.Tensor:
    """torch.nn.attention.varlen.varlen_attn (FlashAttention) over the runs: packed keys, or with
    paged=(key_pages, value_pages, block_table) the FlashAttnLayout cache itself."""
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    kw = {"scale": scale} if "scale" in params else {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0)  # causal, bottom-right aligned
    else:
        kw["is_causal"] = True
    G = q.shape[1] // K.shape[0]
    qs = qsl.to(q.device)
    max_q, max_k = int((qsl[1:] - qsl[:-1]).max()), int(seq_lens.max())
    if paged is not None:
        if "block_table" not in params:
            raise RuntimeError("this torch's varlen_attn has no block_table")
        kp, vp, bt = paged
        kw.update(enable_gqa=True, seqused_k=seq_lens.to(q.device), block_table=bt)
        return varlen_attn(q, kp, vp, qs, None, max_q, max_k, **kw)
    k, v, cu = _packed_keys(K, V, seq_lens)
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    return varlen_attn(q, k, v, qs, cu, max_q, max_k, **kw)


def flash_attn_pkg(q, K, V, qsl, seq_lens, scale) -> torch.Tensor:
    from flash_attn import flash_attn_varlen_func

    k, v, cu = _packed_keys(K, V, seq_lens)
    max_q, max_k = int((qsl[1:] - qsl[:-1]).max()), int(seq_lens.max())
    return flash_attn_varlen_func(
        q, k, v, qsl.to(q.device), cu, max_q, max_k, softmax_scale=scale, causal=True
    )  # causal is bottom-right aligned since flash-attn 2.1


class TorchVarlenKernels:
    """FlashAttnLayout's two kernels on torch alone (the device has no vLLM): the cache write by indexing, the
    varlen attention by torch's paged FlashAttention (varlen_attn with block_table and seqused_k)."""

    def cache_write(self, attn, k, v, key_cache, value_cache, slots) -> None:
        N = key_cache.shape[1]
        key_cache[slots // N, slots % N] = k.to(key_cache.dtype)
        value_cache[slots // N, slots % N] = v.to(value_cache.dtype)

    def varlen(self, attn, q, key_cache, value_cache, out, plan) -> None:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        if "block_table" not in params:
            raise RuntimeError("this torch's varlen_attn has no block_table")
        kw = {"scale": attn.impl.scale} if "scale" in params else {}
        kw.update({"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True})
        out.copy_(
            varlen_attn(
                q,
                key_cache,
                value_cache,
                plan.query_start_loc,
                None,
                plan.max_query_len,
                plan.max_seq_len,
                enable_gqa=True,
                seqused_k=plan.seq_lens,
                block_table=plan.block_table,
                **kw,
            )
        )
