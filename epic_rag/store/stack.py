"""A stack of tiers behind one ChunkStore: look-ups go down, hits are promoted up, writes go through."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from .base import ChunkKV, ChunkStore, FleetLock, RecordHead, check_key

log = logging.getLogger(__name__)


class TieredStore(ChunkStore):
    """tiers[0] is the fastest (usually memory). A failing tier is logged and skipped, never fatal."""

    def __init__(self, tiers: Sequence[ChunkStore]) -> None:
        super().__init__()
        if not tiers:
            raise ValueError("a tiered store needs at least one tier")
        self.tiers = list(tiers)
        seen: dict[str, int] = {}
        for t in self.tiers:  # unique names for tier_stats: disk, disk2, ...
            base = t.name
            seen[base] = seen.get(base, 0) + 1
            if seen[base] > 1:
                t.name = f"{base}{seen[base]}"
        self.name = "+".join(t.name for t in self.tiers)

    def __repr__(self) -> str:
        return f"TieredStore({self.tiers!r})"

    def _safe(self, tier: ChunkStore, what: str, fn, default=None):
        try:  # keys were checked above, so anything raised here is the tier's own trouble
            return fn()
        except Exception:
            log.exception("store tier %s: %s failed; continuing with the other tiers", tier.name, what)
            with tier._lock:
                tier.stats.errors += 1
            return default

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        t0 = time.perf_counter()
        for i, tier in enumerate(self.tiers):
            kv = self._safe(tier, "get", lambda: tier.get(key))
            if kv is None:
                continue
            # promoted nearest tier first: each copies from the tier below's own copy (the gpu tier from the
            # memory tier's page-locked one), and the record returned is the top tier's (on the GPU)
            for upper in reversed(self.tiers[:i]):
                kv = self._safe(upper, "promote", lambda: upper.promote(kv), kv)
            with self._lock:
                self.stats.record_load(t0)
            return kv
        with self._lock:
            self.stats.misses += 1
        return None

    def peek(self, key: str) -> RecordHead | None:
        check_key(key)
        for tier in self.tiers:
            head = self._safe(tier, "peek", lambda: tier.peek(key))
            if head is not None:
                return head
        return None

    def put(self, kv: ChunkKV) -> None:
        check_key(kv.key)
        for tier in self.tiers:
            self._safe(tier, "put", lambda: tier.put(kv))
        with self._lock:
            self.stats.puts += 1

    def delete(self, key: str) -> bool:
        check_key(key)
        return any([bool(self._safe(t, "delete", lambda: t.delete(key), False)) for t in self.tiers])

    def keys(self) -> list[str]:
        out: dict[str, None] = {}
        for t in self.tiers:
            out.update(dict.fromkeys(self._safe(t, "keys", t.keys, [])))
        return list(out)

    def contains(self, key: str) -> bool:
        check_key(key)
        return any(self._safe(t, "contains", lambda: t.contains(key), False) for t in self.tiers)

    def usage(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in reversed(self.tiers):
            out.update(self._safe(t, "usage", t.usage, {}))
        return out

    def refresh(self) -> None:
        for t in self.tiers:
            self._safe(t, "refresh", t.refresh)

    def clear(self) -> int:
        return sum(self._safe(t, "clear", t.clear, 0) for t in self.tiers)

    def tier_stats(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for t in self.tiers:
            out.update(t.tier_stats())
        return out

    def fleet_lock(self, key: str) -> FleetLock | None:
        """The first shared tier's lock (a stack over Redis locks compiles across the fleet)."""
        for t in self.tiers:
            lock = t.fleet_lock(key)
            if lock is not None:
                return lock
        return None

    def close(self) -> None:
        for t in self.tiers:
            self._safe(t, "close", t.close)
