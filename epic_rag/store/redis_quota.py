"""Per-tenant quota bookkeeping of the Redis tier: each tenant's entries listed in Redis, its oldest evicted.

Where a TenantQuota is set, each tenant's entries are listed in PREFIX@tenant<tag>.<tenant id>.lru (a sorted
set: key -> last write or hit) and .bytes (a hash: key -> size), kept by every replica; a write that takes its
tenant over the quota deletes that tenant's least recently used entries (members whose entry expired or was
evicted by Redis are dropped from the lists first). Without a quota nothing is listed and no command is added.
The lists live in Redis, not in a process, because every replica of a fleet writes into the same namespace.
"""

from __future__ import annotations

import time

from .metrics import QUOTA_EVICTIONS


class TenantLedger:
    """The tenant lists of one RedisStore; every command goes through the tier's `_call` (its back-off)."""

    def __init__(self, tier, skip: object) -> None:
        self.tier = tier  # the RedisStore (not imported: it imports this module)
        self._skip = skip  # what tier._call returns for a command skipped or failed

    @property
    def head(self) -> str:
        """How every list's name starts (`clear` drops them with the entries)."""
        return f"{self.tier.prefix}@tenant{self.tier._tag}."

    def names(self, tenant: str) -> tuple[str, str]:
        """(LRU sorted set, sizes hash) of a tenant's entries in this namespace."""
        base = self.head + (tenant or "none")
        return base + ".lru", base + ".bytes"

    def touch(self, tenant: str, key: str) -> None:
        """A hit: `key` becomes its tenant's most recently used (XX: only while it is listed)."""
        lru = self.names(tenant)[0]
        self.tier._call(lambda c: c.zadd(lru, {key: time.time()}, xx=True), write=True)

    def enforce(self, tenant: str, key: str, size: int) -> None:
        """List `key` (just written) under its tenant, then delete the tenant's oldest entries while over quota."""
        tier, quota = self.tier, self.tier.quota
        lru, sizes = self.names(tenant)

        def listed(c):
            pipe = c.pipeline(transaction=False)
            pipe.zadd(lru, {key: time.time()})
            pipe.hset(sizes, key, size)
            pipe.zrange(lru, 0, -1)  # least recently used first
            pipe.hgetall(sizes)
            return pipe.execute()

        res = tier._call(listed, write=True)
        if res is self._skip:
            return
        own = [(k.decode("utf-8", "replace"), int(res[3].get(k, 0))) for k in res[2]]
        if not quota.over(sum(n for _, n in own), len(own)):
            return

        # members whose entry is gone (expired, evicted by Redis, dropped) leave the lists first: not evictions
        def exists(c):
            pipe = c.pipeline(transaction=False)
            for k, _ in own:
                pipe.exists(f"{tier.prefix}{k}{tier._tag}")
            return pipe.execute()

        alive = tier._call(exists)
        if alive is self._skip:
            return
        stale = [k for (k, _), a in zip(own, alive) if not a and k != key]
        own = [(k, n) for (k, n), a in zip(own, alive) if a or k == key]
        nbytes, n = sum(b for _, b in own), len(own)
        victims = []
        for k, b in own:
            if not quota.over(nbytes, n):
                break
            if k != key:
                victims.append(k)
                nbytes, n = nbytes - b, n - 1
        evicted = 0
        for k in victims:
            try:
                evicted += tier.delete(k)
            except ValueError:  # a member that is no chunk key (planted): just unlisted
                pass
        gone = stale + victims
        if gone:
            tier._call(lambda c: (c.zrem(lru, *gone), c.hdel(sizes, *gone)), write=True)
        if evicted:
            QUOTA_EVICTIONS.labels(tier.name).inc(evicted)
            with tier._lock:
                tier.stats.evictions += evicted
                tier.stats.quota_evictions += evicted

    def usage(self, raw: list[bytes]) -> dict[str, tuple[int, int]]:
        """tenant id -> (bytes, entries) from the lists among `raw` (the namespace's names; "" is the default)."""
        out = {}
        for name in raw:
            text = name.decode("utf-8", "replace")
            if text.startswith(self.head) and text.endswith(".bytes"):
                t = text[len(self.head) : -len(".bytes")]
                sizes = self.tier._call(lambda c: c.hvals(name))
                if sizes is not self._skip:
                    out["" if t == "none" else t] = (sum(int(x) for x in sizes), len(sizes))
        return out
