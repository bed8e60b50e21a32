"""LegoLink linker: assemble requests' KV from compiled chunks and recompute a few tokens.

Runs on the worker, inside vLLM's steps. The requests that link together are linked in one batched pass
(`Linker.begin`: host work only, no device synchronisation), layer by layer (`Linker.advance`: all layers at
once, or a few each step, see connector.py). A request links over the positions it owns, [start, end): below
`start` its pages already hold vLLM's own KV (a prefix-cache hit), which is neither refilled nor recomputed.

Kernel path (every request where the backend has a paged attention kernel: FlashAttention, vLLM's CPU
attention): the pass's cached chunk KV goes straight into the pages, keys rotated to their linked positions
(stage.py: one fused kernel per group of layers on a GPU, a token-major staging buffer and vLLM's own
cache-write op on a CPU); then the model's own decoder layer runs ONCE on the recompute sets R of all the pass's
requests, packed one after another, with the attention module swapped for `_LinkAttention` (architecture details
stay in vLLM's model code; the swap is undone before the step's forward runs), which writes R's fresh K/V into
the pages and attends with the backend's own kernel, one call for the whole pass. Buffer path (the fallback
where a layout's kernel refuses a request): the request's pages are filled the same way; per layer they are
gathered into a token-major buffer for positions [0, T), R's fresh K/V written into the buffer and the pages,
and its queries attend over the buffer with a position-causal mask.

Recompute sets (R always holds every token without a cache: template glue, system prompt):
- naive: nothing else;  legolink-k: the first k tokens of each chunk's span (its sink token first where
  the policy keeps it, see policy.py);  legolink-0: nothing else;
- cacheblend-r: every token through layers 0..CHECK_LAYER; at CHECK_LAYER the chunk tokens whose
  *keys* deviate most from the cache (L2 over heads and dims, after re-rotation: LMCache's rule)
  are kept, the top r fraction, and only they (plus uncached tokens) are recomputed in later layers.
  The selection is made per request, then the batch is re-packed;
- query-r: a probe pass first (uncached tokens, and the prompt's tail attending over the linked KV: the
  attention each chunk token gets, summed over layers), then the top r fraction of chunk tokens by it (plus
  uncached tokens) through every layer (`_main_pass`).
The picks of cacheblend and query are the only device values a pass reads on the host: they decide the plan.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ...policy import Policy
from ...streams import Streams, streams_for
from .. import vllm_api
from ..jobs import LinkJob
from .layout import KVLayout, host_to_device, slots_for
from .rope import KeyRotator
from .stage import FillPlan, choose_filler

log = logging.getLogger(__name__)

CHECK_LAYER = 1  # CacheBlend selects its tokens from the deviation at this layer
ATTN_BUCKET = 256  # recompute queries are grouped by position // ATTN_BUCKET for the sparse attention
WORKSPACE_PROMPTS = 2  # a pass's default size (workspace_tokens), in whole prompts of max_model_len tokens


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
    slots: torch.Tensor | None = None  # [nR] int64 on the cache's device: R's slots (buffer path's page writes)
    paged: bool = False  # attends with the kernel (from the current layer on)
    dev: torch.Tensor | None = None  # [nR] CacheBlend's key deviation at CHECK_LAYER (on the device)
    probe: int = 0  # query-<r>'s probe rows (the prompt's tail) packed after R's, while its probe pass runs
    score: torch.Tensor | None = None  # [T] fp32 on the device: the attention the tail gave each position

    @property
    def blend(self) -> bool:
        return self.load.job.policy.kind == "cacheblend"

    @property
    def query(self) -> bool:
        return self.load.job.policy.kind == "query"

    @property
    def rows(self) -> int:
        """Packed rows of this request in the current pass: its R, then its probe rows."""
        return len(self.R) + self.probe


@dataclass(eq=False)
class LinkPass:
    """A batched link under way (Linker.begin, then advance until done): its requests, the next layer to run
    and what is carried to it."""

    seqs: list[_Seq]
    device: torch.device
    h: torch.Tensor  # [n, hidden]: the packed rows of every request's R entering `layer`
    residual: torch.Tensor | None
    fill: object  # the filler's state for this pass (stage.py)
    positions: torch.Tensor | None = None  # [n] on the device: the packed rows' positions
    plan: object | None = None  # the kernel plan of the requests with s.paged (None: none attends)
    kernel_rows: torch.Tensor | None = None  # [nk] on the device: the packed rows of those requests (None: all)
    layer: int = 0  # the next layer to run
    probing: bool = False  # query-<r> requests' probe pass runs: their main pass follows it


class _LinkAttention(torch.nn.Module):
    """Stands in for vLLM's Attention during the sparse forward of one layer over a packed batch.

    Gets post-RoPE q, k, v of the concatenated recompute sets (request after request, in `seqs` order)
    and attends each request's queries over its own positions <= theirs: kernel requests over their pages
    (R's fresh K/V written there by the kernel call, one for all of them), buffer requests over their K/V
    buffers (R's fresh K/V stored there first). At CacheBlend's check layer it also measures, per blend
    request, how far the fresh keys at R are from the cached ones. A query-<r> request's probe rows (its
    prompt's tail, after its R) attend over the layer's linked KV and their own, and add the attention they
    give each position to its score.
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
        off, probes = 0, []
        for s in p.seqs:
            R, n = s.R, len(s.R)
            rows = slice(off, off + n)
            if s.probe:
                probes.append((s, slice(off + n, off + s.rows)))
            off += s.rows
            if n == 0:
                continue
            if self.blend_check and s.blend:  # cached keys at R, before the fresh ones land
                old = linker.layout.read(cache, linker.slots_of(s, R))[0]  # [nR, Hkv, D]
                s.dev = (kh[rows].to(cache.dtype) - old).float().pow(2).sum(dim=(1, 2))  # [nR]
            if s.paged:
                continue
            T = len(s.load.job.token_ids)
            K, V = linker.gather(cache, s.load.block_ids, T)  # [T, Hkv, D] views of the linker's buffer
            K[R], V[R] = kh[rows].to(K.dtype), vh[rows].to(V.dtype)
            linker.layout.write(cache, s.slots, kh[rows], vh[rows])
            out[rows] = self._attend_buffers(q[rows], K.transpose(0, 1), V.transpose(0, 1), R)
        if p.plan is not None:
            # One kernel call for every kernel request (3x faster than the batched matmuls, measured); the
            # plan's runs follow the packing of exactly these rows.
            if p.kernel_rows is None:  # all of them: no gather needed
                out = linker.layout.attend(p.plan, self.real, cache, q, k, v).to(q.dtype)
            else:
                idx = p.kernel_rows
                out[idx] = linker.layout.attend(p.plan, self.real, cache, q[idx], k[idx], v[idx]).to(q.dtype)
        for s, rows in probes:  # after R's fresh K/V are in place (pages or buffers)
            out[rows] = self._probe(s, q[rows], kh[rows], vh[rows], cache)
        return out

    def _probe(self, s: _Seq, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """A query-<r> request's tail rows (positions T, T+1, ...) over the layer's KV of positions [0, T) and
        their own, causally; the attention they give each position < T is added to its score (the mean over
        the tail's rows and the query heads: one unit per layer).
        # q: [nq, Hq*D], k, v: [nq, Hkv, D] -> [nq, Hq*D]"""
        Hq, Hk, D = self.num_heads, self.num_kv_heads, self.head_size
        G, nq, T = Hq // Hk, len(q), len(s.load.job.token_ids)
        Kc, Vc = self.linker.gather(cache, s.load.block_ids, T)  # [T, Hkv, D]: vLLM's KV below start, the link's
        K = torch.cat([Kc, k.to(Kc.dtype)]).float().permute(1, 2, 0)  # [Hkv, D, T + nq]
        V = torch.cat([Vc, v.to(Vc.dtype)]).float().transpose(0, 1)  # [Hkv, T + nq, D]
        qh = q.view(nq, Hk, G, D).permute(1, 2, 0, 3).float().reshape(Hk, G * nq, D)
        scores = torch.bmm(qh, K).mul_(self.scale).view(Hk, G, nq, T + nq)
        blocked = torch.ones((nq, nq), dtype=torch.bool, device=scores.device).triu_(1)  # a row sees tail keys <= it
        scores[..., T:].masked_fill_(blocked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # [Hkv, G, nq, T + nq]
        # Summed over every layer: on the dev split the first half of the layers alone lost 6 points, the
        # second half alone did as well as all of them (docs/bench/qwen-query/dev.md).
        mass = probs[..., :T].sum(dim=(0, 1, 2)) / (Hq * nq)  # [T]
        s.score = mass if s.score is None else s.score.add_(mass)
        out = torch.bmm(probs.view(Hk, G * nq, T + nq), V)  # [Hkv, G * nq, D]
        return out.view(Hk, G, nq, D).permute(2, 0, 1, 3).reshape(nq, Hq * D).to(q.dtype)

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
    # Prompt tokens one recompute pass may hold (summed over its requests): the page filler's staging is
    # allocated for this many once, at attach (and the gather buffer for one prompt); a step's links beyond it
    # run in several passes.
    workspace_tokens: int
    # Tensor parallelism: sums a tensor over the ranks (CacheBlend's key deviation is summed over every rank's
    # heads before its picks, so all ranks recompute the same tokens); None on one rank.
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Tensor parallelism: ORs per-request failure flags over the ranks (a request failing its checks on any
    # rank is failed on all, so every rank's pass holds the same requests and their collectives stay in step).
    agree: Callable[[list[bool]], list[bool]] | None = None
    # The page filler: the fused kernel (True), the torch path (False), or chosen by the layout and device and
    # the fused kernel's start-up check (None: stage.choose_filler).
    fused: bool | None = None
    # vLLM's C/CUDA kernels for the layers' eager calls during a pass (vllm_api.link_kernels: under
    # torch.compile the layers' ops are the native ones, one PyTorch kernel each outside Inductor), switched
    # back after it; none switched by default (a model that is not vLLM's)
    layer_kernels: vllm_api.LayerKernels = field(default_factory=vllm_api.LayerKernels)
    # The device's streams and events (captures record one per capture); None: the cache's device decides
    # (epic_rag.streams: CUDA's, none on a CPU). Tests pass fakes.
    streams: Streams | None = None
    # requests per batched recompute pass -> passes run (bounded: at most max_num_seqs sizes)
    batch_sizes: Counter = field(init=False, default_factory=Counter)

    def __post_init__(self) -> None:
        self.layers = vllm_api.decoder_layers(self.model)
        self.attn = [vllm_api.find_attention(layer) for layer in self.layers]
        self._embed = vllm_api.embed_fn(self.model)
        if self.streams is None:
            self.streams = streams_for(self.cache_of(0).device)
        first, cache = self.attn[0][2], self.cache_of(0)
        # One layer of one prompt's K/V gathered from its pages (the buffer path, query-<r>'s probe), allocated
        # now and never grown (first-touch page faults on fresh buffers were ~40% of a link on CPU).
        shape = (2, self.workspace_tokens, first.num_kv_heads, first.head_size)
        self._ws = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        caches = [self.cache_of(li) for li in range(len(self.layers))]
        # the fused filler only where it passed its start-up check (fused=None), else the torch one
        self.filler, self.filler_check = choose_filler(
            self.layout, self.rotator, caches, self.workspace_tokens, self.fused
        )

    @property
    def workspace_nbytes(self) -> int:
        """Bytes the linker allocated at attach: its gather buffer and its filler's staging."""
        return self._ws.numel() * self._ws.element_size() + self.filler.nbytes

    def gather(self, cache: torch.Tensor, block_ids: list[int], T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's K/V of positions [0, T) of one layer, from its pages into the linker's gather buffer (valid
        until the next gather).  # -> K, V: [T, Hkv, D]"""
        k, v = self._ws[0, :T], self._ws[1, :T]
        self.layout.read_range_into(cache, block_ids, 0, T, k, v)
        return k, v

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
        pages of every request of the pass unfilled or partly filled: the caller fails them all. The decoder
        layers run vLLM's C/CUDA kernels meanwhile (vllm_api.link_kernels), the previous choice restored after."""
        L = len(self.layers)
        with self.layer_kernels.active():  # vLLM's own kernels in the layers, whatever the compile mode
            while p.layer < L:
                self._layer(p, p.layer)
                p.layer += 1
                if p.layer == L and p.probing:  # query-<r>'s probe pass is done: its main pass follows
                    self._main_pass(p)
                if more is not None and not more():
                    break
        if p.layer < L:
            return False
        for s in p.seqs:
            if s.load.job.recomputed == 0:  # query-<r>'s others counted theirs when its probe pass ended
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
        """A pass over `seqs`: every request's page fills planned (stage.py), the packed rows embedded. Every
        position a request owns outside its spans is in R, written by the shim before any read."""
        for s in seqs:
            s.paged = self.layout.can_attend(s.R, s.load.start, s.load.end) or len(s.R) == 0
        if not self.layout.needs_buffers and not all(s.paged for s in seqs):
            raise RuntimeError(f"layout {self.layout.name} has no buffer path and its kernel refused a request")
        self.batch_sizes[len(seqs)] += 1
        fill = FillPlan()
        for s in seqs:
            self._plan_fill(fill, s)
        for s in seqs:  # query-<r> requests probe first: their tail rows run beside their uncached tokens
            s.probe = len(s.load.job.tail) if s.query else 0
        p = LinkPass(seqs, device, None, None, self.filler.begin(fill), probing=any(s.probe for s in seqs))
        self._embed_rows(p)
        self._plan(p)
        return p

    def _embed_rows(self, p: LinkPass) -> None:
        """The packed rows entering layer 0: every request's R, then its probe rows (the prompt's tail)."""
        ids = []
        for s in p.seqs:
            ids.append(torch.tensor(s.load.job.token_ids, dtype=torch.int64)[s.R])
            if s.probe:
                ids.append(torch.tensor(s.load.job.tail, dtype=torch.int64))
        p.h, p.residual = self._embed(host_to_device(torch.cat(ids), p.device)), None  # [n, hidden]

    def _main_pass(self, p: LinkPass) -> None:
        """After query-<r>'s probe pass: each query request keeps its uncached tokens and the top ratio of its
        chunk tokens by the attention its tail gave them (summed over the layers; under tensor parallelism over
        every rank's heads), and those run through every layer again. The other requests are done: their count
        is taken, their rows leave the pass. The pages hold every layer's linked KV already; the picks' fresh
        K/V replace it layer by layer. Reads the picks on the host (they decide the kernel plan)."""
        for s in p.seqs:
            if not s.query:  # done: nothing more is attended, filled or written for it
                s.load.job.recomputed, s.R, s.paged = len(s.R), s.R[:0], True
                continue
            s.R, s.probe, s.score = self._query_picks(s), 0, None
        p.probing, p.layer, p.fill = False, 0, None
        self._embed_rows(p)
        self._plan(p)

    def _query_picks(self, s: _Seq) -> torch.Tensor:
        """A query request's main-pass recompute set: its uncached tokens and the top ratio of its chunk tokens
        by score, over the whole request (the chunks the question attends to most get the most; a budget split
        per chunk by score did no better on the dev split, nor did each chunk's first token on top).
        # -> [nR] int64 (host), sorted"""
        job, a0 = s.load.job, s.load.start
        score = s.score if s.score is not None else torch.zeros(len(job.token_ids), device=self.cache_of(0).device)
        score = score if self.reduce is None else self.reduce(score)
        cand = s.candidate.clone()
        cand[:a0] = False
        keep = ~s.cached
        keep[:a0] = False
        n_pick = int(round(job.policy.ratio * int(cand.sum())))
        if n_pick > 0:
            ranked = torch.where(host_to_device(cand, score.device), score, torch.full_like(score, -1.0))
            keep[torch.topk(ranked, n_pick).indices.cpu()] = True
        return torch.nonzero(keep).flatten()

    def _plan_fill(self, fill: FillPlan, s: _Seq) -> None:
        """The request's span rows inside [start, end) into the pass's fill plan."""
        a0, b0 = s.load.start, s.load.end
        for sp in s.load.job.spans:
            a, b = max(sp.start, a0), min(sp.start + sp.kv.num_tokens, b0)
            if a < b:
                kv = sp.kv.slice(a - sp.start, b - sp.start)
                fill.add(kv.k, kv.v, a - kv.base_pos, slots_for(s.load.block_ids, torch.arange(a, b), self.block_size))

    def _plan(self, p: LinkPass) -> None:
        """Which requests attend with the kernel from here on, one plan for all of them, and the positions of
        the packed rows (host work, then asynchronous copies)."""
        cache = self.cache_of(0)
        for s in p.seqs:
            if s.paged and len(s.R) and not self.layout.can_attend(s.R, s.load.start, s.load.end):
                s.paged = False  # CacheBlend's picks: too many runs for this layout's kernel
            if not s.paged:  # R's slots, once per plan: the per-layer page writes build nothing
                s.slots = self.slots_of(s, s.R)
        kern = [(s.load.block_ids, s.R) for s in p.seqs if s.paged and len(s.R)]
        p.plan = self.layout.attention_plan(cache, kern, self.attn[0][2]) if kern else None
        pos = []
        for s in p.seqs:  # [n]: R, then the probe rows at the positions after the claim
            pos.append(s.R)
            if s.probe:
                T = len(s.load.job.token_ids)
                pos.append(torch.arange(T, T + s.probe))
        p.positions = host_to_device(torch.cat(pos), p.device)
        p.kernel_rows = None
        if p.plan is not None and sum(len(s.R) for s in p.seqs if s.paged) < sum(s.rows for s in p.seqs):
            rows, off = [], 0
            for s in p.seqs:
                if s.paged:
                    rows.append(torch.arange(off, off + len(s.R)))
                off += s.rows
            p.kernel_rows = host_to_device(torch.cat(rows), p.device)

    def _layer(self, p: LinkPass, li: int) -> None:
        """Layer li of the pass: its cached KV into the pages (kernel requests) or buffers (buffer requests), the
        decoder layer once over every request's R (packed in `seqs` order), buffers into the pages."""
        seqs = p.seqs
        if p.fill is not None:  # None in query-<r>'s main pass: the pages hold every layer's linked KV already
            self.filler.layer(p.fill, li)
        blend_here = li == CHECK_LAYER and any(s.blend and len(s.R) for s in seqs)
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
                keep.append(torch.arange(off, off + s.rows))
            off += n + s.probe
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
    ) -> object | None:
        """Copy positions [start, end) of a request's paged KV into k_out/v_out: [L, T, Hkv, D] from index at.
        On a GPU: one gather per layer on the device and an asynchronous copy into k_out/v_out (page-locked
        host buffers), then an event recorded after them, returned: `captured` waits for these events alone,
        not for the whole stream (nothing waits here). None on a CPU (the copies are done on return)."""
        n, device = end - start, self.cache_of(0).device
        if self.streams is None:  # straight into the chunk's buffers: [n, Hkv, D] per layer
            for li in range(len(self.layers)):
                self.layout.read_range_into(
                    self.cache_of(li), block_ids, start, end, k_out[li, at : at + n], v_out[li, at : at + n]
                )
            return None
        slots = host_to_device(slots_for(block_ids, torch.arange(start, end), self.block_size), device)
        for li in range(len(self.layers)):
            k, v = self.layout.read(self.cache_of(li), slots)  # [n, Hkv, D] on the device
            self.streams.copy(k_out[li, at : at + n], k)
            self.streams.copy(v_out[li, at : at + n], v)
        landed = self.streams.event()
        landed.record(self.streams.current())
        return landed

    @staticmethod
    def captured(landed: list) -> None:
        """Wait for the captures whose events are `landed` (capture's returns) to be in their host buffers:
        once per compiled chunk, before its record is stored. An event per capture, not a stream sync: the work
        queued on the stream after a capture (a later capture, link layers) is not waited for."""
        for e in landed:
            if e is not None:
                e.synchronize()
