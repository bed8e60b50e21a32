"""Every place epic_rag touches vLLM 0.32, in one module: re-check these on a vLLM upgrade.

Public API (stable across releases), used through the functions below:
- `EngineArgs`, `KVTransferConfig`, `LLMEngine.from_engine_args` (new_llm_engine); `SamplingParams`,
  `TokensPrompt` (request_inputs); `LLMEngine.add_request / step / abort_request /
  has_unfinished_requests` (runtime.py, on the object new_llm_engine returns).
- `KVConnectorBase_V1` and `KVConnectorMetadata` (connector.py subclasses them; hooks documented there).
- `StructuredOutputsParams` (request_inputs: response_format) and `vllm.exceptions.VLLMValidationError`
  (refused_request_error: a request vLLM refuses when added).

Internals (read from vLLM 0.32.0's source; nothing guarantees them):
- decoder layers are called `layer(positions, hidden_states, residual) -> (hidden_states, residual)`
  (decoder_layer_forward); during a link their CustomOps' `_forward_method` (set by `dispatch_forward`) is
  switched to the platform's `forward_cuda`/`forward_cpu`, and the IR ops' priority (`IrOp.registry`,
  `set_priority`, `get_priority`, `impls`) and torch-op wrapping (`ir.enable_torch_wrap`) are scoped to
  vLLM's C kernels (link_kernels: what `enforce_eager` gives, whatever the compile mode). Layers hold one
  `Attention` module with `.impl`, `.layer_name`, `num_heads`,
  `num_kv_heads`, `head_size` (find_attention); support.py reads the settings it refuses from that module
  (`kv_cache_dtype`, `head_size_v`, `sliding_window`, `has_sink`, `kv_sharing_target_layer_name`) and from
  its `.impl` (`logits_soft_cap`, `alibi_slopes`, `sinks`, `sliding_window`): a renamed attribute there
  reads as "not set" and silently lets the configuration through;
- rotary modules expose `_compute_cos_sin_cache()`, `cos_sin_cache`, `rotary_dim`, `is_neox_style` and a
  pure-torch static `forward_static(positions, query, key, head_size, rotary_dim, cache, is_neox)`
  (rotary_table, rope_reference);
- the CPU attention backend's ops `cpu_attn_reshape_and_cache`, `cpu_attention_with_kv_cache`,
  `cpu_attn_get_scheduler_metadata` and `envs.VLLM_CPU_ATTN_SPLIT_KV`; backend impl class names
  `CPUAttentionBackendImpl` / `FlashAttentionImpl` and the layer's `isa` (layout.py via cpu_ops);
- CUDA only (not run here): `fa_utils.reshape_and_cache_flash` / `flash_attn_varlen_func` with the layer's
  `kv_cache_dtype`, `_k_scale`, `_v_scale` and `impl.vllm_flash_attn_version` (flash_kernels);
- the scheduler's `kv_cache_manager.get_blocks(req_id).get_block_ids()` and `SchedulerOutput`'s
  `scheduled_new_reqs`, `scheduled_cached_reqs`, `num_scheduled_tokens` (scheduled_steps, block_ids_of);
- a request's prefix-cache hashes: `Request.block_hashes` (one per full block of `hash_block_size` tokens,
  chained over the prefix) and `Request._block_hasher`, `KVCacheConfig.hash_block_size`, and the scheduler
  calling the connector's `on_new_request` before the request's first look-up (scope_block_hashes);
- `get_kv_transfer_group()` and `worker.model_runner.get_model()` (worker_model, kv_connector); the model
  runner (V1: its `initialize_kv_cache`) or its `ActiveKVConnector` (Model Runner V2, CUDA's default) calling
  the connector's `register_kv_caches` (calling_model_runner, how the connector finds the model under `vllm
  serve`);
- `get_tensor_model_parallel_rank/world_size`, `tensor_model_parallel_all_reduce` and the group's host
  side `get_tp_group().cpu_group` (tp_rank_size, tp_all_reduce, tp_any): ranks agree on what a link
  recomputes, so their decoder layers' collectives stay in step;
- `current_platform.get_device_total_memory()` (NVML on CUDA: device_total_memory);
- `KVConnectorWorkerMetadata` and the order of `Scheduler.update_from_output`: a step's finished requests are
  freed (request_finished) before its connector output is read (update_connector_output);
- asynchronous loads: a request waits in WAITING_FOR_REMOTE_KVS, with no step scheduling anything for it,
  until `get_finished` names it, failed blocks reported no later than that step (async links); the model
  runner calls `bind_connector_metadata` before the forward and `start_load_kv` after it when the step has no
  synchronous load, and in steps with no forward too (the link's time budget); an in-process LLMEngine's
  `engine_core.engine_core.scheduler.has_requests()` (has_work).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

CONNECTOR_MODULE = "epic_rag.engine.connector"
ONEDNN_PRIMITIVE_CACHE = 128  # oneDNN's global primitive cache in vLLM's CPU ops (see prepare_process)


def _cpu_has_fast_bf16() -> bool:
    """vLLM's CPU bf16 kernels are fast only with AMX; with AVX-512/AVX2 bf16 measured ~4x slower than fp32."""
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "amx_bf16" in flags


def prepare_process(config) -> str:
    """Set the process environment vLLM reads at start-up; returns the dtype to run (config.dtype or, for
    "auto", fp32 on CPUs without native bf16 and bf16 elsewhere)."""
    # vLLM's engine core in this process or its own (the connector works in both: stores.py)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if config.multiprocess else "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(config.kv_cache_gib))
        # vLLM's CPU linear layers run oneDNN matmuls, one primitive per batch size (tokens in the step), kept
        # in vLLM's own cache (32 per weight shape) and also in oneDNN's global cache, whose default of 1024
        # primitives (~330 KiB each for SmolLM2's shapes) fills as new batch sizes appear: RSS grew by
        # hundreds of MiB over a soak without levelling off in 5 minutes. Read when vLLM creates its first
        # primitive (while the model loads); a miss costs ~1 ms of JIT.
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_PRIMITIVE_CACHE))
    if config.dtype != "auto":
        return config.dtype
    return "bfloat16" if (not on_cpu or _cpu_has_fast_bf16()) else "float32"


def new_llm_engine(
    model_dir: str, dtype: str, config, extra: dict[str, Any], workspace_tokens: int, gpu_share: float
) -> Any:
    """vLLM's LLMEngine with EpicConnector as its KV connector (`extra`: its stores, see stores.py; link passes of
    `workspace_tokens` prompt tokens) and the worker extension mixed in, given `gpu_share` of the GPU's memory
    (link/memory.py sizes both)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model_dir,
        dtype=dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enforce_eager=eager(config),
        enable_prefix_caching=True,
        seed=config.seed,
        tensor_parallel_size=config.tensor_parallel_size,
        gpu_memory_utilization=gpu_share,
        kv_transfer_config=KVTransferConfig(
            kv_connector="EpicConnector",
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            kv_connector_extra_config={
                "workspace_tokens": workspace_tokens,
                "async_links": config.async_links,
                "link_step_share": config.link_step_share,
                **extra,
            },
        ),
        worker_extension_cls=f"{CONNECTOR_MODULE}.EpicWorkerExtension",
    )
    return LLMEngine.from_engine_args(args)


def eager(config) -> bool:
    """Whether vLLM runs without torch.compile and CUDA graphs: config.enforce_eager, or by default on CPU
    only (what runs and is tested there). The linker needs neither off: it calls decoder layers itself,
    eagerly, and its attention swap is never seen by graphs (they dispatch attention by layer name)."""
    if config.enforce_eager is not None:
        return bool(config.enforce_eager)
    return not torch.cuda.is_available()


def has_work(llm) -> bool:
    """Whether the engine must keep stepping: a request unfinished, or (in-process) one the scheduler still
    holds after it finished, e.g. aborted while its asynchronous link runs (its blocks are released when the
    link reports done, in a later step). A core in its own process steps by itself for those."""
    if llm.has_unfinished_requests():
        return True
    core = getattr(getattr(llm, "engine_core", None), "engine_core", None)  # InprocClient -> EngineCore
    scheduler = getattr(core, "scheduler", None)
    return scheduler is not None and scheduler.has_requests()


def shutdown_engine(llm) -> None:
    """Tear vLLM's engine core down now (in-process: its executor, workers and scheduler; its own process: that
    process, joined), once nothing steps it any more. Idempotent (vLLM detaches its finalizer on the first call);
    a failure is logged, never raised into a shutdown."""
    try:
        llm.engine_core.shutdown()
    except Exception:
        log.warning("vLLM's engine core did not shut down cleanly", exc_info=True)


def device_total_memory() -> int:
    """The GPU's memory in bytes, read through NVML by vLLM's platform: no CUDA context in this process (a
    context made here would sit outside vLLM's memory accounting and force spawned workers)."""
    from vllm.platforms import current_platform

    return int(current_platform.get_device_total_memory())


def request_inputs(
    prompt_ids: list[int],
    salt: str,
    max_tokens: int,
    temperature: float,
    stop: list[str] | str | None,
    seed: int | None,
    kv_params: dict | None,
    **options: Any,
) -> tuple[Any, Any]:
    """(prompt, params) for LLMEngine.add_request: streamed as deltas, epic params in kv_transfer_params.
    `options`: further SamplingParams fields (top_p, top_k, min_p, penalties, logprobs), already checked, and
    `response_format` (epic_rag.sampling.check_response_format), made vLLM's structured outputs here."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    extra = {"kv_transfer_params": kv_params} if kv_params else None
    fmt = options.pop("response_format", None)
    if fmt is not None:  # grammar-constrained decoding (vLLM's default backend, xgrammar, runs on CPU too)
        so = (
            StructuredOutputsParams(json=fmt["json_schema"]["schema"])
            if fmt["type"] == "json_schema"
            else StructuredOutputsParams(json_object=True)
        )
        options["structured_outputs"] = so
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        stop=stop,
        seed=seed,
        output_kind=RequestOutputKind.DELTA,
        extra_args=extra,
        **options,
    )
    return TokensPrompt(prompt_token_ids=list(prompt_ids), cache_salt=salt), params


def refused_request_error() -> type[Exception]:
    """vLLM's error for a request it refuses when added (e.g. a JSON schema neither xgrammar nor guidance
    compiles); not a ValueError, so the engine re-raises it as one (bad input)."""
    from vllm.exceptions import VLLMValidationError

    return VLLMValidationError


def token_logprobs(step_logprobs, token_ids: list[int], decode) -> list[dict] | None:
    """One delta's sample logprobs (vLLM: per position a {token_id: Logprob(logprob, rank, decoded_token)}
    holding the chosen token and the top-k) as epic_rag's TokenLogprob dicts, best alternative first."""
    if step_logprobs is None:
        return None

    def text(tid: int, lp) -> str:
        return lp.decoded_token if lp is not None and lp.decoded_token is not None else decode([tid])

    out = []
    for tid, pos in zip(token_ids, step_logprobs):
        pos = dict(pos or {})
        chosen = pos.get(tid)
        ranked = sorted(
            (item for item in pos.items() if item[1].rank is not None and item[1].rank >= 1), key=lambda i: i[1].rank
        )
        top = [{"token_id": t, "token": text(t, lp), "logprob": float(lp.logprob)} for t, lp in ranked]
        out.append(
            {
                "token_id": tid,
                "token": text(tid, chosen),
                "logprob": float(chosen.logprob) if chosen is not None else float("nan"),
                "top_logprobs": top,
            }
        )
    return out


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """This worker's decoder layers (a pipeline stage holds a slice)."""
    inner = model.model
    layers = list(inner.layers)
    return layers[inner.start_layer : inner.end_layer] if hasattr(inner, "start_layer") else layers


def embed_fn(model: torch.nn.Module):
    inner = model.model
    return getattr(inner, "embed_input_ids", None) or inner.embed_tokens


def decoder_layer_forward(
    layer: torch.nn.Module, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on the hidden states of `positions` only.  # hidden: [n, hidden]"""
    return layer(positions, hidden, residual)


@dataclass(frozen=True, slots=True)
class LayerKernels:
    """vLLM's own kernels for the decoder-layer calls a link makes (link_kernels): the CustomOp modules of the
    layers whose forward is switched to the platform's kernel (forward_cuda on CUDA, forward_cpu on a CPU) for
    the duration of a pass, and the IR ops (RMS norms) whose priority puts vLLM's C kernels first."""

    custom_ops: tuple[torch.nn.Module, ...] = ()
    ir_ops: tuple[Any, ...] = ()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Within: each module runs its platform kernel and each IR op its C kernel where the platform has one
        (the IR op's own `set_priority`, with vLLM's torch-op wrapping off as in eager mode); on exit, every
        module's and op's previous choice is back, exception or not."""
        if not self.custom_ops and not self.ir_ops:
            yield
            return
        from vllm import ir

        saved = [(m, m.__dict__.get("_forward_method")) for m in self.custom_ops]
        with contextlib.ExitStack() as stack:
            for op in self.ir_ops:
                stack.enter_context(op.set_priority(_eager_priority(op)))
            stack.enter_context(ir.enable_torch_wrap(False))
            try:
                for m, _ in saved:
                    m._forward_method = _platform_forward(m)
                yield
            finally:
                for m, before in saved:
                    if before is None:
                        m.__dict__.pop("_forward_method", None)
                    else:
                        m._forward_method = before


def _eager_priority(op) -> list[str]:
    """An IR op's priority as vLLM sets it without Inductor (platforms/cuda.py: vllm_c, then native), keeping
    any provider the configuration put first (e.g. oink); providers the platform lacks are skipped by
    set_priority itself."""
    current = [p for p in op.get_priority() if p != "native"]
    return current + [p for p in ("vllm_c",) if p in op.impls and p not in current] + ["native"]


def _platform_forward(module: torch.nn.Module):
    """The forward vLLM's CustomOp.dispatch_forward picks for an enabled op on this platform."""
    from vllm.platforms import current_platform as cp

    if cp.is_rocm():
        return module.forward_hip
    if cp.is_cpu():
        return module.forward_cpu
    if cp.is_tpu():
        return module.forward_tpu
    if cp.is_xpu():
        return module.forward_xpu
    if cp.is_out_of_tree():
        return module.forward_oot
    return module.forward_cuda


def link_kernels(layers: list[torch.nn.Module], vllm_config) -> LayerKernels:
    """What to switch so that a link's eager decoder-layer calls run vLLM's C/CUDA kernels whatever the compile
    mode. Under torch.compile (vLLM's default on CUDA) the CustomOps are disabled (`custom_ops=["none"]`: their
    forward is the native PyTorch one, or a torch.compile of it) and the IR ops run `native`: Inductor fuses them
    inside the compiled model, but the link calls the layers eagerly, outside it, where each runs as ~10-17
    separate PyTorch kernels (~50 launches a layer instead of ~13). Ops the configuration disabled by name
    (`-rms_norm` in `vllm_config`'s custom_ops) are left alone. Nothing to switch where the layers are not
    vLLM's (vLLM never imported: the stub model of tests and device scripts)."""
    if "vllm" not in sys.modules:
        return LayerKernels()
    from vllm.ir.op import IrOp
    from vllm.model_executor.custom_op import CustomOp
    from vllm.platforms import current_platform

    current_platform.import_ir_kernels()  # the IR ops' providers (a worker has them already)
    disabled = {s[1:] for s in vllm_config.compilation_config.custom_ops if s.startswith("-")}
    mods, seen = [], set()
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, CustomOp) and id(m) not in seen and getattr(type(m), "name", None) not in disabled:
                seen.add(id(m))
                if _has_platform_kernel(m):
                    mods.append(m)
    return LayerKernels(tuple(mods), tuple(IrOp.registry.values()))


def _has_platform_kernel(module: torch.nn.Module) -> bool:
    """Whether the op's class has its own kernel for this platform (CustomOp's forward_cuda raises, its
    forward_cpu is the native one: nothing to switch to)."""
    from vllm.model_executor.custom_op import CustomOp

    name = _platform_forward(module).__name__
    return getattr(type(module), name) is not getattr(CustomOp, name)


def find_attention(layer: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.Module]:
    """(parent, attribute name, module) of the vLLM Attention inside a decoder layer."""
    for name, mod in layer.named_modules():
        if type(mod).__name__ == "Attention" and hasattr(mod, "impl"):
            parent_name, _, attr = name.rpartition(".")
            return layer.get_submodule(parent_name), attr, mod
    raise RuntimeError(f"no vLLM Attention module in {type(layer).__name__}")


def rotary_of(layer: torch.nn.Module) -> torch.nn.Module | None:
    return getattr(getattr(layer, "self_attn", None), "rotary_emb", None)


def rotary_table(rotary: torch.nn.Module) -> torch.Tensor:
    """The model's own cos||sin table, recomputed in fp32.  # -> [max_position, rotary_dim]"""
    try:
        return rotary._compute_cos_sin_cache().float()
    except Exception:  # pragma: no cover - older layouts
        return rotary.cos_sin_cache.float()


def rope_reference(rotary: torch.nn.Module, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keys rotated by the model's own rotary code at `positions` (pure torch), leaving the module as it was:
    its forward_native would re-assign the cos/sin buffer every layer shares to k's device and dtype, under
    the feet of compiled graphs that captured its address.  # k: [T, H, D] -> [T, H, D]"""
    T, H, D = k.shape
    q = torch.zeros((T, D), dtype=k.dtype, device=k.device)  # one dummy query head
    table = rotary.cos_sin_cache.to(device=k.device, dtype=k.dtype)  # a copy where they differ
    _, out = type(rotary).forward_static(
        positions, q, k.reshape(T, H * D).clone(), D, rotary.rotary_dim, table, rotary.is_neox_style
    )
    return out.view(T, H, D)


def attention_backend(attn: torch.nn.Module) -> str:
    return type(getattr(attn, "impl", None)).__name__


def cpu_ops():
    """vLLM's custom op namespace (CPU attention cache write, kernel, scheduler metadata)."""
    from vllm import _custom_ops as ops

    return ops


class _VllmFlashKernels:
    """vLLM's CUDA cache write and FlashAttention varlen kernel, called the way its FlashAttentionImpl calls
    them (the layer's own kv_cache_dtype, scales and FA version). NOT RUN ON A GPU HERE."""

    def __init__(self) -> None:
        from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, reshape_and_cache_flash

        self._write, self._varlen = reshape_and_cache_flash, flash_attn_varlen_func

    def cache_write(self, attn, k, v, key_cache, value_cache, slots) -> None:
        self._write(k, v, key_cache, value_cache, slots, attn.kv_cache_dtype, attn._k_scale, attn._v_scale)

    def varlen(self, attn, q, key_cache, value_cache, out, plan) -> None:
        impl = attn.impl
        self._varlen(
            q=q,
            k=key_cache,
            v=value_cache,
            out=out,
            cu_seqlens_q=plan.query_start_loc,
            max_seqlen_q=plan.max_query_len,
            seqused_k=plan.seq_lens,
            max_seqlen_k=plan.max_seq_len,
            softmax_scale=impl.scale,
            causal=True,
            block_table=plan.block_table,
            fa_version=impl.vllm_flash_attn_version,
        )


def flash_kernels() -> _VllmFlashKernels:
    """vLLM's FlashAttention kernels (CUDA builds only)."""
    return _VllmFlashKernels()


def cpu_attn_split_kv() -> bool:
    import vllm.envs as envs

    return bool(envs.VLLM_CPU_ATTN_SPLIT_KV)


def scheduled_steps(scheduler_output) -> list[tuple[str, int]]:
    """(request id, tokens computed before this step) of every request scheduled in this step."""
    steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
    cached = scheduler_output.scheduled_cached_reqs
    return steps + list(zip(cached.req_ids, cached.num_computed_tokens))


def hash_block_size(kv_cache_config, block_size: int) -> int:
    """Tokens per entry of a request's `block_hashes`: the KV cache config's `hash_block_size` (set by the engine
    core before the scheduler's requests arrive), the block size where it is unset (one KV cache group)."""
    return int(getattr(kv_cache_config, "hash_block_size", None) or block_size)


def scope_block_hashes(request, first: int, scope: bytes) -> None:
    """Move a request's prefix-cache hashes from hash block `first` on into `scope`: those blocks are then cached
    and looked up under hashes that no exact prompt has, and the blocks computed after them (their hashes chain
    from these) too. vLLM's `Request.block_hashes` (hashes of the full blocks so far, each chained over the whole
    token prefix) and its `_block_hasher` (extends them as tokens are added) are rewritten; called before the
    request's first prefix-cache look-up (the connector's `on_new_request`)."""
    import hashlib

    def scoped(h: bytes) -> bytes:
        return hashlib.sha256(scope + bytes(h)).digest()

    hashes = request.block_hashes
    for j in range(first, len(hashes)):
        hashes[j] = scoped(hashes[j])
    inner = request._block_hasher
    if inner is None:  # no prefix caching: nothing is cached
        return

    def hasher(req) -> list[bytes]:  # holds no reference to the request (vLLM avoids that cycle too)
        n = len(req.block_hashes)
        return [scoped(h) if n + i >= first else h for i, h in enumerate(inner(req))]

    request._block_hasher = hasher


def block_ids_of(kv_cache_manager, req_id: str) -> list[int]:
    return list(kv_cache_manager.get_blocks(req_id).get_block_ids()[0])


def kv_connector():
    """This worker's KV connector instance."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()


def worker_model(worker) -> torch.nn.Module:
    return worker.model_runner.get_model()


def tp_rank_size() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the group's size."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


def tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum of a device tensor over the tensor-parallel group (every rank must call it, in the same order)."""
    from vllm.distributed.communication_op import tensor_model_parallel_all_reduce

    return tensor_model_parallel_all_reduce(t)


def tp_any(flags: list[bool]) -> list[bool]:
    """Per position, whether any tensor-parallel rank set the flag (every rank must call it, in the same
    order). Host values over the group's host side (gloo): no device tensor, no device sync; vLLM's device
    all-reduce would refuse a host tensor on CUDA."""
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    t = torch.tensor(flags, dtype=torch.int32)
    dist.all_reduce(t, group=get_tp_group().cpu_group)
    return (t > 0).tolist()


def calling_model_runner(depth: int = 2, search: int = 8) -> Any | None:
    """The model runner on whose behalf the connector hook this is called from runs (register_kv_caches):
    vLLM hands connectors the KV caches but never the model, and `vllm serve` makes no worker-extension call
    to hand it over. The first caller, from `depth` frames up and at most `search` frames further, whose
    `self` has get_model(): the V1 runner calls the hook itself (initialize_kv_cache); Model Runner V2 (vLLM's
    default on CUDA with Triton) calls it from its ActiveKVConnector, which the runner builds. None where no
    such caller is found."""
    import sys

    frame = sys._getframe(depth)
    for _ in range(search):
        if frame is None:
            break
        runner = frame.f_locals.get("self")
        if callable(getattr(runner, "get_model", None)):
            return runner
        frame = frame.f_back
    return None


def worker_fingerprint(vllm_config, kv_dtype: torch.dtype) -> str:
    """The fingerprint chunk keys carry (keys.kv_fingerprint), computed on the worker from what vLLM loaded:
    the model folder, its tokenizer (read with transformers, as vLLM does) and the KV cache's dtype. A server
    started on a Hugging Face id (`vllm serve Qwen/...`) keeps the id: its snapshot folder is found in the hub's
    cache, where vLLM downloaded it."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from ..keys import kv_fingerprint
    from ..models import model_fingerprint, resolve_model, tokenizer_fingerprint

    mc = vllm_config.model_config
    tok = AutoTokenizer.from_pretrained(mc.tokenizer or mc.model, trust_remote_code=False)
    folder = Path(mc.model) if Path(mc.model).is_dir() else resolve_model(mc.model)
    return kv_fingerprint(model_fingerprint(folder), tokenizer_fingerprint(tok), str(kv_dtype))
