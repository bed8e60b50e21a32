"""Re-rotate cached keys to their linked positions with the model's own rotary table.

A chunk compiled at positions b..b+T-1 is linked at p..p+T-1. For RoPE variants whose cos/sin table
is a fixed per-position rotation (default, linear, llama3, YaRN), R(p+t) = R(p-b) R(b+t), so every
key of the chunk is rotated by the same angle set at delta = p - b. YaRN scales cos/sin by mscale;
normalising each (cos, sin) pair to unit length keeps the delta a pure rotation. Done in fp32.
"""
from __future__ import annotations

import torch

# vLLM rotary classes with a static per-position table (delta rotation is exact). Dynamic-NTK,
# MRoPE, LongRoPE (switches tables with length) and dual-chunk variants are refused.
SHIFTABLE_ROPES = frozenset({
    "RotaryEmbedding", "Llama3RotaryEmbedding", "LinearScalingRotaryEmbedding",
    "YaRNScalingRotaryEmbedding",
})


class RopeError(RuntimeError):
    """The model's position encoding cannot be shifted exactly: refuse to link."""


class KeyRotator:
    """Rotates post-RoPE keys by a position delta. Built once per engine from one layer's rotary module."""

    def __init__(self, rotary: torch.nn.Module) -> None:
        kind = type(rotary).__name__
        if kind not in SHIFTABLE_ROPES:
            raise RopeError(f"rotary embedding {kind} is not position-shiftable; supported: "
                            f"{', '.join(sorted(SHIFTABLE_ROPES))}")
        self.rotary_dim = int(rotary.rotary_dim)
        self.is_neox = bool(rotary.is_neox_style)
        try:
            table = rotary._compute_cos_sin_cache()   # fp32 recompute of the model's own table
        except Exception:  # pragma: no cover - older layouts
            table = rotary.cos_sin_cache
        cos, sin = table.float().chunk(2, dim=-1)       # cos, sin: [P, rot/2]
        norm = torch.sqrt(cos * cos + sin * sin)
        self.cos, self.sin = cos / norm, sin / norm
        self.max_position = cos.shape[0]

    def rotate(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """k: [..., T, H, D] post-RoPE keys -> the same keys rotated by `delta` positions (fp32)."""
        if delta == 0:
            return k.float()
        if not 0 < delta < self.max_position:
            raise RopeError(f"position shift {delta} outside the rotary table (0..{self.max_position - 1})")
        cos, sin = self.cos[delta], self.sin[delta]     # [rot/2]
        k = k.float()
        rot = self.rotary_dim
        x, rest = k[..., :rot], k[..., rot:]
        if self.is_neox:
            x1, x2 = x[..., : rot // 2], x[..., rot // 2:]
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = x[..., 0::2], x[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
