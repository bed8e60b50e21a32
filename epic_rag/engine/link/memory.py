"""The linker's memory in vLLM's budget: how many prompt tokens one link pass holds, what the linker allocates
for them on a GPU, and the share of GPU memory left for vLLM once that (and the store's gpu tier) is taken out.

Sized here, next to the linker, so that vllm_api (which starts vLLM) never imports the linker: the engine
computes the workspace and the share and hands both to vllm_api.new_llm_engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .. import vllm_api
from .linker import WORKSPACE_PROMPTS
from .stage import TritonFiller


def workspace_tokens(configured: int | None, max_model_len: int) -> int:
    """Prompt tokens one batched link pass holds: `configured` (EngineConfig.link_workspace_tokens, the
    connector's "workspace_tokens"), else WORKSPACE_PROMPTS whole prompts of `max_model_len` tokens."""
    return int(configured) if configured else WORKSPACE_PROMPTS * max_model_len


def link_device_bytes(model_dir: str, dtype: str, tokens: int, tensor_parallel_size: int = 1) -> int:
    """GPU memory one worker's linker allocates at attach for passes of `tokens` prompt tokens: the staging
    ring of its fused page filler and one layer of one prompt's K/V gathered from its pages (query-<r>'s
    probe). From the model's config.json (under tensor parallelism a worker holds its share of the KV heads, at
    least one: vLLM replicates them when there are fewer heads than workers)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = max(1, cfg.get("num_key_value_heads", heads) // tensor_parallel_size)
    dtype_bytes = getattr(torch, dtype).itemsize
    gather = 2 * tokens * kv_heads * head_size * dtype_bytes
    return TritonFiller.stage_bytes(tokens, kv_heads, head_size, dtype_bytes) + gather


def gpu_memory_share(
    config, model_dir: str, dtype: str, workspace_tokens: int, total_bytes: int | None = None
) -> float:
    """The fraction of GPU memory vLLM is told to use: the configured one less what the linker allocates after
    vLLM has sized its KV cache (its staging ring, and the store's gpu tier), so it is counted inside the
    configured share, not beside it. On CPU the configured value (it does not size the KV cache there:
    kv_cache_gib does)."""
    from ...store.spec import gpu_tier_bytes

    if total_bytes is None:
        if not torch.cuda.is_available():
            return config.gpu_memory_utilization
        total_bytes = vllm_api.device_total_memory()
    link = link_device_bytes(model_dir, dtype, workspace_tokens, config.tensor_parallel_size)
    tier = gpu_tier_bytes(config.store)
    share = config.gpu_memory_utilization - (link + tier) / total_bytes
    if share <= 0.05:
        raise ValueError(
            f"the linker's staging ({workspace_tokens} tokens) and the gpu tier ({tier} bytes) leave vLLM "
            f"{share:.0%} of the GPU's memory: lower link_workspace_tokens or the gpu tier's max_bytes, or raise "
            "gpu_memory_utilization"
        )
    return share
