"""Re-rotate cached keys to their linked positions with the model's own rotary table.

A chunk compiled at positions b..b+T-1 is linked at p..p+T-1. For RoPE variants whose cos/sin table
is a fixed per-position rotation (default, linear, llama3, YaRN), R(p+t) = R(p-b) R(b+t), so every
key of the chunk is rotated by the same angle set at delta = p - b. YaRN scales cos/sin by mscale;
normalising each (cos, sin) pair to unit length keeps the delta a pure rotation. Done in fp32.
"""

from __future__ import annotations

import torch

from .. import vllm_api

# vLLM rotary classes with a static per-position table (delta rotation is exact). Dynamic-NTK,
# MRoPE, LongRoPE (switches tables with length) and dual-chunk variants are refused.
SHIFTABLE_ROPES = frozenset(
    {
        "RotaryEmbedding",
        "Llama3RotaryEmbedding",
        "LinearScalingRotaryEmbedding",
        "YaRNScalingRotaryEmbedding",
    }
)


class RopeError(RuntimeError):
    """The model's position encoding cannot be shifted exactly: refuse to link."""


class KeyRotator:
    """Rotates post-RoPE keys by a position delta. Built once per engine from one layer's rotary module."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        kind = type(rotary).__name__
        if kind not in SHIFTABLE_ROPES:
            raise RopeError(
                f"rotary embedding {kind} is not position-shiftable; supported: {', '.join(sorted(SHIFTABLE_ROPES))}"
            )
        self.rotary_dim = int(rotary.rotary_dim)
        self.is_neox = bool(rotary.is_neox_style)
        cos, sin = vllm_api.rotary_table(rotary).chunk(2, dim=-1)  # cos, sin: [P, rot/2]
        norm = torch.sqrt(cos * cos + sin * sin)
        self.cos, self.sin = cos / norm, sin / norm  # fp32, on the device the table was computed on (CPU)
        self.max_position = cos.shape[0]
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {self.cos.device: (self.cos, self.sin)}

    def tables(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The unit cos/sin tables (fp32, [P, rot/2] each) on `device`: copied there once, then kept, so
        rotating CUDA keys indexes a CUDA table instead of copying a CPU row to the GPU on every call."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device not in self._tables:
            self._tables[device] = (self.cos.to(device), self.sin.to(device))
        return self._tables[device]

    def check_shift(self, delta: int) -> None:
        """Raises RopeError unless keys can be rotated by `delta` positions."""
        if not abs(delta) < self.max_position:
            raise RopeError(f"position shift {delta} outside the rotary table (|shift| < {self.max_position})")

    def rotate(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """k: [..., T, H, D] post-RoPE keys -> the same keys rotated by `delta` positions (fp32)."""
        if delta == 0:
            return k.float()
        self.check_shift(delta)
        k = k.float()
        cos_t, sin_t = self.tables(k.device)
        # R(-d) = R(d) transposed: same cos, negated sin (a chunk compiled behind sink tokens may land at 0).
        cos, sin = cos_t[abs(delta)], sin_t[abs(delta)]  # [rot/2], on k's device
        if delta < 0:
            sin = -sin
        rot = self.rotary_dim
        x, rest = k[..., :rot], k[..., rot:]
        if self.is_neox:
            x1, x2 = x[..., : rot // 2], x[..., rot // 2 :]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def self_check(
    rotator: KeyRotator, rotary: torch.nn.Module, head_size: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """Keys rotated by the model's own rotary code at positions p..p+T-1 must equal keys rotated at 0..T-1
    and then shifted by p with `rotator`: the linker's whole premise, checked numerically at start-up."""
    g = torch.Generator().manual_seed(7)
    T, shift = 8, 1000 % rotator.max_position
    k = torch.randn((T, num_kv_heads, head_size), generator=g)  # k: [T, Hkv, D] pre-RoPE
    pos = torch.arange(T)
    at0 = vllm_api.rope_reference(rotary, pos, k)
    want = vllm_api.rope_reference(rotary, pos + shift, k)
    got = rotator.rotate(at0, shift)
    err = float((got - want).abs().max())
    # The model runs in `dtype` (its rotary code may round to it): allow a few of its roundings, far below
    # what a wrong rotation gives (errors of the keys' own size).
    if not err < max(1e-4, 8 * torch.finfo(dtype).eps) * max(1.0, float(want.abs().max())):
        raise RopeError(
            f"key re-rotation differs from the model's own RoPE by {err:.3g} "
            f"({type(rotary).__name__}): refusing to link"
        )
