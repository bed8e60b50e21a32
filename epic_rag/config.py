"""EngineConfig: what an EpicEngine runs (model, default policy, store, dtype, sizes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .models import DEFAULT_MODEL
from .policy import DEFAULT_POLICY, parse_policy

if TYPE_CHECKING:
    from .store import ChunkStore


@dataclass(slots=True)
class EngineConfig:
    """What an EpicEngine runs; every field is checked when the config is made (ValueError naming it).

    Attributes:
        model: a packaged model name (`epic-rag models`), a local Hugging Face model folder or a Hugging Face
            model id ("Qwen/Qwen2.5-7B-Instruct", fetched into huggingface_hub's cache). The default is
            the demo's model, Qwen2.5-Coder-0.5B-Instruct (`models.DEFAULT_MODEL`); the tests name
            SmolLM2-135M-Instruct explicitly.
        policy: the default link policy (policy.parse_policy); each request may name another.
        store: a chunk store spec (store.open_store, e.g. "memory+disk:/path") or an open ChunkStore.
        dtype: "auto" (fp32 on CPUs without native bf16, bf16 on GPUs), "float32", "bfloat16" or "float16".
        max_model_len: the context window, in tokens.
        max_num_seqs: requests vLLM runs at once.
        kv_cache_gib: CPU: vLLM's paged KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB).
        gpu_memory_utilization: the share of the GPU's memory vLLM may take (on CPU: of the NUMA node's RAM);
            on a GPU the linker's staging and the store's gpu tier are taken out of it.
        max_num_batched_tokens: tokens vLLM schedules in one step.
        link_workspace_tokens: prompt tokens one batched link pass holds, summed over its requests (the
            linker's buffers on CPU, its staging ring on a GPU, allocated once). 0: twice max_model_len.
        async_links: links load asynchronously: a linking request waits while its link runs a few layers
            after each step's forward, for at most link_step_share x that forward's time, so running requests'
            decodes are delayed by a bounded share; a step with nothing else to run links to the end. False:
            each link runs whole inside the step that first schedules its request. Tensor parallelism always
            links synchronously.
        link_step_share: see async_links (>= 0).
        seed: vLLM's seed.
        compile_lead: what every chunk is compiled behind: "template" (the default prompt up to its first
            document) or "sink" (the sink token alone: EPIC's reference compile, [BOS] + chunk from position
            0). Part of the keys.
        heap_trim_s: under load the engine thread hands freed heap memory back to the OS (glibc malloc_trim)
            at most this often, and once after work when idle; 0 turns it off (engine/heap.py).
        multiprocess: run vLLM's engine core (scheduler, model, linker) in its own process, as `vllm serve`
            does: the caller's threads then never share a GIL with the forward. Needs `store` as a spec string
            (the core opens it).
        tensor_parallel_size: shard the model over this many workers (vLLM's tensor parallelism; each rank
            stores and links its own KV heads). Workers are separate processes: `store` must be a spec string.
        enforce_eager: vLLM without torch.compile and CUDA graphs. None: on CPU only (what runs there); on a
            GPU graphs stay on for every request's decode (the linker runs its layers eagerly itself).
    """

    model: str = DEFAULT_MODEL
    policy: str = DEFAULT_POLICY
    store: "str | ChunkStore" = "memory"
    dtype: str = "auto"
    max_model_len: int = 8192
    max_num_seqs: int = 16
    kv_cache_gib: int = 2
    gpu_memory_utilization: float = 0.3
    max_num_batched_tokens: int = 4096
    link_workspace_tokens: int = 0
    async_links: bool = True
    link_step_share: float = 1.0
    seed: int = 0
    compile_lead: str = "template"
    heap_trim_s: float = 10.0
    multiprocess: bool = False
    tensor_parallel_size: int = 1
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        parse_policy(self.policy)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.compile_lead not in ("template", "sink"):
            raise ValueError(f"compile_lead must be 'template' or 'sink', got {self.compile_lead!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not isinstance(self.heap_trim_s, (int, float)) or not self.heap_trim_s >= 0:
            raise ValueError(f"heap_trim_s must be a number of seconds >= 0, got {self.heap_trim_s!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true, false or None, got {self.enforce_eager!r}")
        if not isinstance(self.async_links, bool):
            raise ValueError(f"async_links must be true or false, got {self.async_links!r}")
        share = self.link_step_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not share >= 0:
            raise ValueError(f"link_step_share must be a number >= 0, got {self.link_step_share!r}")
        if not isinstance(self.link_workspace_tokens, int) or self.link_workspace_tokens < 0:
            raise ValueError(f"link_workspace_tokens must be an int >= 0, got {self.link_workspace_tokens!r}")
        if 0 < self.link_workspace_tokens < self.max_model_len:
            raise ValueError("link_workspace_tokens must hold one whole prompt: at least max_model_len")
        if self.max_model_len < 16:
            raise ValueError("max_model_len must be at least 16")
