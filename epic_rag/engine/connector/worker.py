"""EpicConnector's worker side: vLLM's model runner calls these hooks around each forward. Links: the spans'
records are read from the worker's stores, checked against the prompt's tokens and linked in batched passes
(linker.py), whole before the forward or a share of each step (async_links); a failed link fails its request,
never the step. Compiles: each prefill step's fresh KV is copied out of the pages and the record stored once the
prompt is complete. `attach` binds the model and refuses what the linker cannot serve."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ...keys import rank_key
from ...policy import SINK_LEN
from ...redact import redact
from ...store import ChunkKV, RecordHead
from ...store.metrics import COMPILE_REFUSALS
from .. import vllm_api
from ..jobs import Capture, LinkJob, LinkSpan
from ..link import rope
from ..link.budget import HostBudget, link_budget
from ..link.layout import layout_for
from ..link.linker import Linker, LinkLoad, LinkPass
from ..stores import ChunkStores, worker_stores
from .config import ConnectorConfig
from .meta import CaptureSpec, EpicMeta, EpicWorkerMeta, LoadSpec
from .support import check_supported

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class _Link:
    """One load on the worker side, from its step's metadata until its outcome is reported."""

    spec: LoadSpec
    load: LinkLoad
    missing: list[str]  # span keys without a usable record (recomputed)


class WorkerSide:
    """The worker-side hooks of EpicConnector (mixed into it; its state set by `_init_worker`)."""

    def _init_worker(self, config: ConnectorConfig) -> None:
        self.max_compile_tokens = config.max_compile_tokens
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
        it numerically against the model's own RoPE, and opens the stores; any failure refuses to serve. The
        fused page filler is checked against the torch one (stage.check_fused); failing it falls back to the
        torch filler (info "link_fill_check"), it never refuses."""
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
            layer_kernels=vllm_api.link_kernels(layers, self._vllm_config),
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
            # the fused filler's start-up check: passed (True), failed (False: the torch filler links, reason
            # says why), not run (None)
            "link_fill_check": {
                "passed": linker.filler_check.passed,
                "reason": linker.filler_check.reason,
                "seconds": round(linker.filler_check.seconds, 3),
            },
            # vLLM's ops switched to their C/CUDA kernels during links (vllm_api.link_kernels)
            "link_layer_kernels": sorted({type(m).__name__ for m in linker.layer_kernels.custom_ops}),
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
            except Exception as e:
                self.linker = None
                self._refusal = _internal_error("this server cannot link or compile", e)
            # Every tensor-parallel rank attaches in the same step (the same metadata): they agree on the
            # outcome before any other collective, or a rank that refused would leave the others blocked in
            # the next one (_read's agreement, a link layer's all-reduce).
            if vllm_api.tp_rank_size()[1] > 1 and vllm_api.tp_any([self._refusal is not None])[0]:
                if self._refusal is None:
                    self.linker = None
                    self._refusal = (
                        "this server cannot link or compile (attaching failed on another tensor-parallel rank)"
                    )
                    log.error("EpicConnector: %s", self._refusal)
            if self._refusal is None:
                return True
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
                kvs, heads, read = [], {}, {}
                for s in load.link.spans:
                    # Tokens and tenant first, from the record's header (peek): one that cannot serve the span
                    # is never read whole or decoded. Spans of one record: read once, sliced per span.
                    rec = (s.key, s.exact)
                    if rec not in heads:
                        heads[rec] = self.stores.peek(self._rank_key(s.key), glue=s.exact)
                    if not self._matches(heads[rec], s, load):
                        kvs.append(None)
                        continue
                    if rec not in read:
                        read[rec] = self.stores.get(self._rank_key(s.key), glue=s.exact)
                    kv = read[rec]
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
    def _matches(kv: ChunkKV | RecordHead | None, s, load: LoadSpec) -> bool:
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
                    p, rest, err = *self.linker.begin([x.load for x in self._queue]), None
                except Exception as e:  # never crash the engine step: these requests are failed
                    p, rest, err = None, [], e
                # Tensor-parallel ranks run a pass's layers together (their all-reduces): every rank started
                # it, or none runs it (a device or host OOM in begin hits one rank only).
                if self.tp_size > 1 and vllm_api.tp_any([err is not None])[0] and err is None:
                    p, rest, err = None, [], RuntimeError("starting the pass failed on another tensor-parallel rank")
                if err is not None:
                    self._fail_all(self._queue, err)
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
                refused = self._over_compile_bound(spec)
                if refused is not None:  # before its buffer is allocated: nothing captured, nothing stored
                    self._step_results[spec.req_id] = {"error": refused}
                    continue
                cap = self._capture_buffer(spec)
                # A first step that starts past 0 had its head from vLLM's prefix cache: exact KV of the same
                # tokens (a compile is never scoped as a link is), captured from those pages too.
                start = 0 if cap.filled_to == 0 else spec.start
                if cap.filled_to != spec.start and start != 0:
                    raise RuntimeError(f"capture of {spec.req_id} resumed at {spec.start}, not {cap.filled_to}")
                for first, stop, at in cap.kept(start, spec.end):
                    cap.landed.append(self.linker.capture(spec.block_ids, first, stop, cap.k, cap.v, at))
                cap.filled_to = spec.end
                if spec.end == spec.num_prompt:
                    # every copy has landed (GPU: the chunk's own events, here; not the stream's later work)
                    self.linker.captured(cap.landed)
                    if cap.lead > 1:  # the sink's key, rotated to sit right before the chunk
                        cap.k[:, :1] = self.linker.rotator.rotate(cap.k[:, :1], cap.lead - 1).to(cap.k.dtype)
                    self._captures.pop(spec.req_id, None)
                    self._store(spec, cap)
            except Exception as e:
                self._captures.pop(spec.req_id, None)
                self._step_results[spec.req_id] = {"error": _internal_error(f"capturing {spec.req_id} failed", e)}

    def _over_compile_bound(self, spec: CaptureSpec) -> str | None:
        """Why a compile is refused (max_compile_tokens), or None. Counted once, at its last step."""
        n = spec.num_prompt - max(spec.compile.lead, 1) + 1  # its record: the sink and the chunk (as _capture_buffer)
        if self.max_compile_tokens is None or n <= self.max_compile_tokens:
            return None
        if spec.end == spec.num_prompt:
            COMPILE_REFUSALS.labels("tokens").inc()
        return (
            f"epic compile: its record would hold {n} tokens, over this server's max_compile_tokens "
            f"({self.max_compile_tokens}); nothing stored"
        )

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
