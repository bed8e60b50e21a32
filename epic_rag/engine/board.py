"""In-process hand-off between the engine (caller threads) and the connector (vLLM's step).

The engine runs vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so link jobs (which hold chunk
KV tensors) are passed by reference here, and only their ids travel through vLLM's request params.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from .linker import LinkJob


@dataclass(slots=True)
class Capture:
    """KV being captured from a compile request: k, v: [L, T, Hkv, D] for prompt positions offset.."""

    k: torch.Tensor
    v: torch.Tensor
    offset: int                 # dummy-prefix tokens whose KV is dropped
    filled_to: int = 0          # prompt positions captured so far (absolute)
    error: str | None = None


class Board:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, LinkJob] = {}
        self._captures: dict[str, Capture] = {}

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
