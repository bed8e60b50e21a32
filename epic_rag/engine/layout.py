"""Accessors for vLLM's paged KV cache, one per attention backend, each self-checked at start-up.

vLLM hands each attention layer one cache tensor with the logical shape [B, H, N, 2*D]
(B blocks, H kv heads, N tokens per block, K then V content). How those bytes are laid out differs:

- CPU_ATTN (vLLM's CPU backend): per (block, head) a K region then a V region, and K is stored
  *transposed* as [D, N] while V is [N, D]. Reading the last dim as K||V gives garbage. Writes go
  through vLLM's own `cpu_attn_reshape_and_cache` op, which knows each ISA's packing; reads use the
  known `vec`/`vec16` packing and are verified against that op at start-up.
- FLASH_ATTN (CUDA): the logical view holds K = cache[..., :D], V = cache[..., D:] (strided views;
  `transpose(1, 2).split(D, -1)` in vLLM). NOT RUN ON A GPU HERE: its logic is tested on CPU tensors.

A token at position t of a request lives in slot block_ids[t // N] * N + t % N.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LayoutError(RuntimeError):
    """The paged KV layout is unknown or failed its self-check: refuse to serve."""


def slots_for(block_ids: list[int] | torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat slot index of each position of one request.  # positions: [n] -> slots: [n] int64"""
    bids = torch.as_tensor(block_ids, dtype=torch.int64)
    return bids[positions // block_size] * block_size + positions % block_size


class KVLayout(ABC):
    name: str = "?"

    @abstractmethod
    def write(self, cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: [n, H, D] at slots: [n] (int64). Mutates `cache` in place."""

    @abstractmethod
    def read(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return copies of k, v: [n, H, D] at slots: [n]."""

    def write_range(self, cache: torch.Tensor, block_ids: list[int], start: int, end: int,
                    k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v: [end-start, H, D] for request positions [start, end). Mutates `cache`."""
        self.write(cache, slots_for(block_ids, torch.arange(start, end), cache.shape[2]).to(cache.device), k, v)

    def read_range(self, cache: torch.Tensor, block_ids: list[int], start: int,
                   end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of k, v: [end-start, H, D] for request positions [start, end)."""
        return self.read(cache, slots_for(block_ids, torch.arange(start, end), cache.shape[2]).to(cache.device))

    def self_check(self, like: torch.Tensor) -> None:
        """Write random K/V into a scratch cache shaped like `like` ([B, H, N, 2D]) and read it back."""
        _, H, N, C = like.shape
        scratch = torch.zeros((3, H, N, C), dtype=like.dtype, device=like.device)
        g = torch.Generator().manual_seed(1234)
        slots = torch.tensor([N + 1, 2 * N + N - 1, N, 2 * N + 3], dtype=torch.int64, device=like.device)
        k = torch.randn((len(slots), H, C // 2), generator=g).to(like.dtype).to(like.device)
        v = torch.randn((len(slots), H, C // 2), generator=g).to(like.dtype).to(like.device)
        self.write(scratch, slots, k, v)
        rk, rv = self.read(scratch, slots)
        if not (torch.equal(rk, k) and torch.equal(rv, v)):
            raise LayoutError(f"KV layout {self.name} failed its read-back self-check for "
                              f"dtype {like.dtype}, H={H}, N={N}, D={C // 2}: refusing to serve linked KV")
        if scratch[0].abs().sum() != 0:
            raise LayoutError(f"KV layout {self.name} wrote outside the addressed blocks")


class CpuAttnLayout(KVLayout):
    """vLLM CPU_ATTN, ISAs `vec` and `vec16`: per (block, head) K as [D, N] then V as [N, D]."""

    READABLE_ISAS = ("vec", "vec16")

    def __init__(self, isa: str) -> None:
        if isa not in self.READABLE_ISAS:
            raise LayoutError(f"CPU attention ISA {isa!r} packs KV in a way epic_rag cannot read yet "
                              f"(supported: {', '.join(self.READABLE_ISAS)})")
        self.isa = isa
        self.name = f"cpu_attn/{isa}"

    @staticmethod
    def _views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, H, N, C = cache.shape
        D = C // 2
        flat = cache.view(B, H, 2 * N * D)
        return flat[:, :, : N * D].view(B, H, D, N), flat[:, :, N * D:].view(B, H, N, D)

    def write(self, cache, slots, k, v) -> None:
        from vllm import _custom_ops as ops

        B, H, N, C = cache.shape
        kc, vc = cache.view(B, H, 2 * N, C // 2).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(k.to(cache.dtype).contiguous(), v.to(cache.dtype).contiguous(), kc, vc,
                                       slots.to(torch.int64), self.isa, 1.0, 1.0, "auto")

    def write_range(self, cache, block_ids, start, end, k, v) -> None:
        # Whole blocks as one strided copy each way (3x faster than the scatter op for 4k tokens); the
        # partial blocks at either end through vLLM's op. The self-check proves both paths agree.
        N = cache.shape[2]
        first_full = -(-start // N)              # first block index fully inside [start, end)
        last_full = end // N                     # one past the last full block
        if last_full - first_full < 1:
            return super().write_range(cache, block_ids, start, end, k, v)
        lo, hi = first_full * N, last_full * N
        if start < lo:
            super().write_range(cache, block_ids, start, lo, k[: lo - start], v[: lo - start])
        if hi < end:
            super().write_range(cache, block_ids, hi, end, k[hi - start:], v[hi - start:])
        nb, H, D = last_full - first_full, k.shape[1], k.shape[2]
        bt = torch.as_tensor(block_ids[first_full:last_full], dtype=torch.int64, device=cache.device)
        kview, vview = self._views(cache)
        kk = k[lo - start: hi - start].to(cache.dtype).reshape(nb, N, H, D)
        vv = v[lo - start: hi - start].to(cache.dtype).reshape(nb, N, H, D)
        kview[bt] = kk.permute(0, 2, 3, 1)       # K blocks are [H, D, N]
        vview[bt] = vv.permute(0, 2, 1, 3)       # V blocks are [H, N, D]

    def read_range(self, cache, block_ids, start, end):
        # Whole blocks as one strided gather each (advanced indexing per token was ~15x slower).
        N = cache.shape[2]
        first_full, last_full = -(-start // N), end // N
        if last_full - first_full < 1:
            return super().read_range(cache, block_ids, start, end)
        lo, hi = first_full * N, last_full * N
        bt = torch.as_tensor(block_ids[first_full:last_full], dtype=torch.int64, device=cache.device)
        kview, vview = self._views(cache)
        H, D = cache.shape[1], cache.shape[3] // 2
        ks = [kview[bt].permute(0, 3, 1, 2).reshape(-1, H, D)]        # [nb, H, D, N] -> [nb*N, H, D]
        vs = [vview[bt].permute(0, 2, 1, 3).reshape(-1, H, D)]        # [nb, H, N, D] -> [nb*N, H, D]
        if start < lo:
            k0, v0 = super().read_range(cache, block_ids, start, lo)
            ks.insert(0, k0)
            vs.insert(0, v0)
        if hi < end:
            k1, v1 = super().read_range(cache, block_ids, hi, end)
            ks.append(k1)
            vs.append(v1)
        return torch.cat(ks), torch.cat(vs)

    def self_check(self, like: torch.Tensor) -> None:
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

    def read(self, cache, slots):
        N = cache.shape[2]
        kview, vview = self._views(cache)          # [B, H, D, N], [B, H, N, D]
        b, o = slots // N, slots % N
        return kview[b, :, :, o].clone(), vview[b, :, o, :].clone()   # adv-index -> [n, H, D]


class FlashAttnLayout(KVLayout):
    """CUDA FlashAttention: logical [B, H, N, 2D] with K = [..., :D] and V = [..., D:]."""

    name = "flash_attn"

    def write(self, cache, slots, k, v) -> None:
        N, D = cache.shape[2], cache.shape[3] // 2
        b, o = slots // N, slots % N
        cache[b, :, o, :D] = k.to(cache.dtype)
        cache[b, :, o, D:] = v.to(cache.dtype)

    def read(self, cache, slots):
        N, D = cache.shape[2], cache.shape[3] // 2
        b, o = slots // N, slots % N
        return cache[b, :, o, :D].clone(), cache[b, :, o, D:].clone()


def layout_for(attn_layer: torch.nn.Module) -> KVLayout:
    """Pick the accessor for a vLLM Attention module's backend, or raise LayoutError."""
    backend = type(getattr(attn_layer, "impl", None)).__name__
    if backend == "CPUAttentionBackendImpl":
        return CpuAttnLayout(getattr(attn_layer, "isa", "?"))
    if backend == "FlashAttentionImpl":
        return FlashAttnLayout()
    raise LayoutError(f"attention backend {backend} is not supported by the linker "
                      "(supported: CPU_ATTN, FLASH_ATTN)")
