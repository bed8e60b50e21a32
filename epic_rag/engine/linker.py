"""LegoLink linker: assemble requests' KV from compiled chunks and recompute a few tokens.

Runs on the worker, inside vLLM's steps. The requests that link together are linked in one batched pass
(`Linker.begin`: host work only, no device synchronisation), layer by layer (`Linker.advance`: all layers at
once, or a few each step, see connector.py). A request links over the positions it owns, [start, end): below
`start` its pages already hold vLLM's own KV (a prefix-cache hit), which is neither refilled nor recomputed.

Kernel path (every request on a GPU; on a CPU, those whose recompute set has few runs): the pass's cached
chunk KV goes straight into the pages, keys rotated to their linked positions (stage.py: one fused kernel per
group of layers on a GPU, a token-major staging buffer and vLLM's own cache-write op on a CPU); then the
model's own decoder layer runs ONCE on the recompute sets R of all the pass's requests, packed one after
another, with the attention module swapped for `_LinkAttention` (architecture details stay in vLLM's model
code; the swap is undone before the step's forward runs), which writes R's fresh K/V into the pages and
attends with the backend's own kernel, one call for the whole pass. Buffer path (CPU layouts only, where the
kernel would re-read the prefix once per run): the request's K/V buffer for positions [0, T) is filled (chunk
KV rotated; below `start`, the pages' KV), it attends over its buffer with a position-causal mask, and the
buffer is written into its pages after the layer.

Recompute sets (R always holds every token without a cache: template glue, system prompt):
- naive: nothing else;  legolink-k: the first k tokens of each chunk's span (its sink token first where
  the policy keeps it, see policy.py);  legolink-0: nothing else;
- cacheblend-r: every token through layers 0..CHECK_LAYER; at CHECK_LAYER the chunk tokens whose
  *keys* deviate most from the cache (L2 over heads and dims, after re-rotation: LMCache's rule)
  are kept, the top r fraction, and only they (plus uncached tokens) are recomputed in later layers.
  The selection is made per request, then the batch is re-packed (the one place a pass reads device values
  on the host: the picks decide the kernel plan).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..policy import Policy
from . import vllm_api
from .jobs import LinkJob
from .layout import KVLayout, host_to_device, slots_for
from .rope import KeyRotator
from .stage import FillPlan, make_filler

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
    R: torch.Tensor  # [nR] int64 on the host, sorted, >= load.start: positions recomputed from the current layer on
    cached: torch.Tensor  # [T] bool (host): positions with chunk KV
    candidate: torch.Tensor  # [T] bool (host): positions CacheBlend may pick
    K: torch.Tensor | None = None  # [L, Hkv, T, D] (head-major, the cache's dtype): buffer path, a workspace view
    V: torch.Tensor | None = None  # [L, Hkv, T, D]
    slots: torch.Tensor | None = None  # [end - start] int64 on the cache's device: buffer path's page writes
    paged: bool = False  # attends with the kernel (from the current layer on)
    dev: torch.Tensor | None = None  # [nR] CacheBlend's key deviation at CHECK_LAYER (on the device)

    @property
    def blend(self) -> bool:
        return self.load.job.policy.kind == "cacheblend"


@dataclass(eq=False)
class LinkPass:
    """A batched link under way (Linker.begin, then advance until done): its requests, the next layer to run
    and what is carried to it. Buffer-path requests' K/V live in the linker's workspace."""

    seqs: list[_Seq]
    device: torch.device
    h: torch.Tensor  # [n, hidden]: the packed rows of every request's R entering `layer`
    residual: torch.Tensor | None
    fill: object  # the filler's state for this pass (stage.py)
    positions: torch.Tensor | None = None  # [n] on the device: the packed rows' positions
    plan: object | None = None  # the kernel plan of the requests with s.paged (None: none attends)
    kernel_rows: torch.Tensor | None = None  # [nk] on the device: the packed rows of those requests (None: all)
    layer: int = 0  # the next layer to run


class _LinkAttention(torch.nn.Module):
    """Stands in for vLLM's Attention during the sparse forward of one layer over a packed batch.

    Gets post-RoPE q, k, v of the concatenated recompute sets (request after request, in `seqs` order)
    and attends each request's queries over its own positions <= theirs: kernel requests over their pages
    (R's fresh K/V written there by the kernel call, one for all of them), buffer requests over their K/V
    buffers (R's fresh K/V stored there first). At CacheBlend's check layer it also measures, per blend
    request, how far the fresh keys at R are from the cached ones.
    """

    def __init__(self, linker: Linker, li: int, p: LinkPass, blend_check: bool = False) -> None:
        super().__init__()
        self.real = linker.attn[li][2]
        self.linker, self.li, self.p, self.blend_check = linker, li, p, blend_check
        self.num_heads, self.num_kv_heads = self.real.num_heads, self.real.num_kv_heads
        self.head_size, self.scale = self.real.head_size, self.real.impl.scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        linker, p, cache = self.linker, self.p, self.linker.cache_of(self.li)
        kh, vh = k.view(-1, Hk, D), v.view(-1, Hk, D)  # [n, Hkv, D], n = sum of the requests' nR
        out = None if p.plan is not None and p.kernel_rows is None else q.new_empty((q.shape[0], Hq * D))
        off = 0
        for s in p.seqs:
            R, n = s.R, len(s.R)
            rows = slice(off, off + n)
            off += n
            if n == 0:
                continue
            if self.blend_check and s.blend:  # cached keys at R (pages or buffer), before the fresh ones land
                if s.paged:
                    old = linker.layout.read(cache, linker.slots_of(s, R))[0]  # [nR, Hkv, D]
                else:
                    old = s.K[self.li][:, R].transpose(0, 1)
                s.dev = (kh[rows].to(cache.dtype) - old).float().pow(2).sum(dim=(1, 2))  # [nR]
            if s.paged:
                continue
            K, V = s.K[self.li], s.V[self.li]  # [Hkv, T, D]
            K[:, R] = kh[rows].transpose(0, 1).to(K.dtype)
            V[:, R] = vh[rows].transpose(0, 1).to(V.dtype)
            out[rows] = self._attend_buffers(q[rows], K, V, R)
        if p.plan is not None:
            # One kernel call for every kernel request (3x faster than the batched matmuls, measured); the
            # plan's runs follow the packing of exactly these rows.
            if p.kernel_rows is None:  # all of them: no gather needed
                out = linker.layout.attend(p.plan, self.real, cache, q, k, v).to(q.dtype)
            else:
                idx = p.kernel_rows
                out[idx] = linker.layout.attend(p.plan, self.real, cache, q[idx], k[idx], v[idx]).to(q.dtype)
        return out

    def _attend_buffers(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
        """One request's queries at positions R over its buffers.  # q: [nR, Hq*D], K, V: [Hkv, T, D] -> [nR, Hq*D]"""
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        G = Hq // Hk
        qh = q.view(-1, Hk, G, D).permute(1, 2, 0, 3).float()  # [Hkv, G, nR, D]
        out = torch.empty_like(qh)
        # Queries grouped by position bucket: each group attends only up to its own last position, so
        # the cost follows the causal triangle instead of nR x T. Plain batched matmuls: on CPU, SDPA
        # with a mask and few queries was 3-10x slower (measured). R is on the host: no device reads.
        bucket = torch.div(R, ATTN_BUCKET, rounding_mode="floor")
        bounds = torch.nonzero(bucket[1:] != bucket[:-1]).flatten().add(1).tolist()
        T = int(R[-1]) + 1
        Kf, Vf = K[:, :T].float(), V[:, :T].float()  # [Hkv, T, D], once per layer (a copy where 16-bit)
        for lo, hi in zip([0] + bounds, bounds + [len(R)]):
            Rg = R[lo:hi]
            Tg = int(Rg[-1]) + 1
            g = hi - lo
            qg = qh[:, :, lo:hi].reshape(Hk, G * g, D)
            scores = torch.bmm(qg, Kf[:, :Tg].transpose(1, 2)).mul_(self.scale).view(Hk, G, g, Tg)
            # Keys before the group's first query are visible to all of it: mask only the tail.
            t0 = int(Rg[0])
            blocked = torch.arange(t0, Tg)[None, :] > Rg[:, None]  # [g, Tg - t0]
            scores[..., t0:].masked_fill_(blocked.to(scores.device), float("-inf"))
            probs = torch.softmax(scores, dim=-1).view(Hk, G * g, Tg)
            out[:, :, lo:hi] = torch.bmm(probs, Vf[:, :Tg]).view(Hk, G, g, D)
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
    # Prompt tokens one recompute pass may hold (summed over its requests): the buffer workspace (CPU layouts)
    # and the staging (GPU) are allocated for this many once, at attach; a step's links beyond it run in
    # several passes.
    workspace_tokens: int
    # Tensor parallelism: sums a tensor over the ranks (CacheBlend's key deviation is summed over every rank's
    # heads before its picks, so all ranks recompute the same tokens); None on one rank.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Tensor parallelism: ORs per-request failure flags over the ranks (a request failing its checks on any
    # rank is failed on all, so every rank's pass holds the same requests and their collectives stay in step).
    agree: Callable[[list[bool]], list[bool]] | None = None
    # The page filler: the fused kernel (True), the torch path (False), or chosen by the layout and device.
    fused: bool | None = None
    # requests per batched recompute pass -> passes run (bounded: at most max_num_seqs sizes)
    batch_sizes: Counter = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        self.layers = vllm_api.decoder_layers(self.model)
        self.attn = [vllm_api.find_attention(layer) for layer in self.layers]
        self._embed = vllm_api.embed_fn(self.model)
        first, cache = self.attn[0][2], self.cache_of(0)
        self._token_numel = 2 * len(self.layers) * first.num_kv_heads * first.head_size  # K and V, every layer
        # The buffer workspace, in the cache's dtype, for layouts whose kernel cannot take every request: its
        # size is known at start-up and it is allocated now, never grown (first-touch page faults on fresh
        # buffers were ~40% of a link). FlashAttention takes every request: no workspace.
        n = self.workspace_tokens * self._token_numel if self.layout.needs_buffers else 0
        self._ws = torch.empty(n, dtype=cache.dtype, device=cache.device)
        caches = [self.cache_of(li) for li in range(len(self.layers))]
        self.filler = make_filler(self.layout, self.rotator, caches, self.workspace_tokens, self.fused)

    @property
    def workspace_nbytes(self) -> int:
        return self._ws.numel() * self._ws.element_size()

    @staticmethod
    def workspace_bytes(tokens: int, num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
        """Bytes of the K/V buffer workspace for `tokens` prompt tokens of a model of that shape."""
        return 2 * num_layers * num_kv_heads * head_size * dtype_bytes * tokens

    def cache_of(self, li: int) -> torch.Tensor:
        return self.kv_caches[self.attn[li][2].layer_name]

    def slots_of(self, s: _Seq, positions: torch.Tensor) -> torch.Tensor:
        """Page slots of a request's positions, on the cache's device.  # positions: [n] (host) -> [n] int64"""
        return host_to_device(slots_for(s.load.block_ids, positions, self.block_size), self.cache_of(0).device)

    def link_many(self, loads: list[LinkLoad]) -> None:
        """Link every load to the end: pass after pass (begin, then advance without a budget)."""
        while loads:
            p, loads = self.begin(loads)
            if p is not None:
                self.advance(p)

    @torch.inference_mode()
    def begin(self, loads: list[LinkLoad]) -> tuple[LinkPass | None, list[LinkLoad]]:
        """Start one batched pass with the first of `loads` that fit the workspace together. A request whose
        own data is invalid is failed alone here (job.error) and left out. Returns the pass (None when every
        load taken failed its checks) and the loads left for later passes (the tail of `loads`). One pass at a
        time: its buffers and staging are the linker's until it is done. Host work and asynchronous copies
        only: nothing here waits for the device."""
        device = self.cache_of(0).device
        taken, used = 0, 0
        for load in loads:  # the same on every rank: it depends on the prompts' lengths alone
            T = len(load.job.token_ids)
            if taken and used + T > self.workspace_tokens:
                break
            taken, used = taken + 1, used + T
        checked: list[_Seq | Exception] = []
        for load in loads[:taken]:
            try:
                checked.append(self._check(load))
            except Exception as e:
                checked.append(e)
        failed = [isinstance(c, Exception) for c in checked]
        if self.agree is not None:
            failed = self.agree(failed)
        seqs: list[_Seq] = []
        for load, c, bad in zip(loads[:taken], checked, failed):
            if not bad:
                seqs.append(c)
            else:
                self._fail(load.job, c if isinstance(c, Exception) else RuntimeError("it failed on another rank"))
        return (self._start(seqs, device) if seqs else None), loads[taken:]

    @torch.inference_mode()
    def advance(self, p: LinkPass, more: Callable[[], bool] | None = None) -> bool:
        """Run the pass's next decoder layers, all of them, or while `more()` (asked after each layer) says so
        (at least one layer a call). True once every layer has run: its requests' pages are then filled (on a
        GPU: the work is queued on the current stream, ahead of the next forward). An exception leaves the
        pages of every request of the pass unfilled or partly filled: the caller fails them all."""
        while p.layer < len(self.layers):
            self._layer(p, p.layer)
            p.layer += 1
            if more is not None and not more():
                break
        if p.layer < len(self.layers):
            return False
        for s in p.seqs:
            s.load.job.recomputed = len(s.R)
        return True

    @staticmethod
    def _fail(job: LinkJob, e: Exception) -> None:
        log.error("a link failed before its batch ran: %s: %s", type(e).__name__, e, exc_info=e)
        job.error = f"{type(e).__name__}: {e}"

    def _check(self, load: LinkLoad) -> _Seq:
        """One request's recompute set and masks (host tensors), checked against its own data (its spans too:
        a pass fills them layer by layer, when a failure would take the whole pass down)."""
        job = load.job
        T = len(job.token_ids)
        assert 0 <= load.start <= load.end <= T, (load.start, load.end, T)
        assert len(load.block_ids) * self.block_size >= load.end, (len(load.block_ids), load.end)
        if T > self.workspace_tokens:
            raise ValueError(f"a link of {T} tokens exceeds the linker's workspace of {self.workspace_tokens} tokens")
        first, dtype = self.attn[0][2], self.cache_of(0).dtype
        for sp in job.spans:
            n = sp.kv.num_tokens
            want = (len(self.layers), n, first.num_kv_heads, first.head_size)  # [L, n, Hkv, D]
            if tuple(sp.kv.k.shape) != want or tuple(sp.kv.v.shape) != want:
                raise ValueError(f"span at {sp.start}: K/V of shape {tuple(sp.kv.k.shape)}, expected {want}")
            if sp.kv.k.dtype != dtype:
                raise ValueError(f"span at {sp.start}: K/V in {sp.kv.k.dtype}, the cache holds {dtype}")
            if not 0 <= sp.start <= sp.start + n <= T:
                raise ValueError(f"span [{sp.start}, {sp.start + n}) outside the prompt's {T} tokens")
            self.rotator.check_shift(sp.start - sp.kv.base_pos)
        # Positions below start hold vLLM's own KV already (a prefix-cache hit): never recomputed or written.
        R = job.initial_recompute()  # [nR]
        R = R[R >= load.start]
        cached, candidate = job.masks()  # [T] each
        need = ~cached
        need[: load.start] = False
        need[R] = False
        assert not bool(need.any()), "uncached token not recomputed"
        return _Seq(load, R, cached, candidate)

    def _start(self, seqs: list[_Seq], device) -> LinkPass:
        """A pass over `seqs`: the kernel requests' page fills planned (stage.py), the buffer requests' buffers
        carved from the workspace (left uninitialised: every position outside the spans and below `start` is in
        R and is written by the shim before any read), the packed rows embedded."""
        first = self.attn[0][2]
        L, Hk, D = len(self.layers), first.num_kv_heads, first.head_size
        for s in seqs:
            s.paged = self.layout.can_attend(s.R, s.load.start, s.load.end) or len(s.R) == 0
        if self.layout.needs_buffers:  # every request: CacheBlend's picks may move one onto buffers later
            off = 0
            for s in seqs:
                n = len(s.load.job.token_ids) * self._token_numel
                s.K, s.V = self._ws[off : off + n].view(2, L, Hk, -1, D).unbind(0)  # [L, Hkv, T, D] each
                off += n
        elif not all(s.paged for s in seqs):
            raise RuntimeError(f"layout {self.layout.name} has no buffer path and its kernel refused a request")
        self.batch_sizes[len(seqs)] += 1
        fill = FillPlan()
        for s in seqs:
            if s.paged:
                self._plan_fill(fill, s)
        ids = torch.cat([torch.tensor(s.load.job.token_ids)[s.R] for s in seqs])  # [n] (host)
        p = LinkPass(seqs, device, self._embed(host_to_device(ids, device)), None, self.filler.begin(fill))
        self._plan(p)
        return p

    def _plan_fill(self, fill: FillPlan, s: _Seq) -> None:
        """The request's span rows inside [start, end) into the pass's fill plan."""
        a0, b0 = s.load.start, s.load.end
        for sp in s.load.job.spans:
            a, b = max(sp.start, a0), min(sp.start + sp.kv.num_tokens, b0)
            if a < b:
                kv = sp.kv.slice(a - sp.start, b - sp.start)
                fill.add(kv.k, kv.v, a - kv.base_pos, slots_for(s.load.block_ids, torch.arange(a, b), self.block_size))

    def _fill(self, s: _Seq, li: int, device) -> None:
        """Layer li of a buffer request's buffers: every span's cached KV inside [start, T), keys rotated to where
        the span sits; below start, the pages' own KV."""
        a0 = s.load.start
        if a0 > 0:
            K, V = s.K[li], s.V[li]  # [Hkv, T, D]
            self.layout.read_range_into(
                self.cache_of(li), s.load.block_ids, 0, a0, K[:, :a0].transpose(0, 1), V[:, :a0].transpose(0, 1)
            )
        for sp in s.load.job.spans:
            a = max(sp.start, a0)
            b = sp.start + sp.kv.num_tokens
            if a >= b:
                continue
            kv = sp.kv.slice(a - sp.start)
            rk = self.rotator.rotate(to_device(kv.k[li], device), a - kv.base_pos)  # [n, Hkv, D]
            s.K[li, :, a:b] = rk.transpose(0, 1)
            s.V[li, :, a:b] = to_device(kv.v[li], device).transpose(0, 1)

    def _plan(self, p: LinkPass) -> None:
        """Which requests attend with the kernel from here on, one plan for all of them, and the positions of
        the packed rows (host work, then asynchronous copies)."""
        cache = self.cache_of(0)
        for s in p.seqs:
            if s.paged and len(s.R) and not self.layout.can_attend(s.R, s.load.start, s.load.end):
                s.paged = False  # CacheBlend's picks: too many runs for this layout's kernel
            if not s.paged and s.slots is None:  # once per request: the per-layer page writes copy nothing
                s.slots = self.layout.range_slots(cache, s.load.block_ids, s.load.start, s.load.end)
        kern = [(s.load.block_ids, s.R) for s in p.seqs if s.paged and len(s.R)]
        p.plan = self.layout.attention_plan(cache, kern, self.attn[0][2]) if kern else None
        p.positions = host_to_device(torch.cat([s.R for s in p.seqs]), p.device)  # [n]
        p.kernel_rows = None
        if p.plan is not None and len(kern) < sum(1 for s in p.seqs if len(s.R)):
            rows, off = [], 0
            for s in p.seqs:
                if s.paged:
                    rows.append(torch.arange(off, off + len(s.R)))
                off += len(s.R)
            p.kernel_rows = host_to_device(torch.cat(rows), p.device)

    def _layer(self, p: LinkPass, li: int) -> None:
        """Layer li of the pass: its cached KV into the pages (kernel requests) or buffers (buffer requests), the
        decoder layer once over every request's R (packed in `seqs` order), buffers into the pages."""
        seqs, cache = p.seqs, self.cache_of(li)
        self.filler.layer(p.fill, li)
        for s in seqs:
            if not s.paged:
                self._fill(s, li, p.device)
        paged = [s.paged for s in seqs]  # this layer's paths (CacheBlend may change them for the next)
        blend_here = li == CHECK_LAYER and any(s.blend for s in seqs)
        if len(p.h):
            parent, attr, real = self.attn[li]
            setattr(parent, attr, _LinkAttention(self, li, p, blend_here))  # restored before returning
            try:
                p.h, p.residual = vllm_api.decoder_layer_forward(self.layers[li], p.positions, p.h, p.residual)
            finally:
                setattr(parent, attr, real)
            if blend_here:
                p.h, p.residual = self._blend_select(seqs, p.h, p.residual, self.reduce)
                self._plan(p)
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
    def _blend_select(seqs: list[_Seq], h, residual, reduce=None):
        """CacheBlend token selection at the check layer, request by request (R covers every position of a
        blend request here), then the packed rows re-packed: the other requests keep all theirs. Reads the
        picks on the host (they decide the kernel plan)."""
        keep, off = [], 0
        for s in seqs:
            n = len(s.R)
            if s.blend and n:
                idx = Linker._blend_keep(s.load.job.policy, s.R, s.cached, s.candidate, s.dev, reduce)
                s.R, s.dev = s.R[idx], None
                keep.append(idx + off)
            else:
                keep.append(torch.arange(off, off + n))
            off += n
        idx = host_to_device(torch.cat(keep), h.device)  # [n'] rows kept, still in request order
        return h[idx], (residual[idx] if residual is not None else None)

    @staticmethod
    def _blend_keep(policy: Policy, R, cached, candidate, dev, reduce=None) -> torch.Tensor:
        """One request's kept rows (host indices into R): every uncached token and the top `ratio` of candidate
        chunk tokens by key deviation.  # R: [nR] (host), dev: [nR] (device) -> [n'] int64 (host)"""
        if reduce is not None:  # summed over every rank's heads
            dev = reduce(dev)
        is_cand = candidate[R]
        n_keep = int(round(policy.ratio * int(is_cand.sum())))
        keep = ~cached[R]
        if n_keep > 0:
            scores = torch.where(host_to_device(is_cand, dev.device), dev, torch.full_like(dev, -1.0))
            keep[torch.topk(scores, n_keep).indices.cpu()] = True
        return torch.nonzero(keep).flatten()

    @torch.inference_mode()
    def capture(
        self, block_ids: list[int], start: int, end: int, k_out: torch.Tensor, v_out: torch.Tensor, at: int
    ) -> None:
        """Copy positions [start, end) of a request's paged KV into k_out/v_out: [L, T, Hkv, D] from index at.
        On a GPU: one gather per layer on the device and an asynchronous copy into k_out/v_out (page-locked
        host buffers); nothing waits for the device here: `captured` waits once, before a record is stored."""
        n, device = end - start, self.cache_of(0).device
        if device.type != "cuda":  # straight into the chunk's buffers: [n, Hkv, D] per layer
            for li in range(len(self.layers)):
                self.layout.read_range_into(
                    self.cache_of(li), block_ids, start, end, k_out[li, at : at + n], v_out[li, at : at + n]
                )
            return
        slots = host_to_device(slots_for(block_ids, torch.arange(start, end), self.block_size), device)
        for li in range(len(self.layers)):
            k, v = self.layout.read(self.cache_of(li), slots)  # [n, Hkv, D] on the device
            k_out[li, at : at + n].copy_(k, non_blocking=True)
            v_out[li, at : at + n].copy_(v, non_blocking=True)

    def captured(self) -> None:
        """Wait for the captures issued so far to land in their host buffers (a no-op on CPU): once per compiled
        chunk, before its record is stored."""
        device = self.cache_of(0).device
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
