"""The linker's memory in vLLM's budget: how many prompt tokens one link pass holds, what the linker allocates
for them on a GPU, and the share of GPU memory left for vLLM once that (and the store's gpu tier) is taken out.

Sized here, next to the linker, so that vllm_api (which starts vLLM) never imports the linker: the engine
computes the workspace and the share and hands both to vllm_api.new_llm_engine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import vllm_api
from .linker import WORKSPACE_PROMPTS
from .stage import TritonFiller


def workspace_tokens(configured: int | None, max_model_len: int) -> int:
    """Prompt tokens one batched link pass holds: `configured` (EngineConfig.link_workspace_tokens, the
    connector's "workspace_tokens"), else WORKSPACE_PROMPTS whole prompts of `max_model_len` tokens."""
    return int(configured) if configured else WORKSPACE_PROMPTS * max_model_len


# query-<r>'s probe: tail tokens (question and template after the claim) its scores are sized for; a longer
# tail takes more, for one layer at a time
PROBE_TAIL = 256


@dataclass(frozen=True, slots=True)
class LinkMemory:
    """GPU memory one worker's linker takes for passes of `tokens` prompt tokens, in bytes."""

    ring: int  # the fused filler's staging ring: two slots of one layer of a pass's rows (allocated at attach)
    gather: int  # one layer of one prompt's K/V gathered from its pages (buffer path, query-<r>'s probe)
    rope: int  # the key rotator's unit cos/sin tables on the device, fp32 (copied there at the first link)
    probe: int  # query-<r>'s probe temporaries for one layer (fp32 K/V of the prompt, its tail's scores)

    @property
    def total(self) -> int:
        return self.ring + self.gather + self.rope + self.probe


def link_memory(model_dir: str, dtype: str, tokens: int, tensor_parallel_size: int = 1) -> LinkMemory:
    """What one worker's linker takes on the GPU for passes of `tokens` prompt tokens, from the model's
    config.json (under tensor parallelism a worker holds its share of the KV heads, at least one: vLLM
    replicates them when there are fewer heads than workers, and its share of the query heads)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = max(1, cfg.get("num_key_value_heads", heads) // tensor_parallel_size)
    q_heads = max(1, heads // tensor_parallel_size)
    dtype_bytes = getattr(torch, dtype).itemsize
    rot = int(head_size * cfg.get("partial_rotary_factor", 1.0))
    rows = tokens + PROBE_TAIL
    return LinkMemory(
        ring=TritonFiller.stage_bytes(tokens, kv_heads, head_size, dtype_bytes),
        gather=2 * tokens * kv_heads * head_size * dtype_bytes,
        rope=2 * _rope_positions(cfg) * (rot // 2) * 4,
        # K and V of the prompt and the tail in fp32, their concatenations in the cache dtype; scores and
        # probabilities of the tail's query heads over them
        probe=2 * rows * kv_heads * head_size * (4 + dtype_bytes) + 2 * q_heads * PROBE_TAIL * rows * 4,
    )


def _rope_positions(cfg: dict) -> int:
    """Rows of the model's rotary table: vLLM's linear and YaRN scalings extend it by their factor."""
    n = int(cfg.get("max_position_embeddings", 2048))
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type")
    return int(n * scaling.get("factor", 1.0)) if kind in ("linear", "yarn") else n


def link_device_bytes(model_dir: str, dtype: str, tokens: int, tensor_parallel_size: int = 1) -> int:
    """GPU memory one worker's linker takes for passes of `tokens` prompt tokens (link_memory's total)."""
    return link_memory(model_dir, dtype, tokens, tensor_parallel_size).total


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
