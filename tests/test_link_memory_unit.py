"""The linker's workspace in the memory budget: its size, and on a GPU its share taken out of vLLM's."""

from __future__ import annotations

import json

import pytest
import torch

from epic_rag import EngineConfig
from epic_rag.engine import vllm_api
from epic_rag.engine.linker import Linker, to_device


@pytest.fixture
def llama8b_dir(tmp_path):
    # Llama-3-8B's shape: 32 layers, 32 query heads, 8 KV heads, hidden 4096 (head_dim 128)
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_workspace_bytes_count_k_and_v_of_every_layer_in_the_cache_dtype(llama8b_dir):
    per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads x 128 dims, bf16
    assert vllm_api.link_workspace_bytes(llama8b_dir, "bfloat16", 1000) == 1000 * per_token
    assert Linker.workspace_bytes(1000, 32, 8, 128, 4) == 2000 * per_token  # fp32: twice
    # under tensor parallelism a worker holds its share of the 8 KV heads (replicated past 8 workers)
    assert vllm_api.link_workspace_bytes(llama8b_dir, "bfloat16", 1000, 2) == 1000 * per_token // 2
    assert vllm_api.link_workspace_bytes(llama8b_dir, "bfloat16", 1000, 16) == 1000 * per_token // 8


def test_gpu_share_given_to_vllm_leaves_room_for_the_linker_workspace(llama8b_dir):
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.9)
    total = 141 * 2**30  # an H200
    ws = vllm_api.link_workspace_bytes(llama8b_dir, "bfloat16", 16384)  # 2 GiB
    share = vllm_api.gpu_memory_share(cfg, llama8b_dir, "bfloat16", 16384, total_bytes=total)
    assert share == pytest.approx(0.9 - ws / total)
    assert (0.9 - share) * total == pytest.approx(2 * 2**30)


def test_a_workspace_that_leaves_vllm_almost_nothing_is_refused(llama8b_dir):
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.3)
    with pytest.raises(ValueError, match="link_workspace_tokens"):
        vllm_api.gpu_memory_share(cfg, llama8b_dir, "bfloat16", 2**20, total_bytes=80 * 2**30)


def test_on_cpu_the_configured_share_is_kept():
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    cfg = EngineConfig(model="smollm2-135m-instruct", gpu_memory_utilization=0.3)
    assert vllm_api.gpu_memory_share(cfg, "/nonexistent", "float32", 16384) == 0.3


@pytest.mark.parametrize("tokens", [-1, 100, 1.5])
def test_a_workspace_smaller_than_one_prompt_or_not_an_int_is_refused(tokens):
    with pytest.raises(ValueError, match="link_workspace_tokens"):
        EngineConfig(model="smollm2-135m-instruct", max_model_len=2048, link_workspace_tokens=tokens)


def test_chunk_kv_already_on_the_linkers_device_is_used_in_place():
    t = torch.randn(2, 3)
    assert to_device(t, torch.device("cpu")) is t
