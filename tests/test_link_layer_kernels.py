"""A link's decoder-layer calls run vLLM's C/CUDA kernels whatever vLLM's compile mode (issue 33, N1), and the
previous choice is back after the pass: vLLM's real CustomOps (RMSNorm, RotaryEmbedding, SiluAndMul) built
under the compile mode's settings (`custom_ops=["none"]`, IR ops at `native`), their implementations wrapped
with counters. The whole layer's op count in a link is in test_link_layer_ops.py."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch

from epic_rag.engine import vllm_api

H, HEADS, D = 64, 2, 32  # hidden, heads, head size


@pytest.fixture
def ran(monkeypatch):
    """Counts, by name, which implementation of each op ran: the CustomOps' forward_native / forward_cpu and the
    IR norms' native / vllm_c providers; vLLM's C norm made available on this CPU (its CPU build has
    torch.ops._C.rms_norm; the provider is marked CUDA-only) and the IR ops at the compile mode's `native`."""
    import vllm.kernels  # noqa: F401  (registers the IR ops' providers, as a worker does)
    from vllm import ir
    from vllm.ir.op import IrOp
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    seen = Counter()

    def counted(label, fn):
        @functools.wraps(fn)
        def run(*a, **k):
            seen[label] += 1
            return fn(*a, **k)

        return run

    for cls, names in ((RotaryEmbedding, ("forward_native", "forward_cpu")), (SiluAndMul, ("forward_cpu",))):
        for name in names:
            monkeypatch.setattr(cls, name, counted(f"{cls.__name__}.{name}", cls.__dict__[name]))
    # SiluAndMul.forward_native is a staticmethod: wrapped as one
    native_silu = SiluAndMul.__dict__["forward_native"].__func__
    monkeypatch.setattr(SiluAndMul, "forward_native", staticmethod(counted("SiluAndMul.forward_native", native_silu)))
    for name in ("rms_norm", "fused_add_rms_norm"):
        op = IrOp.registry[name]
        for provider in ("native", "vllm_c"):
            impl = op.impls[provider]
            monkeypatch.setattr(impl, "impl_fn", counted(f"{name}.{provider}", impl.impl_fn))
        monkeypatch.setattr(op.impls["vllm_c"], "supported", True)
        monkeypatch.setattr(op, "_priority_impls", [op.impls["native"]])  # the compile mode's default
    monkeypatch.setattr(ir.op, "_ENABLE_TORCH_WRAP", True)  # vLLM's compile mode wraps IR ops as torch ops
    return seen


class _Layer(torch.nn.Module):
    """The op mix of a Llama layer without its GEMMs: norm, RoPE on q and k, residual norm, SiluAndMul."""

    def __init__(self, custom_ops: list[str]) -> None:
        super().__init__()
        from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        self.cfg = VllmConfig(compilation_config=CompilationConfig(mode=3, custom_ops=custom_ops))
        with set_current_vllm_config(self.cfg):
            self.norm1, self.norm2 = RMSNorm(H), RMSNorm(H)
            self.rotary = RotaryEmbedding(D, D, 4096, 10000.0, True, torch.float32)
            self.act = SiluAndMul()

    def forward(self, positions, h, residual):
        h, residual = (self.norm1(h), h) if residual is None else self.norm1(h, residual)
        q, k = self.rotary(positions, h.clone(), h.clone())
        h, residual = self.norm2(q + k, residual)
        return self.act(torch.cat([h, h], dim=-1)), residual


def _run(layer):
    g = torch.Generator().manual_seed(0)
    h, pos = torch.randn(5, H, generator=g), torch.arange(5)
    with torch.inference_mode():
        out, res = layer(pos, h, None)
        return layer(pos, out, res)


def test_a_link_runs_vllms_c_kernels_under_the_compile_modes_native_ops_and_switches_back(ran):
    from vllm import ir
    from vllm.ir.op import IrOp

    layer = _Layer(["none"])
    before = {n: m.__dict__["_forward_method"] for n, m in layer.named_children()}
    assert "forward_native" in str(before["rotary"])  # the compile mode's choice
    want = _run(layer)
    # two calls: RoPE twice, the plain norm once (no residual yet), the residual norm three times
    assert ran["RotaryEmbedding.forward_native"] == 2 and ran["rms_norm.native"] == 1
    assert ran["fused_add_rms_norm.native"] == 3

    kernels = vllm_api.link_kernels([layer], layer.cfg)
    # on a CPU: RoPE's C kernel (and its nested ApplyRotaryEmb), SiluAndMul's CPU forward (native on x86); the
    # norms through their IR ops
    assert {type(m).__name__ for m in kernels.custom_ops} == {"RotaryEmbedding", "ApplyRotaryEmb", "SiluAndMul"}
    ran.clear()
    with kernels.active():
        got = _run(layer)
        assert not ir.op._ENABLE_TORCH_WRAP  # eager mode's dispatch: no torch-op layer
    assert ran["RotaryEmbedding.forward_cpu"] == 2 and ran["RotaryEmbedding.forward_native"] == 0
    assert ran["rms_norm.vllm_c"] == 1 and ran["fused_add_rms_norm.vllm_c"] == 3
    assert ran["rms_norm.native"] == ran["fused_add_rms_norm.native"] == 0
    for a, b in zip(got, want):  # the same numbers, up to the kernels' rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)

    # switched back: the same bound methods, the compile mode's priority, IR ops wrapped again
    assert all(m.__dict__["_forward_method"] is before[n] for n, m in layer.named_children())
    assert IrOp.registry["rms_norm"].get_priority() == ["native"] and ir.op._ENABLE_TORCH_WRAP
    ran.clear()
    _run(layer)
    assert ran["RotaryEmbedding.forward_native"] == 2 and ran["rms_norm.native"] == 1 and not ran["rms_norm.vllm_c"]


def test_the_switch_is_undone_when_the_pass_raises(ran):
    from vllm.ir.op import IrOp

    layer = _Layer(["none"])
    before = layer.rotary.__dict__["_forward_method"]
    with pytest.raises(RuntimeError, match="mid-pass"), vllm_api.link_kernels([layer], layer.cfg).active():
        raise RuntimeError("mid-pass")
    assert layer.rotary.__dict__["_forward_method"] is before
    assert IrOp.registry["fused_add_rms_norm"].get_priority() == ["native"]


def test_an_op_the_configuration_disables_by_name_is_left_to_it(ran):
    layer = _Layer(["none", "-rotary_embedding"])
    names = {type(m).__name__ for m in vllm_api.link_kernels([layer], layer.cfg).custom_ops}
    assert "RotaryEmbedding" not in names and "SiluAndMul" in names


def test_on_cuda_the_switch_picks_each_ops_cuda_forward(ran, monkeypatch):
    from vllm.platforms import current_platform

    layer = _Layer(["none"])
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    kernels = vllm_api.link_kernels([layer], layer.cfg)
    # every op with a CUDA kernel of its own: RMSNorm (through its IR op), RoPE, SiluAndMul
    want = {"RMSNorm", "RotaryEmbedding", "ApplyRotaryEmb", "SiluAndMul"}
    assert {type(m).__name__ for m in kernels.custom_ops} == want
    assert all(vllm_api._platform_forward(m).__name__ == "forward_cuda" for m in kernels.custom_ops)


def test_the_stub_model_without_vllm_has_nothing_to_switch(monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    k = vllm_api.link_kernels([torch.nn.Linear(2, 2)], None)
    assert k.custom_ops == () and k.ir_ops == ()
    with k.active():
        pass
