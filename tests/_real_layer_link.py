"""Run by test_link_layer_ops.py in a process of its own (vLLM's distributed state: one rank over gloo): the tiny
model's decoder layers as vLLM builds them (LlamaDecoderLayer: QKV/O/MLP linears, RMSNorm, RotaryEmbedding,
SiluAndMul), under the settings of vLLM's compile mode on CUDA (custom ops "none", IR ops at `native`, IR ops
wrapped as torch ops), linked by the Linker with the fused filler (Triton's interpreter) and FlashAttention's two
kernels counted as one launch each. Prints one JSON line: per layer, the ops dispatched and the ops a GPU
would launch, with the link's kernel switch (vllm_api.link_kernels) and without it. vLLM's C norms are
available on this CPU build (torch.ops._C.rms_norm); their IR provider is marked CUDA-only, so it is marked
available here, as it is on a GPU.

    python tests/_real_layer_link.py TINY_MODEL_DIR
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's epic_rag


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Inner(torch.nn.Module):
    def __init__(self, layers, table) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)
        self.table = table

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table[ids % len(self.table)]


class _Model(torch.nn.Module):
    def __init__(self, layers, table) -> None:
        super().__init__()
        self.model = _Inner(layers, table)


class _CountedKernels:
    """FlashAttention's cache write and varlen kernel: one launch each, counted (no values: counts only)."""

    counter = None

    def cache_write(self, attn, k, v, key_cache, value_cache, slots) -> None:
        if self.counter is not None and not self.counter.paused:
            self.counter.ops.append("kernel:cache_write")

    def varlen(self, attn, q, key_cache, value_cache, out, plan) -> None:
        if self.counter is not None and not self.counter.paused:
            self.counter.ops.append("kernel:varlen")


def build(model_dir: str):
    import vllm.kernels  # noqa: F401  (the IR ops' providers)
    from vllm import ir
    from vllm.config import CompilationConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.ir.op import IrOp
    from vllm.model_executor.models.llama import LlamaDecoderLayer

    mc = ModelConfig(model=model_dir, dtype="float32")
    cfg = VllmConfig(model_config=mc, compilation_config=CompilationConfig(mode=3, custom_ops=["none"]))
    with set_current_vllm_config(cfg):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, "gloo")
        initialize_model_parallel(1, 1)
        hf = mc.hf_config
        layers = [LlamaDecoderLayer(cfg, prefix=f"model.layers.{i}") for i in range(hf.num_hidden_layers)]
    g = torch.Generator().manual_seed(0)
    for layer in layers:
        for p in layer.parameters():
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
        for m in layer.modules():  # what weight loading does (vLLM's CPU GEMM dispatch is set up here)
            qm = getattr(m, "quant_method", None)
            if qm is not None and hasattr(qm, "process_weights_after_loading"):
                qm.process_weights_after_loading(m)
    for name in ("rms_norm", "fused_add_rms_norm"):  # CUDA's compile-mode defaults, C kernels available
        op = IrOp.registry[name]
        op.impls["vllm_c"].supported = True
        op.set_default(["native"])
    ir.set_default_torch_wrap(True)
    table = torch.randn(1024, hf.hidden_size, generator=g) * 0.5
    return cfg, _Model(layers, table), hf


def count(model_dir: str) -> dict:
    from epic_rag.engine import vllm_api
    from epic_rag.engine.jobs import LinkJob, LinkSpan
    from epic_rag.engine.link import kernels
    from epic_rag.engine.link import linker as lk
    from epic_rag.engine.link.layout import FlashAttnLayout
    from epic_rag.engine.link.rope import KeyRotator
    from epic_rag.policy import parse_policy
    from epic_rag.store import ChunkKV
    from epic_rag.testing.dispatch_count import OpCounter

    cfg, model, hf = build(model_dir)
    layers = list(model.model.layers)
    L, HK, D, N = len(layers), hf.num_key_value_heads, hf.head_dim, 16
    attn = layers[0].self_attn.attn
    chunks, n, glue = 4, 40, 5
    g = torch.Generator().manual_seed(1)
    spans = []
    for c in range(chunks):
        kv = ChunkKV(f"c{c}", list(range(n + 1)), *(torch.randn(L, n + 1, HK, D, generator=g) for _ in range(2)), 4)
        spans.append(LinkSpan(glue + c * n, kv.slice(1)))
    T = glue + chunks * n + 7
    launch = kernels.fill_pages
    out = {}
    for name, switch in (("compile_defaults", False), ("link_kernels", True)):
        caches = {
            f"model.layers.{i}.self_attn.attn": torch.zeros(-(-T // N) + 1, N, HK, 2 * D).permute(0, 2, 1, 3)
            for i in range(L)
        }
        ln = lk.Linker(
            model=model,
            kv_caches=caches,
            layout=FlashAttnLayout(_CountedKernels()),
            rotator=KeyRotator(attn_rotary(layers[0])),
            block_size=N,
            workspace_tokens=T,
            fused=True,
            layer_kernels=vllm_api.link_kernels(layers, cfg) if switch else vllm_api.LayerKernels(),
        )
        job = LinkJob(list(range(T)), list(spans), parse_policy("legolink-16"))
        p, _ = ln.begin([lk.LinkLoad(job, list(range(-(-T // N))), 0, T)])
        counter = OpCounter()

        def one_launch(*a, _c=counter, **k):  # a Triton launch: no torch op on a GPU (the interpreter runs numpy)
            _c.paused = True
            try:
                launch(*a, **k)
            finally:
                _c.paused = False
            _c.ops.append("triton:fill_pages")

        kernels.fill_pages, _CountedKernels.counter = one_launch, counter
        try:
            with counter:
                assert ln.advance(p) and job.error is None, job.error
        finally:
            kernels.fill_pages, _CountedKernels.counter = launch, None
        out[name] = {
            "ops_per_layer": len(counter.ops) / L,
            "launches_per_layer": len(counter.launches()) / L,
            "syncs": counter.syncs,
            "launches": counter.launches(),
        }
    out["layers"] = L
    out["attention_backend"] = type(attn.impl).__name__
    return out


def attn_rotary(layer):
    return layer.self_attn.rotary_emb


if __name__ == "__main__":
    print("RESULT " + json.dumps(count(sys.argv[1])), flush=True)
