"""Prometheus metrics of one demo app (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from epic_rag.policy import parse_policy

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _StoreCollector:
    """Chunk store counters per tier (engine.store.tier_stats()), read at each scrape."""

    def __init__(self, get_engine, library) -> None:
        self._engine = get_engine
        self._library = library

    def collect(self):
        engine = self._engine()
        tiers: dict[str, dict] = dict(engine.store.tier_stats()) if engine is not None else {}
        if engine is not None:  # the in-process cache of leading glue (never in the shared tiers)
            tiers["glue"] = next(iter(engine.chunks.glue.tier_stats().values()))
        counters = {
            "hits": "chunk lookups the tier answered",
            "misses": "chunk lookups the tier missed",
            "puts": "chunks written",
            "evictions": "chunks evicted",
            "errors": "tier errors",
            "corrupt": "corrupt entries dropped",
            "fleet_waits": "compiles left to another replica sharing the tier (its entry loaded instead)",
            "fleet_takeovers": "waits for another replica's compile that ended in compiling here",
        }
        for name, doc in counters.items():
            fam = CounterMetricFamily(f"epic_rag_store_{name}", doc, labels=["tier"])
            for tier, st in tiers.items():
                if name in st:
                    fam.add_metric([tier], float(st[name]))
            yield fam
        for name, doc in {"bytes": "bytes held", "entries": "chunks held"}.items():
            fam = GaugeMetricFamily(f"epic_rag_store_{name}", doc, labels=["tier"])
            for tier, st in tiers.items():
                if name in st:
                    fam.add_metric([tier], float(st[name]))
            yield fam
        p = self._library.status()
        g = GaugeMetricFamily("epic_rag_corpus", "documents and chunks in the demo corpus", labels=["what"])
        for what in ("documents", "chunks", "embedded", "compiled", "refined"):
            g.add_metric([what], float(p[what]))
        yield g


def policy_label(name: str, known: frozenset[str]) -> str:
    """A Prometheus label from a fixed set: a known policy name (the page's and the default), else the
    policy's kind ("legolink-123456" -> "legolink"), so clients cannot mint new time series."""
    if name in known:
        return name
    try:
        return parse_policy(name).kind
    except ValueError:
        return "other"


class DemoMetrics:
    def __init__(self, get_engine, library, known_policies: frozenset[str] = frozenset()) -> None:
        self.known_policies = known_policies
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "epic_rag_http_requests", "HTTP requests by route and status", ["route", "method", "status"], registry=r
        )
        self.chat = Counter(
            "epic_rag_chat_completions",
            "chat completions by policy and outcome",
            ["policy", "stream", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "epic_rag_time_to_first_token_seconds",
            "engine time to first token",
            ["policy"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.retrieval = Histogram(
            "epic_rag_retrieval_seconds",
            "query embedding + FAISS search",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=r,
        )
        self.prompt_tokens = Counter("epic_rag_prompt_tokens", "prompt tokens", ["policy"], registry=r)
        self.linked_tokens = Counter(
            "epic_rag_linked_tokens", "prompt tokens whose KV was linked from the store", ["policy"], registry=r
        )
        self.recomputed_tokens = Counter(
            "epic_rag_recomputed_tokens", "prompt tokens recomputed", ["policy"], registry=r
        )
        self.generation_tokens = Counter("epic_rag_generation_tokens", "generated tokens", ["policy"], registry=r)
        self.chunk_hits = Counter(
            "epic_rag_request_chunk_hits", "chunks found compiled in the store", ["policy"], registry=r
        )
        self.chunk_misses = Counter(
            "epic_rag_request_chunk_misses", "chunks compiled at question time", ["policy"], registry=r
        )
        self.errors = Counter("epic_rag_errors", "errors by kind", ["kind"], registry=r)
        self.auto = Counter(
            "epic_rag_auto_policy",
            "requests under policy auto, by the policy it ran (refined chunks: fast)",
            ["ran"],
            registry=r,
        )
        self.escalated = Counter(
            "epic_rag_escalated_requests",
            "requests under policy auto that its guard ran as a full prefill, by reason (engine/guard.py)",
            ["reason"],
            registry=r,
        )
        self.inflight = Gauge("epic_rag_inflight_requests", "chat completions in progress", registry=r)
        r.register(_StoreCollector(get_engine, library))

    def policy(self, name: str) -> str:
        return policy_label(name, self.known_policies)

    def observe_generation(self, gen, stream: bool, asked: str | None = None) -> None:
        """A finished answer, counted under the policy it ran (`asked`: the name the request gave, e.g. auto)."""
        p = self.policy(gen.policy)
        self.chat.labels(p, str(stream).lower(), "ok").inc()
        if asked == "auto":
            self.auto.labels(p).inc()
        if gen.escalated:
            self.escalated.labels(gen.escalated).inc()
        self.ttft.labels(p).observe(gen.ttft_s)
        self.prompt_tokens.labels(p).inc(gen.prompt_tokens)
        self.linked_tokens.labels(p).inc(gen.linked_tokens)
        self.recomputed_tokens.labels(p).inc(gen.recomputed_tokens)
        self.generation_tokens.labels(p).inc(len(gen.token_ids))
        self.chunk_hits.labels(p).inc(gen.chunk_hits)
        self.chunk_misses.labels(p).inc(gen.chunk_misses)

    def render(self) -> bytes:
        return generate_latest(self.registry)
