"""What EpicConnector's scheduler side hands its worker side in each step (EpicMeta: the loads and captures to
start) and what comes back (EpicWorkerMeta: their outcomes), as vLLM's KV connector metadata. Nothing else
crosses between the two sides: they may run in different processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from ..jobs import CompileRequest, LinkRequest


@dataclass(slots=True)
class LoadSpec:
    """One link to start on the worker: the request's claimed prompt and the paged positions [start, end) to fill."""

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
    """One step of a compile's prefill: copy the KV of positions [start, end) out of the request's pages."""

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
    """The scheduler side's orders for one step."""

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
