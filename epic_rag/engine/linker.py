"""LegoLink linker: assemble requests' KV from compiled chunks and recompute a few tokens.

Runs on the worker, inside vLLM's steps. The requests that link together are linked in one batched pass
(`Linker.begin`), layer by layer (`Linker.advance`: all layers at once, or a few each step, see connector.py).
Per request and layer it fills a K/V buffer for positions [0, T) with every linked chunk's cached KV, keys
rotated to their real positions; then it runs the model's own decoder layer ONCE on the recompute sets R of
all the pass's requests, packed one after another, with the attention module swapped for `_LinkAttention`
(architecture details stay in vLLM's model code; the swap is undone before the step's forward runs). The shim
splits the packed rows back per request: a request on the kernel path has R's fresh K/V written into its
pages (already holding the layer's cached KV) and attends with the backend's own kernel (one kernel call for
every such request of the pass); a request where the layout offers no kernel path attends over its own
buffer with a position-causal mask, the buffer being written into its pages after the layer.

Recompute sets (R always holds every token without a cache: template glue, system prompt):
- naive: nothing else;  legolink-k: the first k tokens of each chunk's span (its sink token first where
  the policy keeps it, see policy.py);  legolink-0: nothing else;
- cacheblend-r: every token through layers 0..CHECK_LAYER; at CHECK_LAYER the chunk tokens whose
  *keys* deviate most from the cache (L2 over heads and dims, after re-rotation: LMCache's rule)
  are kept, the top r fraction, and only they (plus uncached tokens) are recomputed in later layers.
  The selection is made per request, then the batch is re-packed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..policy import Policy
from . import vllm_api
from .jobs import LinkJob
from .layout import KVLayout
from .rope import KeyRotator

log = logging.getLogger(__name__)

CHECK_LAYER = 1  # CacheBlend selects its tokens from the deviation at this layer
ATTN_BUCKET = 256  # recompute queries are grouped by position // ATTN_BUCKET for the sparse attention
WORKSPACE_PROMPTS = 2  # the workspace's default size, in whole prompts of max_model_len tokens


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A chunk's KV on the linker's device. To a GPU: from page-locked host memory, asynchronously (the copy
    overlaps the rotation and recompute queued behind it on the stream; a pageable tensor is first copied
    into torch's caching pinned-memory pool, which keeps the block until the copy is done)."""
    if t.device == device:
        return t
    if device.type == "cuda":
        return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
    return t.to(device)


@dataclass(slots=True)
class LinkLoad:
    """One request to link: its job and the positions [start, end) of its paged KV to fill."""

    job: LinkJob
    block_ids: list[int]
    start: int
    end: int


@dataclass(eq=False, slots=True)
class _Seq:
    """One request's state during a batched link."""

    load: LinkLoad
    R: torch.Tensor  # [nR] int64, sorted: positions recomputed from the current layer on
    cached: torch.Tensor  # [T] bool: positions with chunk KV
    candidate: torch.Tensor  # [T] bool: positions CacheBlend may pick
    K: torch.Tensor | None = None  # [L, Hkv, T, D] (head-major, the cache's dtype), a view into the workspace
    V: torch.Tensor | None = None  # [L, Hkv, T, D]
    slots: torch.Tensor | None = None  # [end - start] int64 on the cache's device: the pages' slots of [start, end)
    paged: bool = False  # attends with the kernel (from the current layer on)
    old_k: torch.Tensor | None = None  # [nR, Hkv, D] cached keys at R, kept by the shim at CHECK_LAYER

    @property
    def blend(self) -> bool:
        return self.load.job.policy.kind == "cacheblend"


@dataclass(eq=False)
class LinkPass:
    """A batched link under way (Linker.begin, then advance until done): its requests, the next layer to run
    and what is carried to it. Its requests' K/V live in the linker's workspace."""

    seqs: list[_Seq]
    device: torch.device
    h: torch.Tensor  # [n, hidden]: the packed rows of every request's R entering `layer`
    residual: torch.Tensor | None
    plan: object | None  # the kernel plan of the requests with s.paged (None: none)
    layer: int = 0  # the next layer to run


class _LinkAttention(torch.nn.Module):
    """Stands in for vLLM's Attention during the sparse forward of one layer over a packed batch.

    Gets post-RoPE q, k, v of the concatenated recompute sets (request after request, in `seqs` order)
    and attends each request's queries over its own positions <= theirs: buffer requests over their K/V
    buffers (R's fresh K/V stored there first), kernel requests over their pages with one kernel call.
    """

    def __init__(
        self,
        real: torch.nn.Module,
        li: int,
        seqs: list[_Seq],
        keep_old: bool = False,
        paged: tuple[KVLayout, object, torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.real, self.li, self.seqs = real, li, seqs
        self.keep_old = keep_old  # CacheBlend compares fresh keys with the cached ones (its requests only)
        self.num_heads, self.num_kv_heads = real.num_heads, real.num_kv_heads
        self.head_size, self.scale = real.head_size, real.impl.scale
        self.paged = paged  # (layout, plan, cache): the plan covers the requests with s.paged, in order

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        kh, vh = k.view(-1, Hk, D), v.view(-1, Hk, D)  # [n, Hkv, D], n = sum of the requests' nR
        out = torch.empty((q.shape[0], Hq * D), dtype=q.dtype, device=q.device)  # [n, Hq*D]
        kernel_rows: list[torch.Tensor] = []
        off = 0
        for s in self.seqs:
            R, n = s.R, len(s.R)
            rows = slice(off, off + n)
            off += n
            if n == 0:
                continue
            K, V = s.K[self.li], s.V[self.li]  # [Hkv, T, D]
            if self.keep_old and s.blend:
                s.old_k = K[:, R].transpose(0, 1).clone()  # [nR, Hkv, D]
            if s.paged:
                # The pages already hold every cached position of this layer; R's fresh K/V go in with the
                # kernel call below. CacheBlend reads its deviation from the buffer: fresh keys go there too.
                if self.keep_old and s.blend:
                    K[:, R] = kh[rows].transpose(0, 1).to(K.dtype)
                kernel_rows.append(torch.arange(rows.start, rows.stop, device=q.device))
                continue
            K[:, R] = kh[rows].transpose(0, 1).to(K.dtype)
            V[:, R] = vh[rows].transpose(0, 1).to(V.dtype)
            out[rows] = self._attend_buffers(q[rows], K, V, R)
        if kernel_rows:
            # One kernel call for every kernel request (3x faster than the batched matmuls, measured); the
            # plan's runs follow the packing of exactly these rows.
            layout, plan, cache = self.paged
            if sum(len(r) for r in kernel_rows) == q.shape[0]:  # all of them: no gather needed
                out = layout.attend(plan, self.real, cache, q, k, v).to(q.dtype)
            else:
                idx = torch.cat(kernel_rows)  # [nk]
                out[idx] = layout.attend(plan, self.real, cache, q[idx], k[idx], v[idx]).to(q.dtype)
        return out

    def _attend_buffers(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
        """One request's queries at positions R over its buffers.  # q: [nR, Hq*D], K, V: [Hkv, T, D] -> [nR, Hq*D]"""
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
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
            Kh, Vh = K[:, :T].float(), V[:, :T].float()  # [Hkv, T, D] (a copy only where the cache is 16-bit)
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
    # Prompt tokens one recompute pass may hold (summed over its requests): the K/V workspace is allocated
    # for this many once, at attach, and a step's links beyond it run in several passes.
    workspace_tokens: int
    # Tensor parallelism: sums a tensor over the ranks (CacheBlend's key deviation is summed over every rank's
    # heads before its picks, so all ranks recompute the same tokens); None on one rank.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # requests per batched recompute pass -> passes run (bounded: at most max_num_seqs sizes)
    batch_sizes: Counter = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        self.layers = vllm_api.decoder_layers(self.model)
        self.attn = [vllm_api.find_attention(layer) for layer in self.layers]
        self._embed = vllm_api.embed_fn(self.model)
        first, cache = self.attn[0][2], self.cache_of(0)
        self._token_numel = 2 * len(self.layers) * first.num_kv_heads * first.head_size  # K and V, every layer
        # One workspace for the linker's life, in the cache's dtype (what the pages hold), allocated now and
        # never grown: its size is known at start-up (workspace_bytes; on a GPU counted in the memory vLLM is
        # given, vllm_api.gpu_memory_share), and first-touch page faults on fresh buffers were ~40% of a link.
        self._ws = torch.empty(self.workspace_tokens * self._token_numel, dtype=cache.dtype, device=cache.device)

    @property
    def workspace_nbytes(self) -> int:
        return self._ws.numel() * self._ws.element_size()

    @staticmethod
    def workspace_bytes(tokens: int, num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
        """Bytes of the K/V workspace for `tokens` prompt tokens of a model of that shape."""
        return 2 * num_layers * num_kv_heads * head_size * dtype_bytes * tokens

    def cache_of(self, li: int) -> torch.Tensor:
        return self.kv_caches[self.attn[li][2].layer_name]

    def link_many(self, loads: list[LinkLoad]) -> None:
        """Link every load to the end: pass after pass (begin, then advance without a deadline)."""
        while loads:
            p, loads = self.begin(loads)
            if p is not None:
                self.advance(p)

    @torch.inference_mode()
    def begin(self, loads: list[LinkLoad]) -> tuple[LinkPass | None, list[LinkLoad]]:
        """Start one batched pass with the first of `loads` that fit the workspace together. A request whose
        own data is invalid is failed alone here (job.error) and left out. Returns the pass (None when every
        load taken failed its checks) and the loads left for later passes (the tail of `loads`). One pass at a
        time: its K/V live in the workspace until it is done."""
        device = self.cache_of(0).device
        seqs: list[_Seq] = []
        used = 0
        for i, load in enumerate(loads):
            T = len(load.job.token_ids)
            if seqs and used + T > self.workspace_tokens:
                return self._start(seqs, device), loads[i:]
            try:
                seqs.append(self._check(load, device))
                used += T
            except Exception as e:
                self._fail(load.job, e)
        return (self._start(seqs, device) if seqs else None), []

    @torch.inference_mode()
    def advance(self, p: LinkPass, deadline: float | None = None) -> bool:
        """Run the pass's next decoder layers, all of them, or until `deadline` (time.perf_counter(); at least
        one layer a call). True once every layer has run: its requests' pages are then filled. An exception
        leaves the pages of every request of the pass unfilled or partly filled: the caller fails them all.
        On a GPU the deadline counts host time (the kernels queued), not the device's."""
        while p.layer < len(self.layers):
            self._layer(p, p.layer)
            p.layer += 1
            if deadline is not None and time.perf_counter() >= deadline:
                break
        if p.layer < len(self.layers):
            return False
        for s in p.seqs:
            s.load.job.recomputed = int(len(s.R))
        return True

    @staticmethod
    def _fail(job: LinkJob, e: Exception) -> None:
        log.error("a link failed before its batch ran: %s: %s", type(e).__name__, e, exc_info=e)
        job.error = f"{type(e).__name__}: {e}"

    def _check(self, load: LinkLoad, device) -> _Seq:
        """One request's recompute set and masks, checked against its own data (its spans too: a pass fills
        them layer by layer, when a failure would take the whole pass down)."""
        job = load.job
        T = len(job.token_ids)
        assert 0 <= load.start <= load.end <= T, (load.start, load.end, T)
        assert len(load.block_ids) * self.block_size >= load.end, (len(load.block_ids), load.end)
        if T > self.workspace_tokens:
            raise ValueError(f"a link of {T} tokens exceeds the linker's workspace of {self.workspace_tokens} tokens")
        first = self.attn[0][2]
        for sp in job.spans:
            n = sp.kv.num_tokens
            want = (len(self.layers), n, first.num_kv_heads, first.head_size)  # [L, n, Hkv, D]
            if tuple(sp.kv.k.shape) != want or tuple(sp.kv.v.shape) != want:
                raise ValueError(f"span at {sp.start}: K/V of shape {tuple(sp.kv.k.shape)}, expected {want}")
            if not 0 <= sp.start <= sp.start + n <= T:
                raise ValueError(f"span [{sp.start}, {sp.start + n}) outside the prompt's {T} tokens")
            self.rotator.check_shift(sp.start - sp.kv.base_pos)
        R = job.initial_recompute().to(device)  # [nR]
        cached, candidate = (m.to(device) for m in job.masks())  # [T] each
        assert bool((cached | torch.isin(torch.arange(T, device=device), R)).all()), "uncached token not recomputed"
        return _Seq(load, R, cached, candidate)

    def _start(self, seqs: list[_Seq], device) -> LinkPass:
        """A pass over `seqs`: their K/V buffers carved from the workspace (left uninitialised: every position
        outside the spans is in R and is written by the shim before any read), the packed rows embedded."""
        first = self.attn[0][2]
        L, Hk, D = len(self.layers), first.num_kv_heads, first.head_size
        off = 0
        for s in seqs:
            n = len(s.load.job.token_ids) * self._token_numel
            s.K, s.V = self._ws[off : off + n].view(2, L, Hk, -1, D).unbind(0)  # [L, Hkv, T, D] each
            off += n
        self.batch_sizes[len(seqs)] += 1
        ids = torch.cat([torch.tensor(s.load.job.token_ids, device=device)[s.R] for s in seqs])  # [n]
        return LinkPass(seqs, device, self._embed(ids), None, self._plan(seqs, self.cache_of(0)))

    def _fill(self, s: _Seq, li: int, device) -> None:
        """Layer li of the request's buffers: every span's cached KV, keys rotated to where the span sits."""
        for sp in s.load.job.spans:
            n = sp.kv.num_tokens
            rk = self.rotator.rotate(to_device(sp.kv.k[li], device), sp.start - sp.kv.base_pos)  # [n, Hkv, D]
            s.K[li, :, sp.start : sp.start + n] = rk.transpose(0, 1)
            s.V[li, :, sp.start : sp.start + n] = to_device(sp.kv.v[li], device).transpose(0, 1)

    def _plan(self, seqs: list[_Seq], cache: torch.Tensor) -> object | None:
        """Mark which requests attend with the kernel from here on, and one plan for all of them (None: none)."""
        first = self.attn[0][2]
        for s in seqs:
            s.paged = self.layout.can_attend(s.R, s.load.start, s.load.end)
            if s.slots is None:  # once per request: the per-layer page writes then copy nothing to the device
                s.slots = self.layout.range_slots(cache, s.load.block_ids, s.load.start, s.load.end)
        kern = [(s.load.block_ids, s.R) for s in seqs if s.paged]
        return self.layout.attention_plan(cache, kern, first) if kern else None

    def _layer(self, p: LinkPass, li: int) -> None:
        """Layer li of the pass: its cached KV into the buffers, the decoder layer once over every request's R
        (packed in `seqs` order), the layer's K/V into the pages."""
        seqs, cache = p.seqs, self.cache_of(li)
        for s in seqs:
            self._fill(s, li, p.device)
        paged = [s.paged for s in seqs]  # this layer's paths (CacheBlend may change them for the next)
        for s, on in zip(seqs, paged):
            if on:  # cached KV into the pages first: the kernel reads it from there
                self._write_pages(s, li, cache)
        blend_here = li == CHECK_LAYER and any(s.blend for s in seqs)
        if len(p.h):
            parent, attr, real = self.attn[li]
            shim = _LinkAttention(
                real, li, seqs, keep_old=blend_here, paged=None if p.plan is None else (self.layout, p.plan, cache)
            )
            setattr(parent, attr, shim)  # the step's forward never sees it: restored before returning
            try:
                positions = torch.cat([s.R for s in seqs])  # [n]
                p.h, p.residual = vllm_api.decoder_layer_forward(self.layers[li], positions, p.h, p.residual)
            finally:
                setattr(parent, attr, real)
            if blend_here:
                p.h, p.residual = self._blend_select(seqs, li, p.h, p.residual, self.reduce)
                p.plan = self._plan(seqs, cache)
        for s, on in zip(seqs, paged):
            if not on:  # attention ran over the buffers: they hold the layer's final K/V
                self._write_pages(s, li, cache)

    def _write_pages(self, s: _Seq, li: int, cache: torch.Tensor) -> None:
        """The request's buffered K/V of layer li at [start, end) into its pages."""
        a, b = s.load.start, s.load.end
        K, V = s.K[li], s.V[li]  # [Hkv, T, D]
        self.layout.write_range(
            cache, s.load.block_ids, a, b, K[:, a:b].transpose(0, 1), V[:, a:b].transpose(0, 1), slots=s.slots
        )

    @staticmethod
    def _blend_select(seqs: list[_Seq], li: int, h, residual, reduce=None):
        """CacheBlend token selection at the check layer, request by request (R covers every position of a
        blend request here), then the packed rows re-packed: the other requests keep all theirs."""
        keep, off = [], 0
        for s in seqs:
            n = len(s.R)
            if s.blend and n:
                idx = Linker._blend_keep(s.load.job.policy, s.R, s.cached, s.candidate, s.K[li], s.old_k, reduce)
                s.R, s.old_k = s.R[idx], None
                keep.append(idx + off)
            else:
                keep.append(torch.arange(off, off + n, device=h.device))
            off += n
        idx = torch.cat(keep)  # [n'] rows kept, still in request order
        return h[idx], (residual[idx] if residual is not None else None)

    @staticmethod
    def _blend_keep(policy: Policy, R, cached, candidate, K, old_k, reduce=None) -> torch.Tensor:
        """One request's kept rows (indices into R): every uncached token and the top `ratio` of candidate
        chunk tokens by key deviation.  # K: [Hkv, T, D], old_k: [nR, Hkv, D] -> [n'] int64"""
        dev = (K[:, R].transpose(0, 1) - old_k).float().pow(2).sum(dim=(1, 2))  # [nR]
        if reduce is not None:  # summed over every rank's heads
            dev = reduce(dev)
        is_cand = candidate[R]
        n_keep = int(round(policy.ratio * int(is_cand.sum())))
        keep = ~cached[R]
        if n_keep > 0:
            scores = torch.where(is_cand, dev, torch.full_like(dev, -1.0))
            keep[torch.topk(scores, n_keep).indices] = True
        return torch.nonzero(keep).flatten()

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
