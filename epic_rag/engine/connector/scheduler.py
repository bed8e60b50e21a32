"""EpicConnector's scheduler side: vLLM's scheduler calls these hooks once per step. They read the requests'
jobs (jobs.py; or find chunks in a request that names none), claim what a link provides, and hand the worker
side its loads and captures in EpicMeta; the worker's outcomes come back through EpicWorkerMeta and reach each
request's `kv_transfer_params` when it finishes."""

from __future__ import annotations

import functools
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...policy import Policy, parse_policy
from ...redact import redact
from ...store.metrics import COMPILE_REFUSALS
from .. import vllm_api
from ..jobs import CompileRequest, LinkRequest, SpanRef, epic_params
from .config import ConnectorConfig
from .finder import ChunkFinder
from .meta import CaptureSpec, EpicMeta, EpicWorkerMeta, LoadSpec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _ReqState:
    """What the scheduler side keeps of one request that links or compiles, until it finishes."""

    link: LinkRequest | None
    compile: CompileRequest | None
    prompt: list[int]
    n_ext: int
    load_pending: bool
    tenant: str = ""
    start: int = 0  # first claimed position: vLLM's own prefix hit is before it (only its claim is failed)
    error: str | None = None  # refused after its tokens were claimed: its load fails the request (_failing_load)


# The key of no record (derived keys are "<variant>-<40 hex digits>"): a load naming it finds nothing, so with
# on_missing "fail" the worker fails its blocks, its own way of failing a request (_failing_load).
NO_RECORD = "epic-refused"


# kv_transfer_params nested deeper than this are refused and dropped from the request: vLLM pickles a request's
# sampling params (they hold kv_transfer_params) to its workers, and a value nested ~900 deep makes that raise
# RecursionError in the engine core's step, which kills it (found on `vllm serve`; a link nests 5 deep).
MAX_PARAM_DEPTH = 32


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists and dicts in `value` nest deeper than `limit` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def _drop_params(request) -> None:
    """Take kv_transfer_params (the connector's own) off a request, where vLLM would carry them on."""
    request.kv_transfer_params = None
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None)
    if isinstance(extra, dict):
        extra.pop("kv_transfer_params", None)


def _hook_error(what: str, e: BaseException) -> str:
    """What a client is told of a failure in a scheduler hook: `what` and an id; the details go to the log."""
    eid = uuid.uuid4().hex[:12]
    log.error("%s failed [error %s]: %s", what, eid, redact(f"{type(e).__name__}: {e}"), exc_info=e)
    return f"{what} failed (error {eid}; details in the server log)"


def _per_request(fallback):
    """A scheduler hook whose exception becomes its request's own error. vLLM calls these hooks unguarded
    (on_new_request, get_num_new_matched_tokens, update_state_after_alloc, request_finished): an exception
    there would kill the engine core and every request in it. `fallback(self, e, request, *args)` leaves the
    request in a safe state (a plain prefill, or failed) and returns what the hook returns."""

    def wrap(hook):
        @functools.wraps(hook)
        def guarded(self, request, *args):
            try:
                return hook(self, request, *args)
            except Exception as e:
                return fallback(self, e, request, *args)

        return guarded

    return wrap


def _plain(self, e: BaseException, request) -> None:
    """Before any token is claimed: the request runs as a plain prefill, its failure as its outcome. Scoping
    that failed half way leaves some of its blocks under scoped hashes: they hold this prefill's exact KV."""
    self._refuse(request.request_id, "epic: reading the request's link or compile", e)


def _unclaimed(self, e: BaseException, request, num_computed_tokens: int) -> tuple[int, bool]:
    _plain(self, e, request)
    return 0, False  # nothing claimed: vLLM computes the whole prompt


def _after_alloc(self, e: BaseException, request, blocks, num_external_tokens: int) -> None:
    why = self._refuse(request.request_id, "epic: preparing the request's link or compile", e)
    if num_external_tokens > 0:  # claimed: those blocks are never computed, so the request must fail
        start = self._prefix_hits.get(request.request_id, (0, False))[0]
        self._active[request.request_id] = _ReqState(None, None, [], num_external_tokens, True, start=start, error=why)


def _finished(self, e: BaseException, request, block_ids) -> tuple[bool, dict[str, Any]]:
    why = _hook_error("epic: reporting the request's outcome", e)
    self._forget(request.request_id)
    return False, {"epic": {"error": why}}


class SchedulerSide:
    """The scheduler-side hooks of EpicConnector (mixed into it; its state set by `_init_scheduler`).
    Each hook's failure is its request's own (_per_request): never the engine core's."""

    def _init_scheduler(self, config: ConnectorConfig) -> None:
        self._active: dict[str, _ReqState] = {}
        self._results: dict[str, dict[str, Any]] = {}  # worker outcomes (and refusals) until the request ends
        self._parsed: dict[str, tuple[LinkRequest | None, CompileRequest | None]] = {}
        # links: prompt tokens vLLM's prefix cache provided, and whether the rest is linked (reported at the end)
        self._prefix_hits: dict[str, tuple[int, bool]] = {}
        # Requests that name no spans have compiled chunks found in their tokens and linked under this policy
        # ("find_chunks"; unset: they are not looked at).
        self.find_policy = config.find_policy
        self.finder = ChunkFinder()
        self.tenancy = config.tenancy  # tenants, and what clients may ask (tenancy.py)
        self.max_spans = config.max_spans
        self.max_compile_tokens = config.max_compile_tokens
        self._finished: list[str] = []
        self._kvm = None

    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        """Scheduler, at start-up: the manager whose block tables build_connector_meta reads."""
        self._kvm = kv_cache_manager

    def _parse(self, request) -> tuple[LinkRequest | None, CompileRequest | None]:
        """The request's link or compile (once per request). A request without one links the compiled chunks
        of its tenant found in its tokens under "find_chunks" (if set); {"epic": {"find": false}} opts out,
        {"epic": {"find": policy}} picks the policy where the server allows it (allow_client_find). One that
        does not parse (a non-object, an unknown field, more than one of link, compile and find; jobs.py) or
        is not allowed is refused here (logged, its reason returned at its end) and the request runs as a
        plain prefill."""
        req_id = request.request_id
        if req_id not in self._parsed:
            self._parsed[req_id] = self._parse_new(request)
        return self._parsed[req_id]

    def _parse_new(self, request) -> tuple[LinkRequest | None, CompileRequest | None]:
        prompt = request.prompt_token_ids or []
        try:
            params = getattr(request, "kv_transfer_params", None)
            if _nested_deeper(params, MAX_PARAM_DEPTH):
                _drop_params(request)
                raise ValueError(f"epic: kv_transfer_params nested deeper than {MAX_PARAM_DEPTH} levels")
            p = epic_params(params)
            if p is None or "find" in p:
                return self._found(prompt, self._find_policy(p), self.tenancy.of(request)), None
            if "link" in p:
                return LinkRequest.from_params(p["link"], len(prompt), self.max_spans), None
            if not self.tenancy.allow_client_compiles:  # epic_params left exactly one: "compile"
                raise ValueError("epic compile: this server does not accept compiles (allow_client_compiles)")
            comp = CompileRequest.from_params(p["compile"], len(prompt))
            n = len(comp.record_tokens(prompt))
            if self.max_compile_tokens is not None and n > self.max_compile_tokens:
                COMPILE_REFUSALS.labels("tokens").inc()  # refused before its prefill: nothing captured
                raise ValueError(
                    f"epic compile: its record would hold {n} tokens, over this server's max_compile_tokens "
                    f"({self.max_compile_tokens}); nothing stored"
                )
            return None, comp
        except ValueError as e:  # the client's own mistake: told as it is
            log.warning("request %s: %s; computed without linking", request.request_id, str(e)[:500])
            self._results[request.request_id] = {"error": str(e)[:500]}
        except RecursionError:  # a value nested too deep for the checks (review D)
            self._results[request.request_id] = {"error": "epic: the request's parameters are nested too deeply"}
        except Exception as e:  # anything else: a clear line for the client, the details in the log
            self._results[request.request_id] = {"error": _hook_error("epic: reading the request's parameters", e)}
        return None, None

    def _refuse(self, req_id: str, what: str, e: BaseException) -> str:
        """A hook failed for this request: its error is its outcome, and it links and compiles nothing more."""
        why = _hook_error(what, e)
        self._results[req_id] = {"error": why}
        self._parsed[req_id] = (None, None)
        st = self._active.get(req_id)
        if st is not None:
            st.compile = None  # no more captures: the worker's partial buffer is never stored
            st.error = why  # the worker's later outcomes do not replace it
        return why

    def _forget(self, req_id: str) -> None:
        """Drop everything kept for a request (it finished)."""
        self._parsed.pop(req_id, None)
        if self._active.pop(req_id, None) is not None:
            self._finished.append(req_id)
        self._results.pop(req_id, None)
        self._prefix_hits.pop(req_id, None)

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
        if policy is None or policy is False:
            return None
        # checked before anything is looked up: a bad policy is refused whether or not chunks are known
        if isinstance(policy, str):
            policy = parse_policy(policy)
        elif not isinstance(policy, Policy):
            raise ValueError(f"epic find: expected a policy name or false, got {type(policy).__name__}")
        if policy.kind == "auto":
            raise ValueError("epic find: 'auto' is resolved per request by EpicEngine; name a link policy")
        if not policy.links_chunks:
            raise ValueError(f"epic find: policy {policy.name} links no chunks")
        if not len(self.finder) or len(prompt) < 2:
            return None
        spans = self.finder.find(prompt, tenant)
        return LinkRequest(policy, None, tuple(spans)) if spans else None

    @_per_request(_plain)
    def on_new_request(self, request) -> None:
        """Scheduler, when a request arrives, before its first prefix-cache look-up: a link's blocks from its
        first chunk span on are moved out of vLLM's exact prefix cache into the link's own scope
        (LinkRequest.scope, vllm_api.scope_block_hashes). Linked KV is approximate: cached under the prompt's
        exact hashes, vLLM would serve it to any later request of the tenant with that prefix, one asking for
        exact KV included. In its scope it serves only a request that links the same chunks the same way (a
        follow-up turn); the exact head before the first chunk (template, system prompt) stays shared."""
        link, _ = self._parse(request)
        first = link.approximate_from() if link is not None else None
        if first is not None:
            hbs = vllm_api.hash_block_size(self._kv_cache_config, self.block_size)
            vllm_api.scope_block_hashes(request, first // hbs, link.scope())

    @_per_request(_unclaimed)
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Scheduler, when a waiting request is considered: how many prompt tokens beyond
        `num_computed_tokens` (vLLM's own prefix-cache hits) this connector provides, and whether it loads
        them asynchronously (async_links). Reads the request only."""
        link, _ = self._parse(request)
        if link is None:
            return 0, False
        n = max(link.claim(len(request.prompt_token_ids)) - num_computed_tokens, 0)
        if num_computed_tokens and n < self.block_size:
            # vLLM's prefix cache holds the link but for less than a block (a follow-up turn whose first turn
            # linked these chunks): computing that rest costs less than a link pass through every layer
            n = 0
        self._prefix_hits[request.request_id] = (num_computed_tokens, n > 0)  # the latest look-up's
        return n, self.async_links and n > 0

    @_per_request(_after_alloc)
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
            start=self._prefix_hits.get(request.request_id, (0, False))[0],
        )

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """Scheduler, once per step after scheduling: the loads (links of the requests given blocks in this
        step: scheduled now, or waiting for their asynchronous load) and captures (each step of a compile's
        prefill) the worker must start in this step, with their block ids. A request whose load or capture
        cannot be prepared fails alone (_failing_load; its compile stops)."""
        meta = EpicMeta(finished=self._finished, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._finished = []
        if not self._active:
            return meta
        for req_id, st in self._active.items():
            if not st.load_pending:
                continue
            st.load_pending = False
            try:
                if st.error is None:
                    meta.loads.append(self._load_spec(req_id, st))
                    continue
            except Exception as e:
                self._refuse(req_id, "epic: preparing the request's link", e)
            meta.loads.append(self._failing_load(req_id, st))
        try:
            steps = vllm_api.scheduled_steps(scheduler_output)
        except Exception as e:  # no compile can be followed in this step: every one stops, failed
            steps = []
            for req_id, st in self._active.items():
                if st.compile is not None:
                    self._refuse(req_id, "epic: following the compile", e)
        for req_id, num_computed in steps:
            st = self._active.get(req_id)
            if st is None or st.compile is None:
                continue
            try:
                spec = self._capture_spec(req_id, st, scheduler_output, num_computed)
            except Exception as e:
                self._refuse(req_id, "epic: following the compile", e)
                continue
            if spec is not None:
                meta.captures.append(spec)
        return meta

    def _load_spec(self, req_id: str, st: _ReqState) -> LoadSpec:
        """The load of claimed positions [claim - n_ext, claim): vLLM's own prefix hits come first."""
        claim, link = st.link.cut(len(st.prompt))
        block_ids = vllm_api.block_ids_of(self._kvm, req_id)
        tail = st.prompt[claim:] if link.policy.kind == "query" else []
        start, prefix = claim - st.n_ext, st.prompt[:claim]
        return LoadSpec(req_id, link, prefix, block_ids, start, claim, tail=tail, tenant=st.tenant)

    def _failing_load(self, req_id: str, st: _ReqState) -> LoadSpec:
        """A load the worker fails: its claimed blocks were never filled, and computing the request over them
        would answer from garbage. It names one record nobody has (NO_RECORD) and asks to fail when it is
        missing, so the worker reports the blocks as failed loads and vLLM fails the request (finish reason
        "error"); an asynchronous one is released as any failed link. If even the blocks cannot be named, the
        exception goes on: the engine stops rather than answer from them."""
        block_ids = vllm_api.block_ids_of(self._kvm, req_id)
        end = st.start + st.n_ext
        link = LinkRequest(parse_policy("legolink-0"), None, (SpanRef(NO_RECORD, 0, st.start, st.n_ext),), "fail")
        return LoadSpec(req_id, link, [0] * end, block_ids, st.start, end, tenant=st.tenant)

    def _capture_spec(self, req_id: str, st: _ReqState, scheduler_output, num_computed: int) -> CaptureSpec | None:
        """This step's part of a compile's prefill, or None when the step computes none of its prompt."""
        block_ids = vllm_api.block_ids_of(self._kvm, req_id)
        n_sched = scheduler_output.num_scheduled_tokens.get(req_id, 0)
        num_prompt = len(st.prompt)
        end = min(num_computed + n_sched, num_prompt)
        if end <= num_computed:
            return None
        prompt = st.prompt if end == num_prompt else None
        return CaptureSpec(req_id, st.compile, block_ids, num_computed, end, num_prompt, prompt, tenant=st.tenant)

    def update_connector_output(self, connector_output) -> None:
        """Scheduler, after each step: the worker's outcomes, kept until their requests finish (a request
        refused here keeps its own error). Never raises into the step: a chunk the finder could not learn is
        only not found later."""
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(meta, EpicWorkerMeta):
            return
        for r, v in meta.results.items():
            st = self._active.get(r)
            if st is not None and st.error is None:
                self._results[r] = v
        for key, (tenant, tokens) in meta.learned.items():
            try:
                self.finder.add(key, tokens, tenant)
            except Exception as e:
                _hook_error(f"epic: learning chunk {key} for the finder", e)

    @_per_request(_finished)
    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, when a request finishes or is aborted: forget it, returning the worker's outcome in
        its kv_transfer_params (a link's counts arrive one step after the link: a request that finishes in
        its first step has none) and, for a link, the prompt tokens vLLM's prefix cache provided ("prefix_hit":
        its exact head, or a follow-up's blocks in the link's scope). Its blocks are freed at once (nothing is
        saved asynchronously)."""
        req_id = request.request_id
        self._parsed.pop(req_id, None)
        if self._active.pop(req_id, None) is not None:
            self._finished.append(req_id)
        result = self._results.pop(req_id, None)
        hit, linked = self._prefix_hits.pop(req_id, (0, True))
        if hit:
            result = {**(result or {}), "prefix_hit": hit}
            if not linked:  # nothing left to link: vLLM computed the rest
                result["unlinked"] = True
        return False, ({"epic": result} if result is not None else None)
