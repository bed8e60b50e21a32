"""A model shaped like vLLM's decoder stack (model.model.layers[i].self_attn.{attn, rotary_emb}), for running
the linker without vLLM: unit tests on CPU, and scripts/device_check.py on a GPU machine that has torch only.

Each decoder layer is `layer(positions, hidden, residual) -> (hidden, residual)`, as vLLM's are, and calls its
`self_attn.attn(q, k, v)` (which the linker swaps for its shim). Two forms:
- gemms=False (tests): q, k, v are slices of the hidden state, the next hidden state mixes the attention output
  back in; cheap, deterministic, and every layer's attention changes what later layers see;
- gemms=True (timings): the recompute's real matrix shapes (QKV, O, gated MLP), one weight set shared by every
  layer (the GEMMs' cost is what matters, as in ../shared/device/gpu_probe.py);
- gemms=True, mix=True (timings): the GEMMs and the rest of a Llama layer's ops as vLLM runs them: RMS norms
  (the second, and the first past layer 0, fused with the residual add), RoPE on q and k, the residual carried
  to the next layer, SiLU-and-mul. Torch's ops stand in for vLLM's C kernels (a norm is one fused kernel in
  both; torch's RoPE is ~9 kernels where vLLM's is one): launches per layer are an upper bound of the engine's.
"""

from __future__ import annotations

import math

import torch


class RotaryEmbedding(torch.nn.Module):
    """The fields KeyRotator reads (accepted by class name), with a plain RoPE table."""

    def __init__(self, head_size: int, rotary_dim: int | None = None, neox: bool = True, theta: float = 10000.0):
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox_style = head_size, rotary_dim or head_size, neox
        self.theta, self.max_position = theta, 32768

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv = 1.0 / (self.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        f = torch.outer(torch.arange(self.max_position, dtype=torch.float), inv)
        return torch.cat((f.cos(), f.sin()), dim=-1)  # [P, rot]


class Attention(torch.nn.Module):
    """Named as vLLM's (vllm_api.find_attention matches the class name); never called while the linker's shim
    stands in for it."""

    def __init__(self, li: int, num_heads: int, num_kv_heads: int, head_size: int) -> None:
        super().__init__()
        self.layer_name = f"model.layers.{li}.self_attn.attn"
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.impl = type("FlashAttentionImpl", (), {"scale": head_size**-0.5})()
        self.kv_cache_dtype = "auto"

    def forward(self, q, k, v):  # pragma: no cover - the linker always swaps it out
        raise RuntimeError("the stub model's attention runs only through the linker's shim")


class _SelfAttn(torch.nn.Module):
    def __init__(self, li: int, hq: int, hk: int, d: int, rotary: torch.nn.Module) -> None:
        super().__init__()
        self.attn = Attention(li, hq, hk, d)
        self.rotary_emb = rotary


class _Layer(torch.nn.Module):
    def __init__(self, model: StubModel, li: int) -> None:
        super().__init__()
        self.self_attn = _SelfAttn(li, model.hq, model.hk, model.d, model.rotary)
        self._m = (model,)  # not a submodule: one weight set for every layer

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None):
        m = self._m[0]
        hq, hk = m.hq * m.d, m.hk * m.d
        if m.weights is None:
            q, k, v = h[:, :hq], h[:, hq : hq + hk], h[:, hq + hk :]
            o = self.self_attn.attn(q, k, v)  # [n, hq]
            return torch.cat([0.5 * (q + o), k * 0.9 + o[:, :hk] * 0.1, v], dim=-1), h
        w = m.weights
        if m.mix:
            return self._mixed(positions, h, residual)
        q, k, v = (h @ w["qkv"]).split([hq, hk, hk], dim=-1)
        x = self.self_attn.attn(q.contiguous(), k.contiguous(), v.contiguous()) @ w["o"]
        gu = x @ w["gu"]
        ff = gu.shape[-1] // 2
        return (torch.nn.functional.silu(gu[:, :ff]) * gu[:, ff:]) @ w["down"], h

    def _mixed(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None):
        """vLLM's LlamaDecoderLayer.forward, with torch's ops.  # h, residual: [n, hidden]"""
        m, w, F = self._m[0], self._m[0].weights, torch.nn.functional
        hidden = h.shape[-1]
        residual = h if residual is None else h + residual
        x = F.rms_norm(residual, (hidden,), w["norm"], 1e-5)
        qkv = x @ w["qkv"]  # [n, (Hq + 2 Hkv) D]
        n, H = qkv.shape[0], m.hq + m.hk
        qk = qkv[:, : H * m.d].view(n, H, m.d)  # q's and k's heads, rotated together (NeoX pairs)
        cos, sin = m.rope_cos[positions][:, None], m.rope_sin[positions][:, None]  # [n, 1, D/2]
        x1, x2 = qk[..., : m.d // 2], qk[..., m.d // 2 :]
        qk = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).view(n, H * m.d)
        q, k = qk[:, : m.hq * m.d], qk[:, m.hq * m.d :]
        v = qkv[:, H * m.d :]
        o = self.self_attn.attn(q, k, v.contiguous()) @ w["o"]
        residual = o + residual
        x = F.rms_norm(residual, (hidden,), w["norm"], 1e-5)
        gu = x @ w["gu"]
        ff = gu.shape[-1] // 2
        return (F.silu(gu[:, :ff]) * gu[:, ff:]) @ w["down"], residual


class _Inner(torch.nn.Module):
    def __init__(self, model: StubModel, num_layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(model, li) for li in range(num_layers)])
        self._m = (model,)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        table = self._m[0].table
        return table[ids % len(table)]


class StubModel(torch.nn.Module):
    """model.model.layers[...] as vLLM builds it; hidden width (Hq + 2 Hkv) * D without GEMMs."""

    def __init__(
        self,
        num_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        gemms: bool = False,
        hidden: int = 4096,
        ffn: int = 14336,
        rotary: torch.nn.Module | None = None,
        seed: int = 0,
        mix: bool = False,
    ) -> None:
        super().__init__()
        self.hq, self.hk, self.d, self.mix = num_heads, num_kv_heads, head_size, mix and gemms
        self.rotary = rotary or RotaryEmbedding(head_size)
        g = torch.Generator().manual_seed(seed)
        width = hidden if gemms else (num_heads + 2 * num_kv_heads) * head_size
        self.table = (torch.randn((1024, width), generator=g) * 0.5).to(dtype).to(device)
        self.weights = None
        if gemms:
            s = 1 / math.sqrt(hidden)
            qkv = (num_heads + 2 * num_kv_heads) * head_size
            shapes = {"qkv": (hidden, qkv), "o": (num_heads * head_size, hidden), "gu": (hidden, 2 * ffn)}
            shapes["down"] = (ffn, hidden)
            self.weights = {
                n: (torch.randn(shape, generator=g) * s).to(dtype).to(device) for n, shape in shapes.items()
            }
            self.weights["norm"] = torch.ones(hidden, dtype=dtype, device=device)
            cos, sin = self.rotary._compute_cos_sin_cache().chunk(2, dim=-1)  # [P, D/2] each
            self.rope_cos, self.rope_sin = cos.to(dtype).to(device), sin.to(dtype).to(device)
        self.model = _Inner(self, num_layers)
