"""EpicConnector's scheduler side: vLLM's scheduler calls these hooks once per step. They read the requests'
jobs (jobs.py; or find chunks in a request that names none), claim what a link provides, and hand the worker
side its loads and captures in EpicMeta; the worker's outcomes come back through EpicWorkerMeta and reach each
request's `kv_transfer_params` when it finishes."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from ...policy import Policy, parse_policy
from .. import vllm_api
from ..jobs import CompileRequest, LinkRequest, epic_params
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


class SchedulerSide:
    """The scheduler-side hooks of EpicConnector (mixed into it; its state set by `_init_scheduler`)."""

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
        self._finished: list[str] = []
        self._kvm = None

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
