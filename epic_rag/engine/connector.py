"""EpicConnector: LegoLink as an out-of-tree vLLM V1 KV connector, plus the worker extension.

vLLM builds one instance per role. Scheduler-side hooks (get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, request_finished) run in the scheduler, once per step;
what they decide reaches the worker only through the EpicMeta they build. Worker-side hooks
(register_kv_caches, start_load_kv, wait_for_save, ...) run in the model runner around each forward.

- A request whose params carry {"epic": {"link": job_id, "claim": n}} has its first n prompt tokens
  claimed as externally computed; `start_load_kv` fills their pages with the linker before the forward,
  and vLLM computes the rest (question, template tail).
- A request carrying {"epic": {"capture": cap_id}} is a compile: `wait_for_save` copies its freshly
  computed KV out of the paged cache after the forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
)

from . import rope, vllm_api
from .board import BOARD
from .layout import layout_for
from .linker import WORKSPACE_PROMPTS, Linker, LinkLoad
from .support import check_supported

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadSpec:
    req_id: str
    job_id: str
    block_ids: list[int]
    start: int
    end: int


@dataclass(slots=True)
class CaptureSpec:
    req_id: str
    cap_id: str
    block_ids: list[int]
    start: int
    end: int


@dataclass
class EpicMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)


@dataclass(slots=True)
class _ReqState:
    params: dict[str, Any]
    num_prompt: int
    n_ext: int
    load_pending: bool


def _epic_params(request) -> dict[str, Any] | None:
    p = getattr(request, "kv_transfer_params", None) or {}
    return p.get("epic") if isinstance(p, dict) else None


class EpicConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        # prompt tokens one batched link pass holds (the linker's workspace; vllm_api.gpu_memory_share counts it)
        default_ws = WORKSPACE_PROMPTS * vllm_config.model_config.max_model_len
        self.workspace_tokens = int(extra.get("workspace_tokens", default_ws))
        self._active: dict[str, _ReqState] = {}
        self._kvm = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.linker: Linker | None = None
        self._load_errors: set[int] = set()  # worker: blocks whose claimed KV was not written this step

    # ---------------- scheduler side ----------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """Scheduler, at start-up: the manager whose block tables build_connector_meta reads."""
        self._kvm = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, when a waiting request is considered: how many prompt tokens beyond
        `num_computed_tokens` (vLLM's own prefix-cache hits) this connector provides, and whether it loads
        them asynchronously (never: links run synchronously before the forward). Reads the request only."""
        p = _epic_params(request)
        if not p or "link" not in p:
            return 0, False
        return max(int(p["claim"]) - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Scheduler, after blocks were allocated for a request: remember what to load or capture for it."""
        p = _epic_params(request)
        if p is None:
            return
        self._active[request.request_id] = _ReqState(
            params=p,
            num_prompt=len(request.prompt_token_ids or []),
            n_ext=num_external_tokens,
            load_pending=num_external_tokens > 0,
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """Scheduler, once per step after scheduling: the loads (links, once per request) and captures
        (each step of a compile's prefill) the worker must run in this step, with their block ids."""
        meta = EpicMeta()
        if not self._active:
            return meta
        for req_id, num_computed in vllm_api.scheduled_steps(scheduler_output):
            st = self._active.get(req_id)
            if st is None:
                continue
            block_ids = vllm_api.block_ids_of(self._kvm, req_id)
            if st.load_pending:
                meta.loads.append(LoadSpec(req_id, st.params["link"], block_ids, num_computed - st.n_ext, num_computed))
                st.load_pending = False
            if "capture" in st.params:
                n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
                end = min(num_computed + n_sched, st.num_prompt)
                if end > num_computed:
                    meta.captures.append(CaptureSpec(req_id, st.params["capture"], block_ids, num_computed, end))
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, when a request finishes or is aborted: forget it; its blocks are freed at once
        (False: nothing is saved asynchronously)."""
        self._active.pop(request.request_id, None)
        return False, None

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once after the paged caches are allocated: layer name -> cache tensor."""
        self.kv_caches = kv_caches

    def attach(self, model: torch.nn.Module) -> dict[str, Any]:
        """Not a vLLM hook: called once by the engine (through the worker extension) after start-up.
        Refuses every configuration the linker does not handle (support.check_supported: quantized KV,
        soft-capping, ALiBi, sinks, sliding windows, per-layer RoPE or head sizes, split kernel blocks, ...),
        then binds the vLLM model, picks the KV layout and self-checks it, builds the key rotator and checks
        it numerically against the model's own RoPE; any failure refuses to serve."""
        if not self.kv_caches:
            raise RuntimeError("KV caches are not registered yet")
        layers = vllm_api.decoder_layers(model)
        attns = [vllm_api.find_attention(layer)[2] for layer in layers]
        rotaries = [vllm_api.rotary_of(layer) for layer in layers]
        check_supported(attns, self.kv_caches, rotaries, self.block_size)
        attn, rotary = attns[0], rotaries[0]
        layout = layout_for(attn)
        cache = self.kv_caches[attn.layer_name]
        layout.self_check(cache)
        rotator = rope.KeyRotator(rotary)
        rope.self_check(rotator, rotary, attn.head_size, attn.num_kv_heads, cache.dtype)
        linker = Linker(
            model=model,
            kv_caches=self.kv_caches,
            layout=layout,
            rotator=rotator,
            block_size=self.block_size,
            workspace_tokens=self.workspace_tokens,
        )
        self.linker = linker
        return {
            "layout": layout.name,
            "rope": type(rotary).__name__,
            "kv_dtype": str(cache.dtype),
            "block_size": self.block_size,
            "num_layers": len(linker.layers),
            "num_kv_heads": attn.num_kv_heads,
            "head_size": attn.head_size,
            "link_workspace_tokens": linker.workspace_tokens,
            "link_workspace_bytes": linker.workspace_nbytes,
        }

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Worker, before the step's forward: link every request in this step's loads, all in one batch
        (one recompute pass per layer for all of them; writes their claimed pages in every layer). A failure
        is recorded on the job, never raised: the engine then discards that request's answer before any
        token is passed on. A request whose own data is invalid is failed alone by the linker; a failure of
        the batched pass fails every request of the batch. A load whose job is no longer on the board (the
        caller dropped it) cannot be filled and has no job to flag: its blocks are reported to vLLM as
        failed loads (get_block_ids_with_load_errors), so vLLM fails that request (finish reason "error",
        no token of this step passed on, the blocks dropped from its prefix cache) and the engine raises
        instead of answering from unfilled pages."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, EpicMeta):
            return
        batch: list[LinkLoad] = []
        for load in meta.loads:
            job = BOARD.job(load.job_id)
            if job is None:
                bs = self.block_size
                self._load_errors.update(load.block_ids[load.start // bs : -(-load.end // bs)])
                log.error(
                    "link job %s for %s is gone; its pages were not filled, so the request is failed",
                    load.job_id,
                    load.req_id,
                )
                continue
            batch.append(LinkLoad(job, load.block_ids, load.start, load.end))
        if not batch:
            return
        try:
            self.linker.link_many(batch)
        except Exception as e:  # never crash the engine step: the engine aborts these requests
            log.exception("linking a batch of %d requests failed", len(batch))
            for ld in batch:
                if ld.job.error is None:
                    ld.job.error = f"{type(e).__name__}: {e}"

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, after the step: blocks this step failed to fill (vLLM fails the requests holding them;
        kv_load_failure_policy "fail", its default). Cleared once reported."""
        failed, self._load_errors = self._load_errors, set()
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, before each attention layer: nothing to wait for (links finish in start_load_kv)."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Worker, after each attention layer: captures copy whole requests in wait_for_save instead."""
        return

    def wait_for_save(self) -> None:
        """Worker, after the step's forward: copy this step's freshly computed KV of compile requests
        into their captures (the engine stores it once the request finishes)."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, EpicMeta):
            return
        for spec in meta.captures:
            cap = BOARD.capture(spec.cap_id)
            if cap is None:
                continue
            try:
                for first, stop, at in cap.kept(spec.start, spec.end):
                    self.linker.capture(spec.block_ids, first, stop, cap.k, cap.v, at)
                if spec.start == 0 and cap.lead > 1:  # the sink's key, rotated to sit right before the chunk
                    cap.k[:, :1] = self.linker.rotator.rotate(cap.k[:, :1], cap.lead - 1).to(cap.k.dtype)
                cap.filled_to = max(cap.filled_to, spec.end)
            except Exception as e:
                log.exception("capturing %s failed", spec.req_id)
                cap.error = f"{type(e).__name__}: {e}"


class EpicWorkerExtension:
    """Mixed into vLLM's Worker (worker_extension_cls): hands the model to the connector."""

    def epic_attach(self) -> dict[str, Any]:
        return vllm_api.kv_connector().attach(vllm_api.worker_model(self))
