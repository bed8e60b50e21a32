"""Accessors for vLLM's paged KV cache, one per attention backend, each self-checked at start-up.

vLLM hands each attention layer one cache tensor with the logical shape [B, H, N, 2*D]
(B blocks, H kv heads, N tokens per block, K then V content). How those bytes are laid out differs:

- CPU_ATTN (vLLM's CPU backend): per (block, head) a K region then a V region, and K is stored
  *transposed* as [D, N] while V is [N, D]. Reading the last dim as K||V gives garbage. Writes go
  through vLLM's own `cpu_attn_reshape_and_cache` op, which knows each ISA's packing; reads use the
  known `vec`/`vec16` packing and are verified against that op at start-up.
  Other ISAs (e.g. `amx`, chosen for bf16 on CPUs with AMX tiles) pack a block differently; their
  packing is *probed* from vLLM's own write op at start-up (ProbedCpuAttnLayout) and must be a pure
  permutation of the block's elements, or the engine refuses to serve.
- FLASH_ATTN (CUDA): the logical view holds K = cache[..., :D], V = cache[..., D:] (strided views;
  `transpose(1, 2).split(D, -1)` in vLLM). NOT RUN ON A GPU HERE: its logic is tested on CPU tensors.

A token at position t of a request lives in slot block_ids[t // N] * N + t % N.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from .. import vllm_api


class LayoutError(RuntimeError):
    """The paged KV layout is unknown or failed its self-check: refuse to serve."""


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small tensor built on the host, on `device`: on a GPU through page-locked memory, asynchronously (a
    copy from pageable memory can stall the host until the stream drains)."""
    if t.device == torch.device(device):
        return t
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def slots_for(block_ids: list[int] | torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slot index of each position of one request.  # positions: [n] -> slots: [n] int64"""
    bids = torch.as_tensor(block_ids, dtype=torch.int64)
    return bids[positions // block_size] * block_size + positions % block_size


def query_runs(R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of consecutive positions in R (sorted, non-empty) as kernel "sequences": run i holds the
    queries [query_start_loc[i], query_start_loc[i+1]) of R and attends keys [0, seq_lens[i]), its last
    position + 1, so a bottom-right causal mask is the prompt's causal mask.
    # R: [nR] -> query_start_loc: [runs + 1] int32, seq_lens: [runs] int32 (both on the CPU)"""
    brk = torch.nonzero(R[1:] != R[:-1] + 1).flatten().add(1)
    ends = torch.cat([brk, torch.tensor([len(R)], device=R.device)])  # [runs]
    qsl = torch.cat([torch.zeros(1, dtype=torch.int32), ends.to(torch.int32).cpu()])
    return qsl, (R[ends - 1] + 1).to(torch.int32).cpu()


class KVLayout(ABC):
    name: str = "?"
    # Whether the linker keeps K/V buffers for requests this layout's kernel does not take (can_attend False).
    needs_buffers: bool = True

    @abstractmethod
    def write(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: [n, H, D] at slots: [n] (int64). Mutates `cache` in place."""

    @abstractmethod
    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return copies of k, v: [n, H, D] at slots: [n]."""

    def range_slots(self, cache: torch.Tensor, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """Slots of request positions [start, end) on the cache's device.  # -> [end-start] int64"""
        return host_to_device(slots_for(block_ids, torch.arange(start, end), cache.shape[2]), cache.device)

    def write_range(
        self,
        cache: torch.Tensor,
        block_ids: list[int],
        start: int,
        end: int,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> None:
        """Store k, v: [end-start, H, D] for request positions [start, end) (their `range_slots`, when the
        caller kept them). Mutates `cache`."""
        self.write(cache, self.range_slots(cache, block_ids, start, end) if slots is None else slots, k, v)

    def read_range_into(
        self, cache: torch.Tensor, block_ids: list[int], start: int, end: int, k_out: torch.Tensor, v_out: torch.Tensor
    ) -> None:
        """Copy k, v of request positions [start, end) into k_out, v_out: [end-start, H, D]."""
        slots = host_to_device(slots_for(block_ids, torch.arange(start, end), cache.shape[2]), cache.device)
        k, v = self.read(cache, slots)
        k_out.copy_(k)
        v_out.copy_(v)

    def read_range(
        self, cache: torch.Tensor, block_ids: list[int], start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of k, v: [end-start, H, D] for request positions [start, end)."""
        _, H, _, C = cache.shape
        k = torch.empty((end - start, H, C // 2), dtype=cache.dtype, device=cache.device)
        v = torch.empty_like(k)
        self.read_range_into(cache, block_ids, start, end, k, v)
        return k, v

    def can_attend(self, R: torch.Tensor, start: int, end: int) -> bool:
        """Whether the backend's own kernel can attend the queries at positions R of a request that owns
        positions [start, end) of its pages (False where this layout has no such path: the linker then
        attends over its buffers)."""
        return False

    def attention_plan(
        self, cache: torch.Tensor, seqs: list[tuple[list[int], torch.Tensor]], attn: torch.nn.Module
    ) -> object:
        """Metadata to attend, in one kernel call, the packed queries of several requests over their own
        pages: `seqs` holds (block_ids, R) per request in packing order, each accepted by `can_attend`."""
        raise NotImplementedError

    def attend(
        self,
        plan: object,
        attn: torch.nn.Module,
        cache: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """Store k, v at the packed R's slots, then attend q over the pages (see `attention_plan`).
        # q: [n, Hq*D], k, v: [n, Hkv*D] (n: the plan's requests' nR summed) -> [n, Hq*D]"""
        raise NotImplementedError

    def self_check(self, like: torch.Tensor, attn: torch.nn.Module | None = None) -> None:
        """Write random K/V into a scratch cache shaped like `like` ([B, H, N, 2D]) and read it back (`attn`: the
        model's attention module, for layouts whose check runs its kernels)."""
        _, H, N, C = like.shape
        scratch = torch.zeros((3, H, N, C), dtype=like.dtype, device=like.device)
        g = torch.Generator().manual_seed(1234)
        slots = torch.tensor([N + 1, 2 * N + N - 1, N, 2 * N + 3], dtype=torch.int64, device=like.device)
        k = torch.randn((len(slots), H, C // 2), generator=g).to(like.dtype).to(like.device)
        v = torch.randn((len(slots), H, C // 2), generator=g).to(like.dtype).to(like.device)
        self.write(scratch, slots, k, v)
        rk, rv = self.read(scratch, slots)
        if not (torch.equal(rk, k) and torch.equal(rv, v)):
            raise LayoutError(
                f"KV layout {self.name} failed its read-back self-check for "
                f"dtype {like.dtype}, H={H}, N={N}, D={C // 2}: refusing to serve linked KV"
            )
        if scratch[0].abs().sum() != 0:
            raise LayoutError(f"KV layout {self.name} wrote outside the addressed blocks")


@dataclass(slots=True)
class RunPlan:
    """The query runs of several requests, packed request after request, as varlen kernel "sequences":
    each run of consecutive recomputed positions [a, b) of a request is one sequence whose keys are [0, b)
    read through that request's block table, so a kernel's bottom-right causal mask is exactly each linked
    prompt's mask. Built on the CPU from the requests' R, once per link (never inside the layer loop); one
    plan serves every backend (CPU_ATTN and FlashAttention)."""

    slots: torch.Tensor  # [n] int64: every packed query's slot in its own request's pages
    query_start_loc: torch.Tensor  # [runs + 1] int32, over the packed queries
    seq_lens: torch.Tensor  # [runs] int32: keys per run
    block_table: torch.Tensor  # [runs, nblocks] int32: each run's request's block ids (0-padded)
    max_query_len: int
    max_seq_len: int
    scheduler_metadata: torch.Tensor | None = None  # the backend's own, where it has one

    @classmethod
    def build(cls, seqs: list[tuple[list[int], torch.Tensor]], block_size: int) -> RunPlan:
        """`seqs`: (block_ids, R) per request in packing order, R sorted and non-empty."""
        qsl, seq_lens, tables, slots, base = [torch.zeros(1, dtype=torch.int32)], [], [], [], 0
        for block_ids, R in seqs:
            Rc = R.cpu()
            starts, lens = query_runs(Rc)  # [runs + 1], [runs]: keys [0, b) of each run
            qsl.append(starts[1:] + base)
            seq_lens.append(lens)
            tables.append((block_ids[: -(-int(lens[-1]) // block_size)], len(lens)))
            slots.append(slots_for(block_ids, Rc, block_size))
            base += len(Rc)
        qsl_t, lens_t = torch.cat(qsl), torch.cat(seq_lens)  # [runs + 1], [runs]
        nblk = max(len(b) for b, _ in tables)
        bt = torch.zeros((len(lens_t), nblk), dtype=torch.int32)  # [runs, nblk]; a run reads only its seq_len
        row = 0
        for b, runs in tables:
            bt[row : row + runs, : len(b)] = torch.as_tensor(b, dtype=torch.int32)
            row += runs
        return cls(torch.cat(slots), qsl_t, lens_t, bt, int((qsl_t[1:] - qsl_t[:-1]).max()), int(lens_t.max()))

    def to(self, device: torch.device) -> RunPlan:
        """The plan's tensors on `device` (copied once per link, before the layer loop)."""
        if self.slots.device == torch.device(device):
            return self
        return RunPlan(
            *(host_to_device(t, device) for t in (self.slots, self.query_start_loc, self.seq_lens, self.block_table)),
            self.max_query_len,
            self.max_seq_len,
            self.scheduler_metadata,
        )


class CpuAttnLayout(KVLayout):
    """vLLM CPU_ATTN, ISAs `vec` and `vec16`: per (block, head) K as [D, N] then V as [N, D]."""

    READABLE_ISAS = ("vec", "vec16")

    def __init__(self, isa: str) -> None:
        if isa not in self.READABLE_ISAS:
            raise LayoutError(
                f"CPU attention ISA {isa!r} packs KV in a way epic_rag cannot read yet "
                f"(supported: {', '.join(self.READABLE_ISAS)})"
            )
        self.isa = isa
        self.name = f"cpu_attn/{isa}"

    @staticmethod
    def _views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, N, C = cache.shape
        D = C // 2
        flat = cache.view(B, H, 2 * N * D)
        return flat[:, :, : N * D].view(B, H, D, N), flat[:, :, N * D :].view(B, H, N, D)

    def write(self, cache, slots, k, v) -> None:
        ops = vllm_api.cpu_ops()
        B, H, N, C = cache.shape
        kc, vc = cache.view(B, H, 2 * N, C // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            k.to(cache.dtype).contiguous(),
            v.to(cache.dtype).contiguous(),
            kc,
            vc,
            slots.to(torch.int64),
            self.isa,
            1.0,
            1.0,
            "auto",
        )

    # Whole blocks are copied one block at a time with strided views: an indexed gather/scatter over
    # all blocks at once was ~8x slower (measured); partial blocks at either end go through vLLM's op.
    @staticmethod
    def _split(start: int, end: int, N: int) -> tuple[list[tuple[int, int]], int, int]:
        """Partial-block ranges at either end of [start, end), and the whole blocks [first, last) between."""
        first, last = -(-start // N), end // N
        if last <= first:
            return [(start, end)], first, first
        return [(a, b) for a, b in ((start, first * N), (last * N, end)) if a < b], first, last

    def _block_copies(self, cache: torch.Tensor):
        """(put, get) of one whole block's K and V as [N, H, D] tensors (the hand-coded vec/vec16 packing)."""
        kview, vview = self._views(cache)

        def put(block: int, k: torch.Tensor, v: torch.Tensor) -> None:
            kview[block].copy_(k.permute(1, 2, 0))  # K blocks are [H, D, N]
            vview[block].copy_(v.permute(1, 0, 2))  # V blocks are [H, N, D]

        def get(block: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
            k_out.copy_(kview[block].permute(2, 0, 1))  # [H, D, N] -> [N, H, D]
            v_out.copy_(vview[block].permute(1, 0, 2))  # [H, N, D] -> [N, H, D]

        return put, get

    def write_range(self, cache, block_ids, start, end, k, v, slots=None) -> None:
        edges, first, last = self._split(start, end, N := cache.shape[2])
        for a, b in edges:
            KVLayout.write_range(self, cache, block_ids, a, b, k[a - start : b - start], v[a - start : b - start])
        put, _ = self._block_copies(cache)
        for t in range(first * N - start, last * N - start, N):
            put(block_ids[(t + start) // N], k[t : t + N], v[t : t + N])

    def read_range_into(self, cache, block_ids, start, end, k_out, v_out) -> None:
        edges, first, last = self._split(start, end, N := cache.shape[2])
        for a, b in edges:
            KVLayout.read_range_into(
                self, cache, block_ids, a, b, k_out[a - start : b - start], v_out[a - start : b - start]
            )
        _, get = self._block_copies(cache)
        for t in range(first * N - start, last * N - start, N):
            get(block_ids[(t + start) // N], k_out[t : t + N], v_out[t : t + N])

    def self_check(self, like: torch.Tensor, attn: torch.nn.Module | None = None) -> None:
        super().self_check(like)
        # The block fast paths must store exactly what vLLM's own op stores, and read back the same.
        _, H, N, C = like.shape
        g = torch.Generator().manual_seed(99)
        k = torch.randn((3 * N - 7, H, C // 2), generator=g).to(like.dtype)
        v = torch.randn((3 * N - 7, H, C // 2), generator=g).to(like.dtype)
        a = torch.zeros((5, H, N, C), dtype=like.dtype)
        b = torch.zeros_like(a)
        self.write(a, slots_for([4, 1, 3, 2], torch.arange(5, 3 * N - 2), N), k, v)
        self.write_range(b, [4, 1, 3, 2], 5, 3 * N - 2, k, v)
        if not torch.equal(a, b):
            raise LayoutError(f"KV layout {self.name}: block writes differ from vLLM's cache op")
        rk, rv = self.read_range(a, [4, 1, 3, 2], 5, 3 * N - 2)
        if not (torch.equal(rk, k) and torch.equal(rv, v)):
            raise LayoutError(f"KV layout {self.name}: block reads differ from what was written")

    def can_attend(self, R, start, end):
        # Only positions this link owns may be written: [start, end) (below start are shared prefix blocks).
        # Any number of runs: scattered picks (one kernel sequence each, re-reading its prefix) measured as
        # fast as the gathered buffer's bucketed matmuls for cacheblend-15 (675 picks over 4k tokens, Qwen-0.5B:
        # 7.2 vs 7.1 s) and 1.8x faster for query-20 (878 picks: 4.6 vs 8.3 s).
        return len(R) > 0 and int(R[0]) >= start and int(R[-1]) < end

    def attention_plan(self, cache, seqs, attn):
        plan = RunPlan.build(seqs, cache.shape[2])
        plan.scheduler_metadata = vllm_api.cpu_ops().cpu_attn_get_scheduler_metadata(
            num_reqs=len(plan.seq_lens),
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_size,
            seq_lens=plan.seq_lens,
            dtype=cache.dtype,
            query_start_loc=plan.query_start_loc,
            causal=True,
            sliding_window_size=-1,
            isa=self.isa,
            enable_kv_split=vllm_api.cpu_attn_split_kv(),
        )
        return plan

    def attend(self, plan, attn, cache, q, k, v):
        ops = vllm_api.cpu_ops()
        impl = attn.impl
        B, H, N, C = cache.shape
        kc, vc = cache.view(B, H, 2 * N, C // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            k.reshape(-1, H, C // 2).contiguous(),
            v.reshape(-1, H, C // 2).contiguous(),
            kc,
            vc,
            plan.slots,
            self.isa,
            1.0,
            1.0,
            "auto",
        )
        q = q.reshape(len(plan.slots), attn.num_heads, attn.head_size).contiguous()
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q,
            key_cache=kc,
            value_cache=vc,
            output=out,
            query_start_loc=plan.query_start_loc,
            seq_lens=plan.seq_lens,
            scale=impl.scale,
            causal=True,
            alibi_slopes=impl.alibi_slopes,
            sliding_window=-1,
            block_table=plan.block_table,
            softcap=impl.logits_soft_cap,
            scheduler_metadata=plan.scheduler_metadata,
            s_aux=impl.sinks,
        )
        return out.view(len(plan.slots), -1)

    def read(self, cache, slots):
        N = cache.shape[2]
        kview, vview = self._views(cache)  # [B, H, D, N], [B, H, N, D]
        b, o = slots // N, slots % N
        return kview[b, :, :, o].clone(), vview[b, :, o, :].clone()  # adv-index -> [n, H, D]


class ProbedCpuAttnLayout(CpuAttnLayout):
    """A CPU_ATTN ISA whose block packing is not hand-coded (e.g. `amx`): learnt from vLLM's own write op.

    Tokens are written through the op with values that encode, pass by pass, their position in the block,
    their head, their dim and K-vs-V (each code exact in bf16); where each element lands gives, per block,
    the flat index of every (token, head, dim) of K and of V. Reads gather and block writes scatter
    through those indices. Anything but a one-to-one placement is refused.
    """

    def __init__(self, isa: str) -> None:
        self.isa = isa
        self.name = f"cpu_attn/{isa} (probed)"
        self._maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _index(self, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat indices into one block (cache[b].view(-1)) of K and V.  # -> k_idx, v_idx: [N, H, D] int64"""
        _, H, N, C = cache.shape
        D = C // 2
        key = (cache.dtype, H, N, C)
        if key in self._maps:
            return self._maps[key]
        t, h, d = torch.meshgrid(torch.arange(N), torch.arange(H), torch.arange(D), indexing="ij")  # [N, H, D]
        codes = []
        # K and V get different codes in every pass but the last, so one write op places both.
        for kc, vc in ((t + 1, -(t + 1)), (h + 1, -(h + 1)), (d - D // 2, d - D // 2), (t * 0 + 1, t * 0 + 2)):
            scratch = torch.full((1, H, N, C), float("nan"), dtype=cache.dtype)
            super().write(scratch, torch.arange(N), kc.to(cache.dtype), vc.to(cache.dtype))
            codes.append(scratch.view(-1).float())
        ct, ch, cd, ckv = codes
        if not bool(torch.isfinite(ckv).all()):
            raise LayoutError(f"KV layout {self.name}: the cache op leaves block elements unwritten")
        out = []
        for which in (1.0, 2.0):
            sel = torch.nonzero(ckv == which).flatten()
            tt, hh, dd = ct[sel].abs() - 1, ch[sel].abs() - 1, cd[sel] + D // 2
            idx = torch.full((N, H, D), -1, dtype=torch.int64)
            idx[tt.long(), hh.long(), dd.long()] = sel
            if len(sel) != N * H * D or bool((idx < 0).any()):
                raise LayoutError(f"KV layout {self.name}: the cache op's packing is not a permutation")
            out.append(idx)
        self._maps[key] = out[0], out[1]
        return self._maps[key]

    def read(self, cache, slots):
        k_idx, v_idx = self._index(cache)
        N = cache.shape[2]
        flat = cache.view(cache.shape[0], -1)
        b, o = (slots // N)[:, None, None], slots % N
        return flat[b, k_idx[o]], flat[b, v_idx[o]]  # [n, H, D] each

    def _block_copies(self, cache: torch.Tensor):
        """(put, get) of one whole block's K and V as [N, H, D] tensors, through the probed indices."""
        k_idx, v_idx = self._index(cache)
        flat = cache.view(cache.shape[0], -1)

        def put(block: int, k: torch.Tensor, v: torch.Tensor) -> None:
            flat[block][k_idx] = k.to(cache.dtype)
            flat[block][v_idx] = v.to(cache.dtype)

        def get(block: int, k_out: torch.Tensor, v_out: torch.Tensor) -> None:
            k_out.copy_(flat[block][k_idx])
            v_out.copy_(flat[block][v_idx])

        return put, get


class FlashKernels(Protocol):
    """The two kernels the FlashAttention path calls: vLLM's own on CUDA (vllm_api.flash_kernels); tests
    and the device check pass others with the same documented semantics."""

    def cache_write(self, attn, k, v, key_cache, value_cache, slots) -> None:
        """Store k, v: [n, Hkv, D] at slots: [n] of the (B, N, Hkv, D) key/value page views."""

    def varlen(self, attn, q, key_cache, value_cache, out, plan: RunPlan) -> None:
        """out[i] = attention of q[i] ([n, Hq, D]) over keys [0, seq_lens[run]) of its run, read through
        the run's block table, causal mask bottom-right aligned (FlashAttention's varlen contract)."""


class FlashAttnLayout(KVLayout):
    """CUDA FlashAttention: logical [B, H, N, 2D] with K = [..., :D] and V = [..., D:]. Recomputed tokens
    attend through FlashAttention's varlen kernel over the pages, one call per layer for a whole batched
    link (the RunPlan's runs as kernel sequences); the plan is on the device before the layer loop, so the
    loop has no host syncs. NOT RUN ON A GPU HERE: tested on CPU tensors with a reference kernel."""

    name = "flash_attn"
    needs_buffers = False  # its kernel takes any recompute set inside the link's range

    def __init__(self, kernels: FlashKernels | None = None) -> None:
        self._kernels = kernels  # None: vLLM's own, looked up at the first link

    @property
    def kernels(self) -> FlashKernels:
        if self._kernels is None:
            self._kernels = vllm_api.flash_kernels()
        return self._kernels

    @staticmethod
    def pages(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """vLLM's own views of a layer's cache (do_kv_cache_update), strides of size-1 dims made canonical
        as vLLM does before FlashAttention (one KV head per rank: FA3's TMA needs 16-byte aligned strides).
        # -> key, value pages: [B, N, H, D]"""
        return tuple(canonical_strides(t) for t in cache.transpose(1, 2).split(cache.shape[3] // 2, dim=-1))

    def write(self, cache, slots, k, v) -> None:
        N, D = cache.shape[2], cache.shape[3] // 2
        b, o = slots // N, slots % N
        cache[b, :, o, :D] = k.to(cache.dtype)
        cache[b, :, o, D:] = v.to(cache.dtype)

    def read(self, cache, slots):
        N, D = cache.shape[2], cache.shape[3] // 2
        b, o = slots // N, slots % N
        return cache[b, :, o, :D], cache[b, :, o, D:]  # advanced indexing: copies already

    def self_check(self, like: torch.Tensor, attn: torch.nn.Module | None = None) -> None:
        """Beyond the read-back: vLLM's own kernels on a scratch cache of the real cache's dtype, device and
        strides (the real one may hold requests' KV under `vllm serve`): its cache write must store what this
        layout reads, this layout's writes must be what its varlen kernel attends over (against the reference
        kernel written from FlashAttention's contract). Catches an ABI, stride or layout surprise at start-up."""
        super().self_check(like)
        from ...testing.varlen import ReferenceFlashKernels

        _, H, N, C = like.shape
        D = C // 2
        scratch = torch.empty_strided((3, H, N, C), like.stride(), dtype=like.dtype, device=like.device)
        scratch.zero_()
        g = torch.Generator().manual_seed(4321)
        n = 2 * N - 3  # one request over two blocks, the second partly filled

        def rnd(*shape):
            return torch.randn(shape, generator=g).to(like.dtype).to(like.device)

        k, v = rnd(n, H, D), rnd(n, H, D)
        block_ids = [2, 0]
        slots = host_to_device(slots_for(block_ids, torch.arange(n), N), like.device)
        key_pages, value_pages = self.pages(scratch)
        attn = attn or _KernelCheckAttn(H, D)
        self.kernels.cache_write(attn, k[: n - 1], v[: n - 1], key_pages, value_pages, slots[: n - 1])
        self.write(scratch, slots[n - 1 :], k[n - 1 :], v[n - 1 :])
        rk, rv = self.read(scratch, slots)
        if not (torch.equal(rk, k) and torch.equal(rv, v)):
            raise LayoutError(f"KV layout {self.name}: vLLM's cache write and this layout disagree on the pages")
        R = torch.arange(n - 5, n)  # the last five positions attend over all n keys
        plan = RunPlan.build([(block_ids, R)], N).to(like.device)
        q = rnd(len(R), attn.num_heads, D)
        got, want = torch.empty_like(q), torch.empty_like(q)
        self.kernels.varlen(attn, q, key_pages, value_pages, got, plan)
        ReferenceFlashKernels().varlen(attn, q, key_pages, value_pages, want, plan)
        err = float((got.float() - want.float()).abs().max())
        if not err <= 4 * torch.finfo(like.dtype).eps * max(1.0, float(want.float().abs().max())):
            raise LayoutError(f"KV layout {self.name}: the varlen kernel over the pages is off by {err:.3g}")

    def can_attend(self, R, start, end):
        # Only positions this link owns may be written. Any number of runs: FlashAttention reads each run's
        # keys once per query tile, so CacheBlend's scattered picks (runs of one query) cost what a decode
        # step of that many sequences costs, and stay exact.
        return len(R) > 0 and int(R[0]) >= start and int(R[-1]) < end

    def attention_plan(self, cache, seqs, attn):
        return RunPlan.build(seqs, cache.shape[2]).to(cache.device)

    def attend(self, plan, attn, cache, q, k, v):
        H, D = attn.num_kv_heads, attn.head_size
        key_pages, value_pages = self.pages(cache)
        n = len(plan.slots)
        self.kernels.cache_write(attn, k.reshape(n, H, D), v.reshape(n, H, D), key_pages, value_pages, plan.slots)
        qh = q.reshape(n, attn.num_heads, D).contiguous()
        out = torch.empty_like(qh)
        self.kernels.varlen(attn, qh, key_pages, value_pages, out, plan)
        return out.view(n, -1)


class _KernelCheckAttn:
    """What the reference kernels read from an Attention module, for a self-check without the model's (two
    query heads per KV head)."""

    kv_cache_dtype = "auto"

    def __init__(self, num_kv_heads: int, head_size: int) -> None:
        self.num_heads, self.num_kv_heads, self.head_size = 2 * num_kv_heads, num_kv_heads, head_size
        self.impl = type("impl", (), {"scale": head_size**-0.5})()


def canonical_strides(t: torch.Tensor) -> torch.Tensor:
    """`t` with every size-1 dim given the stride it would have if contiguous beyond it (vLLM's
    canonicalize_singleton_dim_strides: PyTorch allows any stride there, CUDA TMA does not); a view, no copy."""
    if 1 not in t.shape:
        return t
    strides, prev = list(t.stride()), 1
    for i in range(t.dim() - 1, -1, -1):
        if t.shape[i] == 1:
            strides[i] = prev
        prev = strides[i] * t.shape[i]
    return t if strides == list(t.stride()) else t.as_strided(t.shape, strides)


def layout_for(attn_layer: torch.nn.Module) -> KVLayout:
    """Pick the accessor for a vLLM Attention module's backend, or raise LayoutError."""
    backend = vllm_api.attention_backend(attn_layer)
    if backend == "CPUAttentionBackendImpl":
        isa = getattr(attn_layer, "isa", "?")
        return CpuAttnLayout(isa) if isa in CpuAttnLayout.READABLE_ISAS else ProbedCpuAttnLayout(isa)
    if backend == "FlashAttentionImpl":
        return FlashAttnLayout()
    raise LayoutError(f"attention backend {backend} is not supported by the linker (supported: CPU_ATTN, FLASH_ATTN)")
