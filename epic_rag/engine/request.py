"""One submitted request's bookkeeping: its deltas, the outcome of its link, its Generation."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..types import Delta, Generation, PreparedRequest
from . import vllm_api
from .board import BOARD, LinkJob
from .runtime import Runtime

log = logging.getLogger(__name__)


def last_generation(events: Iterator[Delta | Generation]) -> Generation:
    for ev in events:
        if isinstance(ev, Generation):
            return ev
    raise RuntimeError("generation ended without a result")


@dataclass
class RequestRun:
    """One submitted request: accumulates its deltas, checks the link outcome, builds the Generation."""

    runtime: Runtime
    req_id: str
    prep: PreparedRequest
    job: LinkJob | None
    t0: float
    hits: int
    misses: int
    chunk_keys: list[str]
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    t_first: float | None = None
    finish: str | None = None
    cached: int | None = None
    done: bool = False
    logprobs: list | None = None

    def consume(self, d: Delta | BaseException) -> Iterator[Delta | Generation]:
        """Take one delta from the runtime: yields it when it carries text, then the Generation when the
        request finished. Raises the engine's error, or a link failure before any token of a wrongly
        linked answer is passed on."""
        if isinstance(d, vllm_api.refused_request_error()):  # bad input (e.g. a schema no grammar takes)
            raise ValueError(f"vLLM refused the request: {d}") from d
        if isinstance(d, BaseException):
            raise d
        if d.token_ids and self.t_first is None:
            self.t_first, self.cached = d.t, d.cached_tokens
            if self.job is not None and self.job.error:
                raise RuntimeError(f"linking failed, answer discarded: {self.job.error}")
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
            if d.finish_reason == "error":  # vLLM failed it (e.g. the connector could not fill its pages)
                if self.job is not None:
                    BOARD.drop_job(self.job.job_id)
                raise RuntimeError(f"the engine failed request {self.req_id} (vLLM finish reason 'error')")
            yield self.result()

    def cancel(self) -> None:
        self.runtime.abort(self.req_id)
        if self.job is not None:
            BOARD.drop_job(self.job.job_id)

    def result(self) -> Generation:
        n, job = len(self.prep.token_ids), self.job
        if job is not None:
            BOARD.drop_job(job.job_id)
            if job.error:
                raise RuntimeError(f"linking failed, answer discarded: {job.error}")
            recomputed = job.recomputed + (n - len(job.token_ids))
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
            prefix_cached_tokens=0 if job is not None else (self.cached or 0),
            logprobs=self.logprobs,
        )
