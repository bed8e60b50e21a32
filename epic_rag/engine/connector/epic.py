"""EpicConnector: LegoLink as an out-of-tree vLLM V1 KV connector, plus the worker extension.

The class vLLM loads (`kv_connector_module_path` "epic_rag.engine.connector"). Its hooks live by side:
scheduler.py and worker.py; what crosses between them, meta.py; its options (`kv_connector_extra_config`),
config.py.

vLLM builds one instance per role. Scheduler-side hooks (get_num_new_matched_tokens,
update_state_after_alloc, build_connector_meta, update_connector_output, request_finished) run in the
scheduler, once per step; what they decide reaches the worker only through the EpicMeta they build.
Worker-side hooks (register_kv_caches, start_load_kv, wait_for_save, build_connector_worker_meta, ...) run
in the model runner around each forward; their outcomes come back through EpicWorkerMeta.

Everything a request asks for travels inside it (jobs.py), so the connector works wherever vLLM runs its
engine core: in the caller's process, in its own process, under `vllm serve`.
- A link ({"epic": {"link": ...}}) has its first `claim` prompt tokens claimed as externally computed;
  `start_load_kv` reads the spans' records from the worker's store and the linker fills their pages, and
  vLLM computes the rest (question, template tail). A record that is missing or does not hold the prompt's
  tokens there is recomputed instead (exact, only slower), or fails the request when the link asks so
  (on_missing "fail").
- Links load asynchronously (vLLM's load_async; kv_connector_extra_config "async_links", default on, off
  under tensor parallelism): the request waits while its link runs a few layers in each step, after that
  step's forward, for at most `link_step_share` times the forward's time (then at least one layer), so the
  running requests' decodes are delayed by a bounded share, as vLLM's chunked prefill bounds a prefill's;
  a step with nothing else to run links to the end. The requests that arrive together are linked in one
  batched pass; get_finished() releases them. With "async_links" off, every link of a step runs whole before
  its forward (the request's first step then also computes its question).
- A compile ({"epic": {"compile": ...}}) has its freshly computed KV copied out of the paged cache after
  each prefill step (`wait_for_save`) and stored once the prompt is complete, under the key the worker
  derives (jobs.py; a client key that differs is refused).
- Every request belongs to a tenant (tenancy.py: its cache_salt, or the server's default): it compiles into,
  links from and finds only its own tenant's records; errors inside the server reach clients as a generic line
  with an id, the details go to the log.
"""

from __future__ import annotations

import weakref
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from .. import vllm_api
from ..link.memory import workspace_tokens
from .config import ConnectorConfig
from .scheduler import SchedulerSide
from .support import check_parallelism
from .worker import WorkerSide

_INSTANCES: weakref.WeakSet = weakref.WeakSet()


def pending() -> int:
    """Requests the connectors of this process still hold state for (both roles; 0 when nothing is in
    flight): a check that finished and aborted requests leave nothing behind."""
    return sum(
        len(c._active)
        + len(c._results)
        + len(c._parsed)
        + len(c._prefix_hits)
        + len(c._captures)
        + len(c._step_results)
        + len(c._queue)
        + (c._pass is not None)
        for c in _INSTANCES
    )


class EpicConnector(SchedulerSide, WorkerSide, KVConnectorBase_V1):
    """LegoLink as vLLM's KV connector: vLLM builds one per role (scheduler, worker) from its kv_transfer_config;
    every option comes from its `kv_connector_extra_config` (ConnectorConfig)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_parallelism(vllm_config.parallel_config)
        self.block_size = vllm_config.cache_config.block_size
        self.extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        config = ConnectorConfig.from_extra(self.extra)
        # prompt tokens one batched link pass holds (sizes the linker's buffers; link/memory.py: gpu_memory_share
        # counts them)
        self.workspace_tokens = workspace_tokens(config.workspace_tokens, vllm_config.model_config.max_model_len)
        # Links load asynchronously, a share of each step (module docstring). Not under tensor parallelism:
        # the ranks' time budgets would differ, and their layers' collectives must stay in step.
        self.async_links = config.async_links and vllm_config.parallel_config.tensor_parallel_size == 1
        self.link_step_share = float(config.link_step_share)
        self._init_scheduler(config)
        self._init_worker(config)
        _INSTANCES.add(self)


class EpicWorkerExtension:
    """Mixed into vLLM's Worker (worker_extension_cls): hands the model to the connector."""

    def epic_attach(self) -> dict[str, Any]:
        return vllm_api.kv_connector().attach(vllm_api.worker_model(self))
