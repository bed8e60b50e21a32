"""EpicConnector: LegoLink as an out-of-tree vLLM V1 KV connector, plus the worker extension.

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

import logging
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from ..keys import rank_key
from ..policy import SINK_LEN, Policy, parse_policy
from ..redact import redact
from ..store import ChunkKV
from . import rope, vllm_api
from .budget import HostBudget, link_budget
from .finder import ChunkFinder
from .jobs import MAX_SPANS, Capture, CompileRequest, LinkJob, LinkRequest, LinkSpan, epic_params
from .layout import layout_for
from .linker import WORKSPACE_PROMPTS, Linker, LinkLoad, LinkPass
from .stores import ChunkStores, worker_stores
from .support import check_parallelism, check_supported
from .tenancy import Tenancy

log = logging.getLogger(__name__)
_INSTANCES: weakref.WeakSet = weakref.WeakSet()


def pending() -> int:
    """Requests the connectors of this process still hold state for (both roles; 0 when nothing is in
    flight): a check that finished and aborted requests leave nothing behind."""
    return sum(
        len(c._active)
        + len(c._results)
        + len(c._parsed)
        + len(c._captures)
        + len(c._step_results)
        + len(c._queue)
        + (c._pass is not None)
        for c in _INSTANCES
    )


@dataclass(slots=True)
class LoadSpec:
    req_id: str
    link: LinkRequest  # spans cut to the claim
    token_ids: list[int]  # prompt[:claim]
    block_ids: list[int]
    start: int
    end: int
    tail: list[int] = field(default_factory=list)  # prompt[claim:]: the probe of query-aware links
    tenant: str = ""  # the request's tenant id (tenancy.py): only its records are linked


@dataclass(slots=True)
class CaptureSpec:
    req_id: str
    compile: CompileRequest
    block_ids: list[int]
    start: int
    end: int
    num_prompt: int
    prompt: list[int] | None = None  # the prompt's tokens, on the step that completes it
    tenant: str = ""  # the request's tenant id: part of the record's key


@dataclass
class EpicMeta(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    captures: list[CaptureSpec] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)  # requests gone since the last step: drop their buffers
    idle: bool = False  # nothing scheduled in this step: no forward runs, links may take the whole step


@dataclass
class EpicWorkerMeta(KVConnectorWorkerMetadata):
    """Outcomes of this step's links and compiles, by request id (jobs.py documents the forms)."""

    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    learned: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # key -> (tenant id, chunk tokens)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, EpicWorkerMeta):
            self.learned.update(other.learned)
            for req_id, r in other.results.items():  # tensor-parallel ranks: an error on any rank wins
                if "error" in r or req_id not in self.results:
                    self.results[req_id] = r
        return self


@dataclass(eq=False, slots=True)
class _Link:
    """One load on the worker side, from its step's metadata until its outcome is reported."""

    spec: LoadSpec
    load: LinkLoad
    missing: list[str]  # span keys without a usable record (recomputed)


@dataclass(slots=True)
class _ReqState:
    link: LinkRequest | None
    compile: CompileRequest | None
    prompt: list[int]
    n_ext: int
    load_pending: bool
    tenant: str = ""


class EpicConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_parallelism(vllm_config.parallel_config)
        self.block_size = vllm_config.cache_config.block_size
        self.extra = dict(getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {})
        # prompt tokens one batched link pass holds (sizes the linker's buffers; vllm_api.gpu_memory_share counts them)
        default_ws = WORKSPACE_PROMPTS * vllm_config.model_config.max_model_len
        self.workspace_tokens = int(self.extra.get("workspace_tokens", default_ws))
        # Links load asynchronously, a share of each step (module docstring). Not under tensor parallelism:
        # the ranks' time budgets would differ, and their layers' collectives must stay in step.
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.async_links = bool(self.extra.get("async_links", True)) and tp == 1
        self.link_step_share = float(self.extra.get("link_step_share", 1.0))
        if not self.link_step_share >= 0:
            raise ValueError(f"link_step_share must be a number >= 0, got {self.extra.get('link_step_share')!r}")
        # scheduler side
        self._active: dict[str, _ReqState] = {}
        self._results: dict[str, dict[str, Any]] = {}  # worker outcomes (and refusals) until the request ends
        self._parsed: dict[str, tuple[LinkRequest | None, CompileRequest | None]] = {}
        # Requests that name no spans have compiled chunks found in their tokens and linked under this policy
        # (kv_connector_extra_config "find_chunks"; unset: they are not looked at).
        find = self.extra.get("find_chunks")
        self.find_policy = parse_policy(find) if find else None
        self.finder = ChunkFinder()
        self.tenancy = Tenancy.from_extra(self.extra)  # tenants, and what clients may ask (tenancy.py)
        self.max_spans = int(self.extra.get("max_spans", MAX_SPANS))
        self._finished: list[str] = []
        self._kvm = None
        # worker side
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.linker: Linker | None = None
        self.stores: ChunkStores | None = None
        self.fingerprint: str | None = None
        self.tp_rank, self.tp_size = 0, 1  # set at attach
        self._captures: dict[str, Capture] = {}
        self._refusal: str | None = None  # why attaching on first use failed
        self._runner = None  # the model runner that registered the caches
        self._step_results: dict[str, dict[str, Any]] = {}
        self._learned: dict[str, tuple[str, list[int]]] = {}  # stored this step: key -> (tenant, chunk tokens)
        self._load_errors: set[int] = set()  # blocks whose claimed KV was not written this step
        self._queue: list[_Link] = []  # loads waiting for a pass
        self._pass: tuple[LinkPass | None, list[_Link]] | None = None  # the pass under way and its loads
        self._recving: set[str] = set()  # async loads done (or failed) since the last get_finished
        self._budget = HostBudget(self.link_step_share)  # a share of each busy step (budget.py); set at attach
        _INSTANCES.add(self)

    # ---------------- scheduler side ----------------
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """Scheduler, at start-up: the manager whose block tables build_connector_meta reads."""
        self._kvm = kv_cache_manager

    def _parse(self, request) -> tuple[LinkRequest | None, CompileRequest | None]:
        """The request's link or compile (once per request). A request without one links the compiled chunks
        of its tenant found in its tokens under "find_chunks" (if set); {"epic": {"find": false}} opts out,
        {"epic": {"find": policy}} picks the policy where the server allows it (allow_client_find). One that
        does not parse or is not allowed is refused here (logged, its reason returned at its end) and the
        request runs as a plain prefill."""
        req_id = request.request_id
        if req_id not in self._parsed:
            self._parsed[req_id] = self._parse_new(request)
        return self._parsed[req_id]

    def _parse_new(self, request) -> tuple[LinkRequest | None, CompileRequest | None]:
        p = epic_params(getattr(request, "kv_transfer_params", None))
        prompt = request.prompt_token_ids or []
        try:
            if p is None or "find" in p:
                return self._found(prompt, self._find_policy(p), self.tenancy.of(request)), None
            if "link" in p:
                return LinkRequest.from_params(p["link"], len(prompt), self.max_spans), None
            if "compile" in p:
                if not self.tenancy.allow_client_compiles:
                    raise ValueError("epic compile: this server does not accept compiles (allow_client_compiles)")
                return None, CompileRequest.from_params(p["compile"], len(prompt))
            raise ValueError(f"epic: expected 'link', 'compile' or 'find', got {sorted(p)[:8]}")
        except ValueError as e:
            log.warning("request %s: %s; computed without linking", request.request_id, str(e)[:500])
            self._results[request.request_id] = {"error": str(e)[:500]}
            return None, None

    def _find_policy(self, p: dict[str, Any] | None):
        """The policy a request's found chunks are linked under: the server's, none when the request opts
        out, or the request's own where the server lets requests choose (allow_client_find)."""
        if p is None:
            return self.find_policy
        if p["find"] is False:
            return None
        if not self.tenancy.allow_client_find:
            raise ValueError("epic find: this server does not let requests switch find on (allow_client_find)")
        return p["find"]

    def _found(self, prompt: list[int], policy, tenant: str) -> LinkRequest | None:
        """A link of `tenant`'s compiled chunks found in `prompt` (finder.py) under `policy`; None: nothing to
        link."""
        if policy is None or policy is False or not len(self.finder) or len(prompt) < 2:
            return None
        if isinstance(policy, str):
            policy = parse_policy(policy)
        elif not isinstance(policy, Policy):
            raise ValueError(f"epic find: expected a policy name or false, got {policy!r}")
        if not policy.links_chunks:
            raise ValueError(f"epic find: policy {policy.name} links no chunks")
        spans = self.finder.find(prompt, tenant)
        return LinkRequest(policy, None, tuple(spans)) if spans else None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, when a waiting request is considered: how many prompt tokens beyond
        `num_computed_tokens` (vLLM's own prefix-cache hits) this connector provides, and whether it loads
        them asynchronously (async_links). Reads the request only."""
        link, _ = self._parse(request)
        if link is None:
            return 0, False
        n = max(link.claim(len(request.prompt_token_ids)) - num_computed_tokens, 0)
        return n, self.async_links and n > 0

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Scheduler, after blocks were allocated for a request: remember what to load or capture for it."""
        link, comp = self._parse(request)
        if link is None and comp is None:
            return
        self._active[request.request_id] = _ReqState(
            link=link,
            compile=comp,
            prompt=list(request.prompt_token_ids),
            n_ext=num_external_tokens,
            load_pending=link is not None and num_external_tokens > 0,
            tenant=self.tenancy.of(request),
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """Scheduler, once per step after scheduling: the loads (links of the requests given blocks in this
        step: scheduled now, or waiting for their asynchronous load) and captures (each step of a compile's
        prefill) the worker must start in this step, with their block ids."""
        meta = EpicMeta(finished=self._finished, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._finished = []
        if not self._active:
            return meta
        for req_id, st in self._active.items():
            if st.load_pending:  # claimed positions [claim - n_ext, claim): vLLM's own prefix hits come first
                claim, link = st.link.cut(len(st.prompt))
                block_ids = vllm_api.block_ids_of(self._kvm, req_id)
                tail = st.prompt[claim:] if link.policy.kind == "query" else []
                start, prefix = claim - st.n_ext, st.prompt[:claim]
                meta.loads.append(LoadSpec(req_id, link, prefix, block_ids, start, claim, tail=tail, tenant=st.tenant))
                st.load_pending = False
        for req_id, num_computed in vllm_api.scheduled_steps(scheduler_output):
            st = self._active.get(req_id)
            if st is None:
                continue
            if st.compile is not None:
                block_ids = vllm_api.block_ids_of(self._kvm, req_id)
                n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
                num_prompt = len(st.prompt)
                end = min(num_computed + n_sched, num_prompt)
                if end > num_computed:
                    prompt = st.prompt if end == num_prompt else None
                    meta.captures.append(
                        CaptureSpec(
                            req_id, st.compile, block_ids, num_computed, end, num_prompt, prompt, tenant=st.tenant
                        )
                    )
        return meta

    def update_connector_output(self, connector_output) -> None:
        """Scheduler, after each step: the worker's outcomes, kept until their requests finish."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, EpicWorkerMeta):
            self._results.update({r: v for r, v in meta.results.items() if r in self._active})
            for key, (tenant, tokens) in meta.learned.items():
                self.finder.add(key, tokens, tenant)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, when a request finishes or is aborted: forget it, returning the worker's outcome in
        its kv_transfer_params (a link's counts arrive one step after the link: a request that finishes in
        its first step has none). Its blocks are freed at once (nothing is saved asynchronously)."""
        self._parsed.pop(request.request_id, None)
        if self._active.pop(request.request_id, None) is not None:
            self._finished.append(request.request_id)
        result = self._results.pop(request.request_id, None)
        return False, ({"epic": result} if result is not None else None)

    # ---------------- worker side ----------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once after the paged caches are allocated: layer name -> cache tensor. Its caller, the
        model runner, is kept: where nobody attaches the connector, it attaches itself on first use."""
        self.kv_caches = kv_caches
        self._runner = vllm_api.calling_model_runner()

    def attach(self, model: torch.nn.Module) -> dict[str, Any]:
        """Not a vLLM hook: called once by the engine (through the worker extension) after start-up.
        Refuses every configuration the linker does not handle (support.check_supported: quantized KV,
        soft-capping, ALiBi, sinks, sliding windows, per-layer RoPE or head sizes, split kernel blocks, ...),
        then binds the vLLM model, picks the KV layout and self-checks it, builds the key rotator and checks
        it numerically against the model's own RoPE, and opens the stores; any failure refuses to serve."""
        if not self.kv_caches:
            raise RuntimeError("KV caches are not registered yet")
        layers = vllm_api.decoder_layers(model)
        attns = [vllm_api.find_attention(layer)[2] for layer in layers]
        rotaries = [vllm_api.rotary_of(layer) for layer in layers]
        check_supported(attns, self.kv_caches, rotaries, self.block_size)
        attn, rotary = attns[0], rotaries[0]
        layout = layout_for(attn)
        cache = self.kv_caches[attn.layer_name]
        layout.self_check(cache, attn)
        rotator = rope.KeyRotator(rotary)
        rope.self_check(rotator, rotary, attn.head_size, attn.num_kv_heads, cache.dtype)
        self.fingerprint = vllm_api.worker_fingerprint(self._vllm_config, cache.dtype)
        self.stores = worker_stores(self.extra, self.fingerprint)
        self.tp_rank, self.tp_size = vllm_api.tp_rank_size()
        tp = self.tp_size > 1
        linker = Linker(
            model=model,
            kv_caches=self.kv_caches,
            layout=layout,
            rotator=rotator,
            block_size=self.block_size,
            workspace_tokens=self.workspace_tokens,
            reduce=vllm_api.tp_all_reduce if tp else None,
            agree=vllm_api.tp_any if tp else None,
        )
        self.linker = linker
        self._budget = link_budget(cache.device, self.link_step_share)
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
            "link_fill": type(linker.filler).__name__,
            "fingerprint": self.fingerprint,
            "tp": [self.tp_rank, self.tp_size],
        }

    def _attached(self, meta: EpicMeta) -> bool:
        """Attach on first use where nobody did (`vllm serve` makes no worker-extension call). A refusal
        fails this step's links and compiles, never the step."""
        if self.linker is not None or not (meta.loads or meta.captures):
            return True
        if self._refusal is None:
            try:
                if self._runner is None:
                    raise RuntimeError("the connector was not given the model (register_kv_caches' caller)")
                info = self.attach(self._runner.get_model())
                log.info("EpicConnector attached: %s", info)
                return True
            except Exception as e:
                self._refusal = _internal_error("this server cannot link or compile", e)
        for load in meta.loads:
            self._fail_blocks(load)
            if self.async_links:
                self._recving.add(load.req_id)
        for spec in [*meta.loads, *meta.captures]:
            self._step_results[spec.req_id] = {"error": self._refusal}
        return False

    def _rank_key(self, key: str) -> str:
        """Where this rank keeps a record: under tensor parallelism each rank stores its own KV heads."""
        return rank_key(key, self.tp_rank, self.tp_size)

    def _read(self, loads: list[LoadSpec]) -> list[tuple[list[ChunkKV | None], str | None]]:
        """Each load's span records, read and checked against the prompt's tokens (None: missing or not
        matching), or the error reading them. Under tensor parallelism the ranks agree (a span any rank lacks
        is dropped on all, a load any rank failed fails on all), so they recompute the same tokens and their
        decoder layers' collectives stay in step."""
        out = []
        for load in loads:
            try:
                kvs, read = [], {}
                for s in load.link.spans:
                    if (s.key, s.exact) not in read:  # spans of one record: read once, sliced per span
                        read[s.key, s.exact] = self.stores.get(self._rank_key(s.key), glue=s.exact)
                    kv = read[s.key, s.exact]
                    kvs.append(kv if self._matches(kv, s, load) else None)
                out.append((kvs, None))
            except Exception as e:  # a store that raises: the request fails, the step goes on
                out.append(([None] * len(load.link.spans), _internal_error("reading its chunks failed", e)))
        if self.tp_size == 1 or not out:
            return out
        # on the group's host (gloo) side: these flags live on the host, and a device all-reduce needs them on
        # the device (vLLM's CUDA all-reduce refuses a CPU tensor) and a sync to read them back
        flags = vllm_api.tp_any([f for kvs, err in out for f in [err is not None] + [kv is None for kv in kvs]])
        agreed, i = [], 0
        for kvs, err in out:
            failed, missing = flags[i], flags[i + 1 : i + 1 + len(kvs)]
            i += 1 + len(kvs)
            err = err or ("a chunk record could not be read on another tensor-parallel rank" if failed else None)
            agreed.append(([None if m else kv for kv, m in zip(kvs, missing)], err))
        return agreed

    def _job(self, load: LoadSpec, kvs: list[ChunkKV | None], err: str | None) -> tuple[LinkJob, list[str]]:
        """The worker-side job: the spans whose record was found (the others are recomputed, or fail the
        request when it asked so)."""
        spans, missing = [], []
        for s, kv in zip(load.link.spans, kvs):
            if kv is None:
                missing.append(s.key)
                continue
            spans.append(LinkSpan(s.start, kv.slice(s.offset, s.offset + s.n), s.exact))
        job = LinkJob(load.token_ids, spans, load.link.policy, error=err, tail=load.tail)
        if missing and err is None and load.link.on_missing == "fail":
            job.error = f"chunk records missing or damaged: {', '.join(missing)}"
        return job, [] if err else missing

    @staticmethod
    def _matches(kv: ChunkKV | None, s, load: LoadSpec) -> bool:
        if kv is None or kv.num_tokens < s.offset + s.n:
            return False
        if kv.tenant != load.tenant:  # another tenant's record: missing, as one never compiled
            return False
        if not s.exact and load.link.sink is not None and kv.token_ids[0] != load.link.sink:
            return False  # compiled behind another sink
        if kv.token_ids[s.offset : s.offset + s.n] != load.token_ids[s.start : s.end]:
            log.debug("record %s does not hold the prompt's tokens at %d: recomputed", s.key, s.start)
            return False
        return True

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker, before the step's forward: the step's metadata; a mark on the clock that bounds this step's
        link work (budget.py)."""
        super().bind_connector_metadata(connector_metadata)
        self._budget.bound()

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Worker, in each step (vLLM calls it before the forward where a step has synchronous loads, after it
        otherwise): read this step's loads and link. Asynchronous links advance the pass under way by a share
        of the step (module docstring); synchronous ones run whole, before the forward. The requests that
        arrive together are linked in one batched pass (one decoder-layer call per layer for all of them).
        A request whose link fails is never answered from its pages: its blocks are reported as failed loads
        (get_block_ids_with_load_errors), so vLLM fails it (finish reason "error", no token passed on, the
        blocks dropped from its prefix cache). A request whose own data is invalid is failed alone by the
        linker; a failure of the batched pass fails every request of the pass."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, EpicMeta) or not self._attached(meta):
            return
        for req_id in meta.finished:
            self._captures.pop(req_id, None)
        self._drop_unstarted(set(meta.finished))
        for load, (kvs, err) in zip(meta.loads, self._read(meta.loads)):
            job, missing = self._job(load, kvs, err)
            if missing:
                then = "the request fails" if job.error else "their tokens are recomputed"
                log.warning("request %s: %d chunk(s) not in the store: %s", load.req_id, len(missing), then)
            link = _Link(load, LinkLoad(job, load.block_ids, load.start, load.end), missing)
            if job.error is not None:  # failed already: reported now, never queued behind a pass
                self._report([link])
            else:
                self._queue.append(link)
        if not self._queue and self._pass is None:
            return
        self._budget.start(idle=meta.idle or not self.async_links)
        try:
            self._link()
        finally:
            self._budget.end()

    def _drop_unstarted(self, gone: set[str]) -> None:
        """Requests finished (aborted) before their link started are not linked; their blocks are released."""
        if not gone or not self._queue:
            return
        for x in self._queue:
            if x.spec.req_id in gone:
                self._recving.add(x.spec.req_id)
        self._queue = [x for x in self._queue if x.spec.req_id not in gone]

    def _link(self) -> None:
        """Start passes and advance them until none is left or this step's budget is spent."""
        while self._pass is not None or self._queue:
            if self._pass is None:  # the queue's first loads that fit the workspace (begin returns the rest)
                try:
                    p, rest = self.linker.begin([x.load for x in self._queue])
                except Exception as e:  # never crash the engine step: these requests are failed
                    self._fail_all(self._queue, e)
                    p, rest = None, []
                taken = len(self._queue) - len(rest)
                self._pass, self._queue = (p, self._queue[:taken]), self._queue[taken:]
            p, links = self._pass
            try:
                if p is not None and not self.linker.advance(p, self._budget.more):
                    return  # the rest in later steps
            except Exception as e:
                self._fail_all(links, e)
            self._pass = None
            self._report(links)
            if not self._budget.has_room():
                return

    @staticmethod
    def _fail_all(links: list[_Link], e: Exception) -> None:
        why = _internal_error(f"linking a pass of {len(links)} requests failed", e)
        for x in links:
            if x.load.job.error is None:
                x.load.job.error = why

    def _report(self, links: list[_Link]) -> None:
        """The outcomes of finished links, for the scheduler side; failed ones also as failed blocks."""
        for x in links:
            job = x.load.job
            if job.error is not None:
                self._fail_blocks(x.spec)
                self._step_results[x.spec.req_id] = {"error": job.error}
            else:
                self._step_results[x.spec.req_id] = {
                    "recomputed": job.recomputed,
                    "linked_spans": len(job.spans),
                    "missing": x.missing,
                }
            if self.async_links:
                self._recving.add(x.spec.req_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker, after the step: the asynchronous links done since the last call, failed ones included (their
        blocks are reported by get_block_ids_with_load_errors in the same step, as vLLM asks)."""
        done, self._recving = self._recving, set()
        return None, (done or None)

    def _fail_blocks(self, load: LoadSpec) -> None:
        """Report the blocks of a load's claimed positions [start, end) as not filled (vLLM fails the request)."""
        bs = self.block_size
        self._load_errors.update(load.block_ids[load.start // bs : -(-load.end // bs)])

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Worker, after the step: blocks this step failed to fill (vLLM fails the requests holding them;
        kv_load_failure_policy "fail", its default). Cleared once reported."""
        failed, self._load_errors = self._load_errors, set()
        return failed

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Worker, after the step: this step's outcomes, for the scheduler side (update_connector_output)."""
        if not self._step_results and not self._learned:
            return None
        meta = EpicWorkerMeta(self._step_results, self._learned)
        self._step_results, self._learned = {}, {}
        return meta

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker, before each attention layer: nothing to wait for (a request runs once its link is done)."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        """Worker, after each attention layer: captures copy whole requests in wait_for_save instead."""
        return

    def _capture_buffer(self, spec: CaptureSpec) -> Capture:
        cap = self._captures.get(spec.req_id)
        if cap is None:
            first = self.linker.attn[0][2]
            lead = max(spec.compile.lead, 1)
            shape = (len(self.linker.layers), spec.num_prompt - lead + 1, first.num_kv_heads, first.head_size)
            cache = self.linker.cache_of(0)
            # on the host: records are stored from there (and a GPU's memory is vLLM's); page-locked on a GPU
            # machine, so the capture copies run asynchronously and links copy the record back at full speed
            k, v = (torch.empty(shape, dtype=cache.dtype, pin_memory=cache.is_cuda) for _ in range(2))
            cap = Capture(k, v, lead=lead)
            self._captures[spec.req_id] = cap
        return cap

    def wait_for_save(self) -> None:
        """Worker, after the step's forward: copy this step's freshly computed KV of compile requests into
        their buffers, and store each record once its prompt is complete."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, EpicMeta) or not self._attached(meta):
            return
        for spec in meta.captures:
            try:
                cap = self._capture_buffer(spec)
                if cap.filled_to != spec.start:
                    raise RuntimeError(f"capture of {spec.req_id} resumed at {spec.start}, not {cap.filled_to}")
                for first, stop, at in cap.kept(spec.start, spec.end):
                    self.linker.capture(spec.block_ids, first, stop, cap.k, cap.v, at)
                cap.filled_to = spec.end
                if spec.end == spec.num_prompt:
                    self.linker.captured()  # every copy has landed (GPU: one wait per chunk, here)
                    if cap.lead > 1:  # the sink's key, rotated to sit right before the chunk
                        cap.k[:, :1] = self.linker.rotator.rotate(cap.k[:, :1], cap.lead - 1).to(cap.k.dtype)
                    self._captures.pop(spec.req_id, None)
                    self._store(spec, cap)
            except Exception as e:
                self._captures.pop(spec.req_id, None)
                self._step_results[spec.req_id] = {"error": _internal_error(f"capturing {spec.req_id} failed", e)}

    def _store(self, spec: CaptureSpec, cap: Capture) -> None:
        """Store a complete compile's record under the key derived here (a client key that differs is refused:
        nothing stored), scoped to its tenant; a chunk behind a lead is also learned by the finder."""
        try:
            key = spec.compile.key_for(self.fingerprint, spec.tenant, spec.prompt)
        except ValueError as e:
            log.warning("request %s: %s", spec.req_id, e)
            self._step_results[spec.req_id] = {"error": str(e)}
            return
        record = spec.compile.record_tokens(spec.prompt)
        lead = spec.compile.lead_of(spec.prompt)
        kv = ChunkKV(self._rank_key(key), record, cap.k, cap.v, cap.lead - 1, lead=lead, tenant=spec.tenant)
        self.stores.put(kv, glue=spec.compile.glue)
        self._step_results[spec.req_id] = {"stored": key}
        if spec.compile.lead > 0 and not spec.compile.glue:  # a chunk behind a lead: findable
            self._learned[key] = (spec.tenant, record[SINK_LEN:])


def _internal_error(what: str, e: BaseException) -> str:
    """What a client is told of a failure inside the server: `what` and an id; the details (which may name
    files, hosts or internals) go to the log under that id, secrets masked."""
    eid = uuid.uuid4().hex[:12]
    log.error("%s [error %s]: %s", what, eid, redact(f"{type(e).__name__}: {e}"), exc_info=e)
    return f"{what} (error {eid}; details in the server log)"


class EpicWorkerExtension:
    """Mixed into vLLM's Worker (worker_extension_cls): hands the model to the connector."""

    def epic_attach(self) -> dict[str, Any]:
        return vllm_api.kv_connector().attach(vllm_api.worker_model(self))
