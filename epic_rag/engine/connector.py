"""EpicConnector: LegoLink as an out-of-tree vLLM V1 KV connector, plus the worker extension.

Scheduler side: a request whose params carry {"epic": {"link": job_id, "claim": n}} has its first n
prompt tokens claimed as externally computed; vLLM computes the rest (question, template tail).
A request carrying {"epic": {"capture": cap_id}} is a compile: after each step its freshly computed
KV is copied out of the paged cache.
Worker side: `start_load_kv` runs the linker for claimed spans; `wait_for_save` runs captures.
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

from .board import BOARD
from .layout import layout_for
from .linker import Linker, _find_attention
from .rope import KeyRotator

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
        self._active: dict[str, _ReqState] = {}
        self._kvm = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.linker: Linker | None = None

    # ---------------- scheduler side ----------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        self._kvm = kv_cache_manager

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        p = _epic_params(request)
        if not p or "link" not in p:
            return 0, False
        return max(int(p["claim"]) - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        p = _epic_params(request)
        if p is None:
            return
        self._active[request.request_id] = _ReqState(
            params=p, num_prompt=len(request.prompt_token_ids or []), n_ext=num_external_tokens,
            load_pending=num_external_tokens > 0)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = EpicMeta()
        if not self._active:
            return meta
        steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, num_computed in steps:
            st = self._active.get(req_id)
            if st is None:
                continue
            block_ids = list(self._kvm.get_blocks(req_id).get_block_ids()[0])
            if st.load_pending:
                meta.loads.append(LoadSpec(req_id, st.params["link"], block_ids,
                                           num_computed - st.n_ext, num_computed))
                st.load_pending = False
            if "capture" in st.params:
                n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
                end = min(num_computed + n_sched, st.num_prompt)
                if end > num_computed:
                    meta.captures.append(CaptureSpec(req_id, st.params["capture"], block_ids, num_computed, end))
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._active.pop(request.request_id, None)
        return False, None

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches

    def attach(self, model: torch.nn.Module) -> dict[str, Any]:
        """Bind the vLLM model, pick and self-check the KV layout, build the key rotator."""
        if not self.kv_caches:
            raise RuntimeError("KV caches are not registered yet")
        first_layer = model.model.layers[getattr(model.model, "start_layer", 0)]
        rotary = getattr(getattr(first_layer, "self_attn", None), "rotary_emb", None)
        if rotary is None:
            from .rope import RopeError
            raise RopeError(f"{type(model).__name__} has no rotary embedding: position-independent "
                            "linking needs RoPE")
        _, _, attn = _find_attention(first_layer)
        layout = layout_for(attn)
        cache = self.kv_caches[attn.layer_name]
        layout.self_check(cache)
        linker = Linker(model=model, kv_caches=self.kv_caches, layout=layout, rotator=KeyRotator(rotary),
                        block_size=self.block_size)
        if any(getattr(a.impl, "sliding_window", None) not in (None, -1, (-1, -1)) for _, _, a in linker.attn):
            raise RuntimeError("sliding-window attention drops tokens from chunk KV: not supported")
        self.linker = linker
        return {"layout": layout.name, "rope": type(rotary).__name__, "kv_dtype": str(cache.dtype),
                "block_size": self.block_size, "num_layers": len(linker.layers),
                "num_kv_heads": attn.num_kv_heads, "head_size": attn.head_size}

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, EpicMeta):
            return
        for load in meta.loads:
            job = BOARD.job(load.job_id)
            if job is None:
                log.error("link job %s for %s is gone; its KV will be wrong and is flagged", load.job_id, load.req_id)
                continue
            try:
                self.linker.link(job, load.block_ids, load.start, load.end)
            except Exception as e:  # never crash the engine step: the engine aborts this request
                log.exception("linking %s failed", load.req_id)
                job.error = f"{type(e).__name__}: {e}"

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, EpicMeta):
            return
        for spec in meta.captures:
            cap = BOARD.capture(spec.cap_id)
            if cap is None:
                continue
            try:
                self.linker.capture(spec.block_ids, spec.start, spec.end, cap.k, cap.v, cap.offset)
                cap.filled_to = max(cap.filled_to, spec.end)
            except Exception as e:
                log.exception("capturing %s failed", spec.req_id)
                cap.error = f"{type(e).__name__}: {e}"


class EpicWorkerExtension:
    """Mixed into vLLM's Worker (worker_extension_cls): hands the model to the connector."""

    def epic_attach(self) -> dict[str, Any]:
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        return get_kv_transfer_group().attach(self.model_runner.get_model())
