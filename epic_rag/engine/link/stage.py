"""Cached chunk K/V into a link pass's pages, before each layer's recompute (the linker's kernel path).

A pass's plan (FillPlan) is built once on the host: every linked row of every request of the pass, as
segments of records (a span cut to the positions the link owns), the slot of each row and the position shift
of its keys. Two fillers carry it out, behind one interface:

- TritonFiller (CUDA, vLLM's Triton): the per-row table travels to the device in one copy; records already in
  device memory (the GPU tier) are read where they lie, records in host memory are copied for a group of
  layers at a time (one contiguous copy per record and group, on a side stream, into a two-slot staging
  ring, so the next group's copies overlap this group's recompute; the compute stream waits on events,
  never the host); then ONE fused kernel per group rotates every key and writes K and V into the pages
  (kernels.py). No host synchronisation anywhere in the layer loop. Its stream and event calls go through
  epic_rag.streams (CPU tests replay them on fakes). At attach it must write the torch filler's pages bit
  for bit on scratch caches like the real ones (check_fused), or links use the torch filler
  (choose_filler).
- TorchFiller (CPU; CUDA without Triton): per layer, the rows are copied into a token-major staging buffer,
  keys rotated in place with per-row cos/sin (fp32 arithmetic, one rounding: the same numbers as
  KeyRotator), and the layout writes them with one call (vLLM's own cache-write op on CPU, 4-5x faster
  than per-block copies, measured).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field

import torch

from ...streams import Streams, streams_for
from . import kernels
from .layout import KVLayout, host_to_device
from .rope import KeyRotator

log = logging.getLogger(__name__)

STAGE_SLOTS = 2  # staging ring of the TritonFiller: one group is copied while the other is written
# A pass's host records are staged in at least this many groups of layers (where it has that many layers):
# group 0's copy, which no compute overlaps, is then at most 1/8 of the copies (a slot that holds every layer
# of a small link would copy nearly all of it before layer 0).
MIN_GROUPS = 8
_ALIGN = 256  # bytes: staged regions start on this boundary


@dataclass(slots=True)
class Segment:
    """Record rows that land in one request's pages: fill rows [m0, m0 + n), keys rotated by `delta`."""

    k: torch.Tensor  # [L, n, Hkv, D] (a record's rows, the cache's dtype)
    v: torch.Tensor  # [L, n, Hkv, D]
    m0: int
    delta: int

    @property
    def n(self) -> int:
        return self.k.shape[1]


@dataclass(slots=True)
class FillPlan:
    """Every linked row a pass writes into pages before each layer's recompute, in fill order."""

    segments: list[Segment] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)  # per segment: [n] int64 page slots (host)

    @property
    def num_rows(self) -> int:
        return sum(s.n for s in self.segments)

    def add(self, k: torch.Tensor, v: torch.Tensor, delta: int, slots: torch.Tensor) -> None:
        """Rows k, v: [L, n, Hkv, D] go to `slots` ([n], host), keys rotated by `delta` positions."""
        self.segments.append(Segment(k, v, self.num_rows, delta))
        self.slots.append(slots)

    def row_deltas(self) -> torch.Tensor:
        """Each fill row's key shift.  # -> [M] int64 (host)"""
        if not self.segments:
            return torch.zeros(0, dtype=torch.int64)
        return torch.cat([torch.full((s.n,), s.delta, dtype=torch.int64) for s in self.segments])

    def row_slots(self) -> torch.Tensor:
        """# -> [M] int64 (host)"""
        return torch.cat(self.slots) if self.slots else torch.zeros(0, dtype=torch.int64)


class Filler:
    """Carries out a FillPlan: `begin` once per pass (host work, one transfer), `layer` before each layer's
    recompute (device work only)."""

    def begin(self, plan: FillPlan) -> object:
        raise NotImplementedError

    def layer(self, state: object, li: int) -> None:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Memory the filler allocated at attach (its staging)."""
        return sum(t.numel() * t.element_size() for t in self._buffers())

    def _buffers(self) -> list[torch.Tensor]:
        return []


@dataclass(eq=False, slots=True)
class _TorchFill:
    plan: FillPlan
    slots: torch.Tensor  # [M] int64 on the cache's device
    cos: torch.Tensor  # [M, 1, rot/2] fp32: each row's rotation (sine negated for negative shifts)
    sin: torch.Tensor


class TorchFiller(Filler):
    """Per layer: gather into a token-major staging buffer, rotate in place, one layout write."""

    def __init__(self, layout: KVLayout, rotator: KeyRotator, caches: list[torch.Tensor], max_rows: int) -> None:
        self.layout, self.rotator, self.caches = layout, rotator, caches
        _, H, _, C = caches[0].shape
        # [max_rows, Hkv, D] each, allocated once (first-touch page faults on fresh buffers cost a link ~40%)
        self._k = torch.empty((max_rows, H, C // 2), dtype=caches[0].dtype, device=caches[0].device)
        self._v = torch.empty_like(self._k)

    def _buffers(self) -> list[torch.Tensor]:
        return [self._k, self._v]

    def begin(self, plan: FillPlan) -> _TorchFill:
        device = self.caches[0].device
        if plan.num_rows > len(self._k):
            raise ValueError(f"a pass of {plan.num_rows} linked rows exceeds the staging of {len(self._k)}")
        deltas = plan.row_deltas()
        cos_t, sin_t = self.rotator.tables(device)
        d = host_to_device(deltas, device)
        cos, sin = cos_t[d.abs()], sin_t[d.abs()]  # [M, rot/2]
        sin = torch.where(d[:, None] < 0, -sin, sin)
        return _TorchFill(plan, host_to_device(plan.row_slots(), device), cos[:, None], sin[:, None])

    def layer(self, f: _TorchFill, li: int) -> None:
        M = f.plan.num_rows
        if M == 0:
            return
        k, v = self._k[:M], self._v[:M]  # [M, Hkv, D]
        for s in f.plan.segments:  # on a GPU: from page-locked records without stalling the host per record
            k[s.m0 : s.m0 + s.n].copy_(s.k[li], non_blocking=True)
            v[s.m0 : s.m0 + s.n].copy_(s.v[li], non_blocking=True)
        rotate_rows_(k, f.cos, f.sin, self.rotator.rotary_dim, self.rotator.is_neox)
        self.layout.write(self.caches[li], f.slots, k, v)


def rotate_rows_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot: int, neox: bool) -> None:
    """Rotate keys in place, each row by its own angle, in fp32 (KeyRotator's arithmetic, one rounding).
    # k: [M, Hkv, D] (any float dtype), cos, sin: [M, 1, rot/2] fp32"""
    x = k[..., :rot].float()  # a copy for 16-bit caches, k itself for fp32 (n1, n2 are computed before writing)
    if neox:
        x1, x2 = x[..., : rot // 2], x[..., rot // 2 :]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    n1 = x1 * cos - x2 * sin
    n2 = x2 * cos + x1 * sin
    if neox:
        k[..., : rot // 2] = n1
        k[..., rot // 2 : rot] = n2
    else:
        k[..., 0:rot:2] = n1
        k[..., 1:rot:2] = n2


@dataclass(eq=False, slots=True)
class _TritonFill:
    plan: FillPlan
    table: torch.Tensor  # int64 [TABLE_ROWS, M] on the device
    host: list[tuple[Segment, int, int]]  # staged segments: (segment, K offset, V offset) in a staging slot
    group: int  # layers per launch
    aligned: bool
    copied: int = 0  # groups whose staging copies are issued


class TritonFiller(Filler):
    """One fused kernel per group of layers; host records staged on a side stream (module docstring)."""

    def __init__(
        self,
        rotator: KeyRotator,
        caches: list[torch.Tensor],
        max_rows: int,
        stage_all: bool = False,
        streams: Streams | None = None,
    ) -> None:
        first = caches[0]
        for c in caches:
            if c.shape != first.shape or c.stride() != first.stride() or c.dtype != first.dtype:
                raise ValueError("the fused link kernel needs every layer's cache alike (shape, strides, dtype)")
        self.rotator, self.caches, self.device = rotator, caches, first.device
        self.stage_all = stage_all  # tests: stage every record, as records in host memory are on a GPU
        _, H, _, C = first.shape
        self.row_elems, self.esize = H * (C // 2), first.element_size()
        pages = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64)
        self.pages = host_to_device(pages, self.device)
        # vector loads and stores need every address 16-byte aligned: pages, strides, rows, heads (sources
        # are checked per pass)
        sizes = (*(x * self.esize for x in first.stride()[:3]), self.row_elems * self.esize, (C // 2) * self.esize)
        self._aligned = bool((pages % 16 == 0).all()) and all(x % 16 == 0 for x in sizes)
        # staging slot: K regions then V regions, room for every row of a pass for one layer at least
        self.slot_elems = 2 * (max_rows * self.row_elems + len(caches) * _ALIGN)
        self._ring = [torch.empty(self.slot_elems, dtype=first.dtype, device=self.device) for _ in range(STAGE_SLOTS)]
        self._aligned = self._aligned and all(b.data_ptr() % 16 == 0 for b in self._ring)
        # the copy stream and the ring's events (none on a CPU: work runs in issue order there)
        self.streams = streams if streams is not None else streams_for(self.device)
        st = self.streams
        self._copy = st.stream() if st is not None else None
        self._ready = [st.event() for _ in range(STAGE_SLOTS)] if st is not None else []  # a slot's copies landed
        self._free = [st.event() for _ in range(STAGE_SLOTS)] if st is not None else []  # its last kernel read it
        self.launches = 0  # fused kernel launches (counted for tests and benchmarks)

    @staticmethod
    def stage_bytes(tokens: int, num_kv_heads: int, head_size: int, dtype_bytes: int) -> int:
        """Device memory of the staging ring for passes of up to `tokens` rows (a few KiB beside, for alignment)."""
        return STAGE_SLOTS * 2 * tokens * num_kv_heads * head_size * dtype_bytes

    def _buffers(self) -> list[torch.Tensor]:
        return list(self._ring)

    def _resident(self, t: torch.Tensor) -> bool:
        return t.device == self.device and not self.stage_all

    def begin(self, plan: FillPlan) -> _TritonFill:
        L, E, es = len(self.caches), self.row_elems, self.esize
        segs = []
        for s in plan.segments:  # rows contiguous within a layer, K and V strided alike (records are)
            k, v = s.k, s.v
            if k.stride()[1:] != (E, E // k.shape[2], 1) or v.stride() != k.stride():
                k, v = k.contiguous(), v.contiguous()
            if not self._resident(k) and self.device.type == "cuda" and not k.is_pinned():
                # a record not pinned when it entered host memory: one extra host copy, here, not per layer
                k, v = _pinned(k), _pinned(v)
            segs.append(Segment(k, v, s.m0, s.delta))
        staged = [s for s in segs if not self._resident(s.k)]
        # layers per launch: as many as a staging slot holds, in MIN_GROUPS groups at least (all of them when
        # nothing is staged)
        group = L
        if staged:
            per_layer = sum(s.k.stride(0) for s in staged)
            room = self.slot_elems // 2 - sum(s.n for s in staged) * E - len(staged) * _ALIGN
            group = max(1, min(L, 1 + room // per_layer, -(-L // MIN_GROUPS)))
        tab = torch.empty((kernels.TABLE_ROWS, plan.num_rows), dtype=torch.int64)
        tab[kernels.SLOT] = plan.row_slots()
        tab[kernels.DELTA] = plan.row_deltas()
        host, off_k, off_v = [], 0, (self.slot_elems // 2) * es
        for s in segs:
            rows = tab[:, s.m0 : s.m0 + s.n]
            step = torch.arange(s.n, dtype=torch.int64) * (E * es)  # row i within a layer
            rows[kernels.LSTRIDE] = s.k.stride(0) * es
            if self._resident(s.k):  # read in place: absolute addresses of layer 0's rows
                rows[kernels.K_SRC], rows[kernels.V_SRC] = s.k.data_ptr() + step, s.v.data_ptr() + step
                rows[kernels.STAGED] = 0
                continue
            rows[kernels.K_SRC], rows[kernels.V_SRC] = off_k + step, off_v + step  # offsets in the slot
            rows[kernels.STAGED] = 1
            host.append((s, off_k, off_v))
            size = _round_up(((group - 1) * s.k.stride(0) + s.n * E) * es)
            off_k, off_v = off_k + size, off_v + size
        addrs = tab[kernels.K_SRC : kernels.LSTRIDE + 1]  # K and V sources, layer strides
        aligned = self._aligned and bool((addrs % 16 == 0).all())
        f = _TritonFill(FillPlan(segs, plan.slots), host_to_device(tab, self.device), host, group, aligned)
        self._issue_copies(f)
        return f

    def _issue_copies(self, f: _TritonFill) -> None:
        """The next group's staging copies, on the copy stream once its slot is free (device-side waits)."""
        L = len(self.caches)
        g = f.copied
        if not f.host or g * f.group >= L:
            return
        slot = g % STAGE_SLOTS
        l0, l1 = g * f.group, min(L, (g + 1) * f.group)
        buf = self._ring[slot]
        es = self.esize
        st = self.streams
        with st.on(self._copy) if st is not None else contextlib.nullcontext():
            if st is not None:
                self._copy.wait_event(self._free[slot])  # its last kernel has read it
            for s, off_k, off_v in f.host:
                for src, off in ((s.k, off_k), (s.v, off_v)):
                    # layers [l0, l1) of the segment's rows as one run of memory (rows contiguous in a layer)
                    count = (l1 - l0 - 1) * src.stride(0) + s.n * self.row_elems
                    flat = torch.as_strided(src, (count,), (1,), src.storage_offset() + l0 * src.stride(0))
                    dst = buf[off // es : off // es + count]
                    st.copy(dst, flat) if st is not None else dst.copy_(flat)
            if st is not None:
                self._ready[slot].record(self._copy)
        f.copied += 1

    def layer(self, f: _TritonFill, li: int) -> None:
        if li % f.group or f.plan.num_rows == 0:
            return
        g = li // f.group
        slot = g % STAGE_SLOTS
        if f.host and self.streams is not None:
            self.streams.current().wait_event(self._ready[slot])
        cos, sin = self.rotator.tables(self.device)
        kernels.fill_pages(
            f.table,
            f.plan.num_rows,
            self.pages,
            self.caches[0],
            cos,
            sin,
            self.rotator.rotary_dim,
            self.rotator.is_neox,
            layer0=li,
            num_layers=min(f.group, len(self.caches) - li),
            stage_base=self._ring[slot].data_ptr() if f.host else 0,
            aligned=f.aligned,
        )
        self.launches += 1
        if f.host and self.streams is not None:
            self._free[slot].record(self.streams.current())
        self._issue_copies(f)  # the next group's copies overlap this group's recompute


def _pinned(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def _round_up(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class FillerCheck:
    """The start-up check of the fused filler (check_fused), as attach reports it."""

    filler: str  # the filler links use
    passed: bool | None  # None: not run (the torch filler chosen outright, or the fused one forced)
    reason: str = ""  # why the fused filler is not used
    seconds: float = 0.0  # the check's time (mostly Triton's compile of the kernel variants links use)


class FillerCheckError(RuntimeError):
    """The fused filler wrote other pages than the torch filler."""


def choose_filler(
    layout: KVLayout, rotator: KeyRotator, caches: list[torch.Tensor], max_rows: int, fused: bool | None = None
) -> tuple[Filler, FillerCheck]:
    """The page filler links use. fused=None (the engine): the fused kernel where the layout is FlashAttention's
    and Triton runs, if it passes its start-up check (check_fused: which also compiles the kernel variants
    links use), else the torch filler, with one log line saying why: a compile error, a launch error or a
    page that differs never fails links. True / False force one (no check)."""
    from .layout import FlashAttnLayout

    if fused is False or (
        fused is None and not (isinstance(layout, FlashAttnLayout) and kernels.available(caches[0].device))
    ):
        return TorchFiller(layout, rotator, caches, max_rows), FillerCheck("TorchFiller", None)
    filler = TritonFiller(rotator, caches, max_rows)
    if fused:
        return filler, FillerCheck("TritonFiller", None)
    t0 = time.perf_counter()
    try:
        check_fused(filler, layout)
    except Exception as e:
        took = time.perf_counter() - t0
        reason = f"{type(e).__name__}: {e}"[:500]
        log.warning("the fused link kernel failed its start-up check; links use the torch filler: %s", reason)
        return TorchFiller(layout, rotator, caches, max_rows), FillerCheck("TorchFiller", False, reason, took)
    return filler, FillerCheck("TritonFiller", True, seconds=time.perf_counter() - t0)


def check_fused(filler: TritonFiller, layout: KVLayout, layers: int = 3) -> None:
    """The fused filler against the torch filler on scratch caches like the real ones (dtype, device, strides:
    equal to the real ones where blocks are outermost, FlashAttention's layout; in the same order otherwise):
    records read where they lie and records staged through a small ring (groups of one layer, both slots, the
    events on the side stream), with the real caches' alignment, and unaligned where they are aligned; the
    pages must be equal bit for bit (both round once from fp32, FMA contraction off). Runs the kernel variants
    links use, so Triton compiles them here, not in the first links. Raises FillerCheckError on a difference;
    a compile or launch error propagates."""
    like, rot = filler.caches[0], filler.rotator
    _, H, N, C = like.shape
    D, rows = C // 2, 2 * kernels.BLOCK_T + 7  # two whole programs of tokens and a part
    blocks = -(-rows // N) + 2
    g = torch.Generator().manual_seed(2024)
    plan, host = FillPlan(), like.device.type == "cuda"
    slots = torch.randperm(blocks * N, generator=g)
    used = 0
    for n, delta in ((37, min(300, rot.max_position - 1)), (21, -5), (rows - 58, 0)):
        k, v = (torch.randn(layers, n + 1, H, D, generator=g).to(like.dtype)[:, 1:] for _ in range(2))
        if host:  # page-locked, as the memory tier holds records
            k, v = k.pin_memory(), v.pin_memory()
        plan.add(k, v, delta, slots[used : used + n].sort().values)
        used += n

    def scratch() -> list[torch.Tensor]:
        return [_scratch_like(like, blocks) for _ in range(layers)]

    want = scratch()
    ref = TorchFiller(layout, rot, want, rows)
    state = ref.begin(plan)
    for li in range(layers):
        ref.layer(state, li)
    cases = [("resident", False, filler._aligned), ("staged", True, filler._aligned)]
    if filler._aligned:
        cases.append(("resident, unaligned", False, False))
    for name, staged, aligned in cases:
        got = scratch()
        f = TritonFiller(rot, got, rows, stage_all=staged, streams=filler.streams)
        f._aligned = f._aligned and aligned  # the variant the real caches get
        p = FillPlan([_on_device(s, like.device, staged) for s in plan.segments], plan.slots)
        st = f.begin(p)
        for li in range(layers):
            f.layer(st, li)
        for li, (a, b) in enumerate(zip(got, want)):
            if not torch.equal(a, b):
                bad = int((a != b).sum())
                raise FillerCheckError(
                    f"{name} records: {bad} page values differ from the torch filler's at layer {li}"
                )


def _on_device(s: Segment, device: torch.device, staged: bool) -> Segment:
    return s if staged else Segment(s.k.to(device), s.v.to(device), s.m0, s.delta)


def _scratch_like(like: torch.Tensor, blocks: int) -> torch.Tensor:
    """A zeroed cache of `blocks` blocks shaped and strided like `like` ([B, H, N, 2D] view): its exact strides
    where the blocks are its outermost dim, else its dims in the same memory order."""
    shape = (blocks, *like.shape[1:])
    if like.stride(0) == max(like.stride()):
        return torch.empty_strided(shape, like.stride(), dtype=like.dtype, device=like.device).zero_()
    order = sorted(range(4), key=lambda i: like.stride(i), reverse=True)  # outermost first
    phys = torch.zeros([shape[i] for i in order], dtype=like.dtype, device=like.device)
    return phys.permute([order.index(i) for i in range(4)])
