"""One submitted request's bookkeeping: its deltas, the outcome of its link, its Generation."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from ..types import Delta, Generation, PreparedRequest
from . import vllm_api
from .jobs import LinkRequest, planned_recompute
from .runtime import Runtime

log = logging.getLogger(__name__)


class LinkFailed(RuntimeError):
    """vLLM failed a linked request before its first token (its link could not be made)."""

    def __init__(self, msg: str, run: RequestRun) -> None:
        super().__init__(msg)
        self.run = run


def last_generation(events: Iterator[Delta | Generation]) -> Generation:
    for ev in events:
        if isinstance(ev, Generation):
            return ev
    raise RuntimeError("generation ended without a result")


@dataclass
class RequestRun:
    """One submitted request: accumulates its deltas, reads the link's outcome, builds the Generation."""

    runtime: Runtime
    req_id: str
    prep: PreparedRequest
    link: LinkRequest | None
    t0: float
    hits: int
    misses: int
    chunk_keys: list[str]
    on_missing: Callable[[Sequence[str]], None] = lambda keys: None  # keys a link did not find
    outcome: dict | None = None  # the connector's report for a link (connector.request_finished)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    t_first: float | None = None
    finish: str | None = None
    cached: int | None = None
    done: bool = False
    logprobs: list | None = None

    def consume(self, d: Delta | BaseException) -> Iterator[Delta | Generation]:
        """Take one delta from the runtime: yields it when it carries text, then the Generation when the
        request finished. Raises the engine's error; a failed link fails the request in vLLM before any
        token of it is produced."""
        if isinstance(d, vllm_api.refused_request_error()):  # bad input (e.g. a schema no grammar takes)
            raise ValueError(f"vLLM refused the request: {d}") from d
        if isinstance(d, BaseException):
            raise d
        if d.token_ids and self.t_first is None:
            self.t_first, self.cached = d.t, d.cached_tokens
        self.text.append(d.text)
        self.token_ids += d.token_ids
        if d.logprobs is not None:
            k = self.prep.options.get("logprobs", 0)
            for lp in d.logprobs:  # vLLM adds the chosen token to the top k when it ranks lower: trim it
                lp["top_logprobs"] = lp["top_logprobs"][:k]
            self.logprobs = (self.logprobs or []) + d.logprobs
        if d.text:
            yield d
        if d.finished:
            self.finish, self.done = d.finish_reason, True
            p = (d.kv_transfer_params or {}).get("epic")
            self.outcome = p if isinstance(p, dict) else None
            if d.finish_reason == "error":  # vLLM failed it (e.g. the connector could not fill its pages)
                # vLLM ends a request whose link failed in that step, before the worker's report reaches it:
                # the cause is in the engine's log
                msg = f"the engine failed request {self.req_id} (vLLM finish reason 'error')"
                if self.link is not None and not self.token_ids:
                    raise LinkFailed(msg, self)
                raise RuntimeError(msg)
            yield self.result()

    def cancel(self) -> None:
        self.runtime.abort(self.req_id)

    def _link_recomputed(self, n: int) -> int:
        """Prompt tokens recomputed by a linked request: the worker's count when it reached us (a request
        that ends in its first step has none: then the plan's count, what the linker recomputes when every
        record is found), plus the tail after the claim."""
        claim, spans = self.link.claimed(n)
        out = self.outcome or {}
        if out.get("missing"):
            self.on_missing(out["missing"])
        hit = self.prefix_hit
        if hit >= claim or out.get("unlinked"):  # vLLM's prefix cache held (nearly) the whole claim: not linked
            return n - hit
        if isinstance(out.get("recomputed"), int):
            linked = out["recomputed"]
        else:
            linked = planned_recompute(claim, [(s.start, s.n, s.exact) for s in spans], self.link.policy)
        return linked + (n - claim)

    @property
    def prefix_hit(self) -> int:
        """A link's prompt tokens from vLLM's prefix cache (the scheduler side's count; see request_finished)."""
        hit = (self.outcome or {}).get("prefix_hit", 0)
        return hit if isinstance(hit, int) else 0

    def result(self) -> Generation:
        n, link = len(self.prep.token_ids), self.link
        if link is not None:
            recomputed = self._link_recomputed(n)
        else:
            recomputed = n - (self.cached or 0)  # `prefix`: vLLM's own prefix-cache hits are not recomputed
        if self.prep.policy.links_chunks and not self.prep.chunks:
            # No compiled chunk was found in the prompt: every token was prefilled (stats: linked_tokens == 0).
            log.debug(
                "request %s linked nothing under %s: a full prefill of %d tokens", self.req_id, self.prep.policy.name, n
            )
        now = time.perf_counter()
        return Generation(
            text="".join(self.text),
            token_ids=self.token_ids,
            ttft_s=(self.t_first or now) - self.t0,
            total_s=now - self.t0,
            prompt_tokens=n,
            linked_tokens=n - recomputed,
            recomputed_tokens=recomputed,
            chunk_hits=self.hits,
            chunk_misses=self.misses,
            policy=self.prep.policy.name,
            finish_reason=self.finish,
            chunk_keys=self.chunk_keys,
            prefix_cached_tokens=self.prefix_hit if link is not None else (self.cached or 0),
            logprobs=self.logprobs,
            chunk_order=self.prep.chunk_order,
            escalated=self.prep.escalated,
        )
