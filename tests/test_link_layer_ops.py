"""What a GPU would pay per layer of a link, the decoder layer's own ops included (issue 33, N1): vLLM's real
LlamaDecoderLayer (tiny model) under the compile mode's settings on CUDA, linked in a process of its own
(_real_layer_link.py). With the link's kernel switch (vllm_api.link_kernels) the norms, RoPE and the residual
adds are vLLM's C kernels: at most 15 launches a layer, the fill, the GEMMs and FlashAttention's two kernels
included; without it the layer's native ops cost several times that."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _engine_process import ROOT, environment, result

pytestmark = pytest.mark.slow  # a model process of its own (vLLM's distributed state)

TARGET = 15  # launches per layer of a link where vLLM's C kernels exist (issue 33)


def test_a_link_layer_costs_at_most_15_launches_with_vllms_c_kernels_and_no_host_sync(tiny_model_dir):
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "_real_layer_link.py"), str(tiny_model_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environment(TRITON_INTERPRET="1"),
        timeout=600,
    )
    r = result(p.returncode, p.stdout, p.stderr)
    fast, slow = r["link_kernels"], r["compile_defaults"]
    assert fast["syncs"] == [] and slow["syncs"] == []
    assert fast["launches_per_layer"] <= TARGET, fast["launches"]
    # vLLM's C kernels ran: one kernel per norm and per RoPE call, no native norm or rotation left
    launches = fast["launches"]
    L = r["layers"]
    assert launches.count("_C.rotary_embedding.default") == L
    assert sum(op.startswith("_C.") and "rms_norm" in op for op in launches) == 2 * L
    assert not any(op in launches for op in ("aten.rsqrt.default", "aten.pow.Tensor_Scalar", "aten.cat.default"))
    # the compile mode's native ops, left as they are, cost several times that
    assert slow["launches_per_layer"] >= 2.5 * fast["launches_per_layer"], slow["launches"]
