"""The hand-off between the engine (caller threads) and the connector (inside vLLM's step).

Its records: a LinkJob (what one request links: chunk spans and policy; the worker writes back how many
tokens it recomputed or why it failed) and a Capture (buffers a compile request's KV is copied into).
The engine runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so both are passed by reference on the
Board, and only their ids travel through vLLM's request params (kv_transfer_params).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass

import torch

from ..policy import Policy
from ..store import ChunkKV


@dataclass(slots=True)
class LinkSpan:
    start: int  # first prompt position of the chunk
    kv: ChunkKV
    exact: bool = False  # KV already exact here (a leading prefix compiled at position 0): never recomputed


@dataclass(slots=True)
class LinkJob:
    """Everything the worker needs to link one request (held in-process, referenced by job_id)."""

    job_id: str
    token_ids: list[int]  # prompt[:claim]
    spans: list[LinkSpan]
    policy: Policy
    recomputed: int = 0  # filled by the linker: tokens recomputed in the last layer
    error: str | None = None

    @classmethod
    def for_prompt(cls, token_ids: list[int], spans: list[LinkSpan], policy: Policy) -> tuple[LinkJob, int]:
        """The job for a prompt and the number of leading tokens it claims: up to the end of the last span,
        always leaving the prompt's last token for vLLM to compute (it yields the first logits). A span cut
        by the claim is truncated to the claimed part."""
        last_end = max(s.start + s.kv.num_tokens for s in spans)
        claim = min(last_end, len(token_ids) - 1)
        kept = [LinkSpan(s.start, s.kv.slice(0, claim - s.start), s.exact) for s in spans if s.start < claim]
        return cls(uuid.uuid4().hex, token_ids[:claim], kept, policy), claim

    def initial_recompute(self) -> torch.Tensor:
        """Sorted positions recomputed from layer 0 on.  # -> [nR] int64"""
        T = len(self.token_ids)
        cached = torch.zeros(T, dtype=torch.bool)
        head = torch.zeros(T, dtype=torch.bool)
        for s in self.spans:
            cached[s.start : s.start + s.kv.num_tokens] = True
            if self.policy.kind == "legolink" and not s.exact:
                head[s.start : s.start + min(self.policy.k, s.kv.num_tokens)] = True
        if self.policy.kind == "cacheblend":
            return torch.arange(T)
        return torch.nonzero(~cached | head).flatten()

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cached, candidate): positions with cached KV, and those a blend may choose to recompute."""
        T = len(self.token_ids)
        cached = torch.zeros(T, dtype=torch.bool)
        candidate = torch.zeros(T, dtype=torch.bool)
        for s in self.spans:
            cached[s.start : s.start + s.kv.num_tokens] = True
            candidate[s.start : s.start + s.kv.num_tokens] = not s.exact
        return cached, candidate


@dataclass(slots=True)
class Capture:
    """KV being captured from a compile request whose prompt is [lead] + chunk: k, v: [L, 1 + n, Hkv, D] keep
    the lead's first token (the sink) and the chunk. The rest of the lead is shared glue, not stored. The
    sink's key is moved to position lead-1, right before the chunk, so the record is one contiguous run
    (a first token's KV does not depend on its position except through the key's rotation)."""

    k: torch.Tensor
    v: torch.Tensor
    lead: int = 1  # prompt tokens before the chunk (sink included)
    filled_to: int = 0  # prompt positions captured so far
    error: str | None = None

    def kept(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """The kept parts of prompt positions [start, end): (first, stop, buffer index of first)."""
        if self.lead <= 1:
            return [(start, end, start)] if end > start else []
        out = [(start, min(end, 1), start)] if start < 1 else []
        first = max(start, self.lead)
        if first < end:
            out.append((first, end, first - self.lead + 1))
        return [r for r in out if r[1] > r[0]]


class Board:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, LinkJob] = {}
        self._captures: dict[str, Capture] = {}

    def pending(self) -> tuple[int, int]:
        """(link jobs, captures) currently posted: both are 0 when nothing is in flight."""
        with self._lock:
            return len(self._jobs), len(self._captures)

    def post_job(self, job: LinkJob) -> None:
        with self._lock:
            self._jobs[job.job_id] = job

    def job(self, job_id: str) -> LinkJob | None:
        with self._lock:
            return self._jobs.get(job_id)

    def drop_job(self, job_id: str) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def post_capture(self, cap_id: str, cap: Capture) -> None:
        with self._lock:
            self._captures[cap_id] = cap

    def capture(self, cap_id: str) -> Capture | None:
        with self._lock:
            return self._captures.get(cap_id)

    def pop_capture(self, cap_id: str) -> Capture | None:
        with self._lock:
            return self._captures.pop(cap_id, None)


BOARD = Board()
