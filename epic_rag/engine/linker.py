"""LegoLink linker: assemble a request's KV from compiled chunks and recompute a few tokens.

Runs on the worker, inside vLLM's step, before the forward. It fills a K/V buffer for positions [0, T)
with every linked chunk's cached KV, keys rotated to their real positions; then for each layer it runs
the model's own decoder layer on the hidden states of the recompute set R only, with the attention
module swapped for `_LinkAttention` (architecture details stay in vLLM's model code). The shim either
writes R's fresh K/V into the paged cache (already holding the layer's cached KV) and attends with the
backend's own kernel, or, where the layout offers no kernel path, attends over the buffer with a
position-causal mask, the buffer being written into the pages after the layer.

Recompute sets (R always holds every token without a cache: template glue, system prompt):
- naive: nothing else;  legolink-k: the first k tokens of each chunk's span (its sink token first where
  the policy keeps it, see policy.py);  legolink-0: nothing else;
- cacheblend-r: every token through layers 0..CHECK_LAYER; at CHECK_LAYER the chunk tokens whose
  *keys* deviate most from the cache (L2 over heads and dims, after re-rotation: LMCache's rule)
  are kept, the top r fraction, and only they (plus uncached tokens) are recomputed in later layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..policy import Policy
from . import vllm_api
from .board import LinkJob
from .layout import KVLayout
from .rope import KeyRotator

CHECK_LAYER = 1  # CacheBlend selects its tokens from the deviation at this layer
ATTN_BUCKET = 256  # recompute queries are grouped by position // ATTN_BUCKET for the sparse attention


class _LinkAttention(torch.nn.Module):
    """Stands in for vLLM's Attention during the sparse forward of one layer.

    Gets post-RoPE q, k, v of the recompute set R, stores k, v into the layer's K/V buffers at R,
    and attends each query over buffer positions <= its own.
    """

    def __init__(
        self,
        real: torch.nn.Module,
        K: torch.Tensor,
        V: torch.Tensor,
        R: torch.Tensor,
        keep_old: bool = False,
        paged: tuple[KVLayout, object, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.real = real
        self.keep_old = keep_old  # CacheBlend compares fresh keys with the cached ones
        self.num_heads, self.num_kv_heads = real.num_heads, real.num_kv_heads
        self.head_size, self.scale = real.head_size, real.impl.scale
        self.K, self.V, self.R = K, V, R  # K, V: [Hkv, T, D] fp32 (head-major); R: [nR]
        self.paged = paged  # (layout, plan, cache): attend with the backend's kernel
        self.old_k: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        R = self.R
        if self.keep_old:
            self.old_k = self.K[:, R].transpose(0, 1).clone()  # [nR, Hkv, D]
        if self.paged is not None:
            # The pages already hold every cached position of this layer; R's fresh K/V go in, then
            # vLLM's own kernel attends (3x faster than the batched matmuls below, measured).
            if self.keep_old:
                self.K[:, R] = k.view(-1, Hk, D).transpose(0, 1).to(self.K.dtype)
            layout, plan, cache = self.paged
            return layout.attend(plan, self.real, cache, q, k, v)
        self.K[:, R] = k.view(-1, Hk, D).transpose(0, 1).to(self.K.dtype)
        self.V[:, R] = v.view(-1, Hk, D).transpose(0, 1).to(self.V.dtype)
        G = Hq // Hk
        qh = q.view(-1, Hk, G, D).permute(1, 2, 0, 3).float()  # [Hkv, G, nR, D]
        out = torch.empty_like(qh)
        # Queries grouped by position bucket: each group attends only up to its own last position, so
        # the cost follows the causal triangle instead of nR x T. Plain batched matmuls: on CPU, SDPA
        # with a mask and few queries was 3-10x slower (measured).
        bucket = torch.div(R, ATTN_BUCKET, rounding_mode="floor")
        bounds = torch.nonzero(bucket[1:] != bucket[:-1]).flatten().add(1).tolist()
        for lo, hi in zip([0] + bounds, bounds + [len(R)]):
            Rg = R[lo:hi]
            T = int(Rg[-1]) + 1
            g = hi - lo
            Kh, Vh = self.K[:, :T], self.V[:, :T]  # [Hkv, T, D]
            qg = qh[:, :, lo:hi].reshape(Hk, G * g, D)
            scores = torch.bmm(qg, Kh.transpose(1, 2)).mul_(self.scale).view(Hk, G, g, T)
            # Keys before the group's first query are visible to all of it: mask only the tail.
            t0 = int(Rg[0])
            blocked = torch.arange(t0, T, device=R.device)[None, :] > Rg[:, None]  # [g, T - t0]
            scores[..., t0:].masked_fill_(blocked, float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(Hk, G * g, T)
            out[:, :, lo:hi] = torch.bmm(probs, Vh).view(Hk, G, g, D)
        return out.permute(2, 0, 1, 3).reshape(-1, Hq * D).to(q.dtype)


@dataclass
class Linker:
    """Worker-side linker over one vLLM model (attached once, after the KV caches exist)."""

    model: torch.nn.Module
    kv_caches: dict[str, torch.Tensor]
    layout: KVLayout
    rotator: KeyRotator
    block_size: int
    layers: list[torch.nn.Module] = field(init=False)
    attn: list[tuple[torch.nn.Module, str, torch.nn.Module]] = field(init=False)

    def __post_init__(self) -> None:
        self.layers = vllm_api.decoder_layers(self.model)
        self.attn = [vllm_api.find_attention(layer) for layer in self.layers]
        self._embed = vllm_api.embed_fn(self.model)

    def _workspace(self, numel: int, device) -> torch.Tensor:
        ws = getattr(self, "_ws", None)
        if ws is None or ws.numel() < numel or ws.device != torch.device(device):
            self._ws = ws = torch.empty(numel, dtype=torch.float32, device=device)
        return ws[:numel]

    def cache_of(self, li: int) -> torch.Tensor:
        return self.kv_caches[self.attn[li][2].layer_name]

    @torch.inference_mode()
    def link(self, job: LinkJob, block_ids: list[int], start: int, end: int) -> None:
        """Fill positions [start, end) of the request's paged KV in every layer."""
        device = self.cache_of(0).device
        T = len(job.token_ids)
        assert end <= T, (end, T)
        R = job.initial_recompute().to(device)
        cached, candidate = (m.to(device) for m in job.masks())
        h = self._embed(torch.tensor(job.token_ids, device=device)[R])
        residual = None
        first = self.attn[0][2]
        Hk, D = first.num_kv_heads, first.head_size
        # Cached KV for every layer at once, keys rotated to their linked positions (fp32).
        # A persistent workspace, not fresh tensors: first-touch page faults on ~200 MB per request were
        # ~40% of a link. Left uninitialised: every position outside the spans is in R and is written
        # by the shim before any read.
        shape = (len(self.layers), Hk, T, D)
        ws = self._workspace(2 * shape[0] * Hk * T * D, device)
        Kall, Vall = ws.view(2, *shape).unbind(0)  # [L, Hkv, T, D] each
        assert bool((cached | torch.isin(torch.arange(T, device=device), R)).all()), "uncached token not recomputed"
        for s in job.spans:
            n = s.kv.num_tokens
            rk = self.rotator.rotate(s.kv.k.to(device), s.start - s.kv.base_pos)  # [L, n, Hkv, D]
            Kall[:, :, s.start : s.start + n] = rk.transpose(1, 2)
            Vall[:, :, s.start : s.start + n] = s.kv.v.to(device).transpose(1, 2)
        blend = job.policy.kind == "cacheblend"
        plan = self.layout.attention_plan(self.cache_of(0), block_ids, R, start, end, first) if len(R) else None
        for li, layer in enumerate(self.layers):
            K, V = Kall[li], Vall[li]  # views: [Hkv, T, D]
            cache, layer_plan = self.cache_of(li), plan
            if layer_plan is not None:  # cached KV into the pages first: the kernel reads it from there
                self.layout.write_range(
                    cache, block_ids, start, end, K[:, start:end].transpose(0, 1), V[:, start:end].transpose(0, 1)
                )
            if len(R):
                parent, attr, real = self.attn[li]
                shim = _LinkAttention(
                    real,
                    K,
                    V,
                    R,
                    keep_old=blend and li == CHECK_LAYER,
                    paged=None if layer_plan is None else (self.layout, layer_plan, cache),
                )
                setattr(parent, attr, shim)
                try:
                    h, residual = vllm_api.decoder_layer_forward(layer, R, h, residual)
                finally:
                    setattr(parent, attr, real)
                if blend and li == CHECK_LAYER:
                    h, residual, R = self._blend_select(job.policy, R, cached, candidate, K, shim.old_k, h, residual)
                    plan = self.layout.attention_plan(cache, block_ids, R, start, end, first)
            if layer_plan is None:  # attention ran over the buffers: they hold the layer's final K/V
                self.layout.write_range(
                    cache, block_ids, start, end, K[:, start:end].transpose(0, 1), V[:, start:end].transpose(0, 1)
                )
        job.recomputed = int(len(R))

    @staticmethod
    def _blend_select(policy: Policy, R, cached, candidate, K, old_k, h, residual):
        """CacheBlend token selection at the check layer (R covers every position here): keep every
        uncached token and the top `ratio` of candidate chunk tokens by key deviation."""
        dev = (K[:, R].transpose(0, 1) - old_k).float().pow(2).sum(dim=(1, 2))  # [nR]
        is_cand = candidate[R]
        n_keep = int(round(policy.ratio * int(is_cand.sum())))
        keep = ~cached[R]
        if n_keep > 0:
            scores = torch.where(is_cand, dev, torch.full_like(dev, -1.0))
            keep[torch.topk(scores, n_keep).indices] = True
        idx = torch.nonzero(keep).flatten()
        return h[idx], (residual[idx] if residual is not None else None), R[idx]

    @torch.inference_mode()
    def capture(
        self, block_ids: list[int], start: int, end: int, k_out: torch.Tensor, v_out: torch.Tensor, at: int
    ) -> None:
        """Copy positions [start, end) of a request's paged KV into k_out/v_out: [L, T, Hkv, D] from index at."""
        n = end - start
        for li in range(len(self.layers)):  # straight into the chunk's buffers: [n, Hkv, D] per layer
            self.layout.read_range_into(
                self.cache_of(li), block_ids, start, end, k_out[li, at : at + n], v_out[li, at : at + n]
            )
