"""Prometheus counters of tenant quotas, in prometheus_client's default registry (the one `vllm serve` exposes
on /metrics; vLLM depends on prometheus_client). Labelled by tier or reason only, never by tenant: tenant ids
come from clients, and a label per tenant would let them mint time series. Without prometheus_client the
counters are no-ops (TierStats counts the same events per tier)."""

from __future__ import annotations

try:
    from prometheus_client import Counter
except ImportError:  # pragma: no cover - prometheus_client ships with vLLM and the demo extra
    Counter = None


class _Null:
    def labels(self, *a, **k) -> "_Null":
        return self

    def inc(self, n: float = 1) -> None:
        pass


def _counter(name: str, doc: str, labels: list[str]):
    if Counter is None:
        return _Null()
    try:
        return Counter(name, doc, labels)
    except ValueError:  # already registered (this module imported twice under another name): share it
        from prometheus_client import REGISTRY

        return REGISTRY._names_to_collectors[name]  # noqa: SLF001


QUOTA_EVICTIONS = _counter(
    "epic_rag_store_quota_evictions",
    "chunk entries evicted because their tenant was over its quota in a tier (its own oldest first)",
    ["tier"],
)
QUOTA_REFUSALS = _counter(
    "epic_rag_store_quota_refusals",
    "chunk entries not stored because one alone is over its tenant's quota in a tier",
    ["tier"],
)
COMPILE_REFUSALS = _counter(
    "epic_rag_compile_refusals",
    "client compiles refused before anything was captured or stored, by reason",
    ["reason"],
)
