"""A pure-torch stand-in for vLLM's FlashAttention kernels, written from their documented contract only.

Lets FlashAttnLayout's plan and adapter run on CPU (tests) and next to the real kernels on a GPU
(scripts/device_check.py): one gather of each run's keys through its block table, a bottom-right causal
mask, softmax in fp32. Slow; for checking, never for serving.
"""

from __future__ import annotations

import torch


class ReferenceFlashKernels:
    """Implements epic_rag.engine.link.layout.FlashKernels: vLLM's reshape_and_cache_flash and
    flash_attn_varlen_func (paged: block_table + seqused_k, causal=True)."""

    def __init__(self) -> None:
        self.calls = 0  # varlen calls made (one per layer per batched link)

    def cache_write(self, attn, k, v, key_cache, value_cache, slots) -> None:
        # key_cache, value_cache: [B, N, Hkv, D] views of the layer's cache; k, v: [n, Hkv, D]
        N = key_cache.shape[1]
        b, o = slots // N, slots % N
        key_cache[b, o] = k.to(key_cache.dtype)
        value_cache[b, o] = v.to(value_cache.dtype)

    def varlen(self, attn, q, key_cache, value_cache, out, plan) -> None:
        # q, out: [n, Hq, D]; run r's queries are q[qsl[r]:qsl[r+1]], its keys positions [0, seq_lens[r])
        self.calls += 1
        N = key_cache.shape[1]
        G = q.shape[1] // key_cache.shape[2]
        qsl, lens = plan.query_start_loc.tolist(), plan.seq_lens.tolist()
        for r, n_k in enumerate(lens):
            a, b = qsl[r], qsl[r + 1]
            pos = torch.arange(n_k, device=q.device)
            blocks = plan.block_table[r].long()[pos // N]
            K = key_cache[blocks, pos % N].float().repeat_interleave(G, 1)  # [n_k, Hq, D]
            V = value_cache[blocks, pos % N].float().repeat_interleave(G, 1)
            s = torch.einsum("qhd,khd->hqk", q[a:b].float(), K) * attn.impl.scale
            m = b - a  # bottom-right: query i sees keys [0, n_k - m + i]
            s.masked_fill_(pos[None, None, :] > (n_k - m + torch.arange(m, device=q.device))[None, :, None], -torch.inf)
            out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), V).to(out.dtype)
