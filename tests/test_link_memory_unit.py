"""The linker's memory in the budget: its size, and on a GPU its share (and the gpu tier's) taken out of vLLM's."""

from __future__ import annotations

import json

import pytest
import torch

from epic_rag import EngineConfig
from epic_rag.engine import vllm_api
from epic_rag.engine.link import memory as link_memory


@pytest.fixture
def llama8b_dir(tmp_path):
    # Llama-3-8B's shape: 32 layers, 32 query heads, 8 KV heads, hidden 4096 (head_dim 128)
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    cfg["max_position_embeddings"] = 8192
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_gpu_link_memory_is_a_few_layers_of_one_pass_in_the_cache_dtype_not_every_layer(llama8b_dir):
    per_row = 2 * 8 * 128 * 2  # K and V of one token of one layer: 8 heads x 128 dims, bf16
    m = link_memory.link_memory(llama8b_dir, "bfloat16", 1000)
    # two staging slots (one copied while the other is written) and one gather buffer (query-<r>'s probe)
    assert m.ring == 2 * 1000 * per_row and m.gather == 1000 * per_row
    # under tensor parallelism a worker holds its share of the 8 KV heads (replicated past 8 workers)
    m2, m16 = (link_memory.link_memory(llama8b_dir, "bfloat16", 1000, tp) for tp in (2, 16))
    assert (m2.ring, m2.gather) == (m.ring // 2, m.gather // 2) and m16.ring == m.ring // 8


def test_gpu_link_memory_counts_the_rope_tables_and_the_probes_temporaries_too(llama8b_dir):
    # N11: beside the ring and the gather buffer, the key rotator's fp32 cos/sin tables on the device (one row
    # of rot/2 each per position) and query-<r>'s probe temporaries of one layer: the prompt's K and V in fp32
    # and their copies in the cache dtype, and the fp32 scores and probabilities of its tail's query heads
    m = link_memory.link_memory(llama8b_dir, "bfloat16", 1000)
    assert m.rope == 2 * 8192 * 64 * 4  # 4 MiB at 8k positions; 64 MiB at 128k
    tail = link_memory.PROBE_TAIL
    rows = 1000 + tail
    assert m.probe == 2 * rows * 8 * 128 * (4 + 2) + 2 * 32 * tail * rows * 4
    assert m.total == m.ring + m.gather + m.rope + m.probe
    assert link_memory.link_device_bytes(llama8b_dir, "bfloat16", 1000) == m.total


def test_gpu_share_given_to_vllm_leaves_room_for_the_linker_staging_and_the_gpu_tier(llama8b_dir):
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.9, store="gpu?max_bytes=4G+memory")
    total = 141 * 2**30  # an H200
    link = link_memory.link_device_bytes(llama8b_dir, "bfloat16", 16384)  # 192 MiB of ring and buffer, and more
    share = link_memory.gpu_memory_share(cfg, llama8b_dir, "bfloat16", 16384, total_bytes=total)
    assert share == pytest.approx(0.9 - (link + 4 * 2**30) / total)
    assert (0.9 - share) * total == pytest.approx(4 * 2**30 + link) and link > 192 * 2**20


def test_a_staging_or_gpu_tier_that_leaves_vllm_almost_nothing_is_refused(llama8b_dir):
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.3)
    with pytest.raises(ValueError, match="link_workspace_tokens"):
        link_memory.gpu_memory_share(cfg, llama8b_dir, "bfloat16", 2**24, total_bytes=80 * 2**30)
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.3, store="gpu?max_bytes=30G")
    with pytest.raises(ValueError, match="gpu tier"):
        link_memory.gpu_memory_share(cfg, llama8b_dir, "bfloat16", 16384, total_bytes=80 * 2**30)


def test_the_gpus_memory_is_read_through_vllms_platform_not_a_cuda_context(llama8b_dir, monkeypatch):
    # A CUDA context made in the client process sits outside vLLM's accounting and forces spawned workers:
    # the total must come from vLLM's platform (NVML), never torch.cuda.
    def no_context(*a, **k):
        raise AssertionError("torch.cuda.get_device_properties creates a CUDA context")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_context)
    monkeypatch.setattr(vllm_api, "device_total_memory", lambda: 80 * 2**30)
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.9)
    share = link_memory.gpu_memory_share(cfg, llama8b_dir, "bfloat16", 16384)
    assert share == pytest.approx(0.9 - link_memory.link_device_bytes(llama8b_dir, "bfloat16", 16384) / (80 * 2**30))


def test_vllm_runs_eager_on_cpu_only_unless_configured(monkeypatch):
    # On a GPU, CUDA graphs and torch.compile stay on for every request's decode: the linker runs its own
    # layers eagerly and needs neither off.
    cfg = EngineConfig(model="smollm2-135m-instruct")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert vllm_api.eager(cfg) is True
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert vllm_api.eager(cfg) is False
    assert vllm_api.eager(EngineConfig(model="smollm2-135m-instruct", enforce_eager=True)) is True
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(model="smollm2-135m-instruct", enforce_eager="yes")


def test_on_cpu_the_configured_share_is_kept():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.3)
    assert link_memory.gpu_memory_share(cfg, "/nonexistent", "float32", 16384) == 0.3


@pytest.mark.parametrize("tokens", [-1, 100, 1.5])
def test_a_workspace_smaller_than_one_prompt_or_not_an_int_is_refused(tokens):
    with pytest.raises(ValueError, match="link_workspace_tokens"):
        EngineConfig(model="smollm2-135m-instruct", max_model_len=2048, link_workspace_tokens=tokens)
