"""A store view that serves an entry only under the key its own token ids hash to.

Tiers check that an entry's header names the key asked for, but a header is whatever its writer put there:
an entry filed under chunk A's key that holds chunk B's tokens and KV (planted in a shared folder or Redis,
or written by a buggy peer) would be served as A. The reader that knows the fingerprint (the engine) wraps
its store in this view with a function that recomputes an entry's key from its token ids; a mismatch is a
miss (counted and logged), so the chunk is recompiled and the genuine entry overwrites the bad one.

The check lives in a view rather than in the tiers because one store may serve several models (keys carry
the fingerprint): a tier cannot know which fingerprint a key was made with, the engine asking for it can.
Nothing is deleted on a mismatch: a key handed in by a client may be another model's genuine entry.
"""

from __future__ import annotations

from collections.abc import Callable

from .base import ChunkKV, ChunkStore, FleetLock, RecordHead


class KeyCheckedStore(ChunkStore):
    """`inner` seen through `expected_key(entry)`: the key the entry's tokens hash to (None: none at all)."""

    def __init__(self, inner: ChunkStore, expected_key: Callable[[ChunkKV], str | None]) -> None:
        super().__init__()
        self.inner, self.expected_key = inner, expected_key
        self.name = inner.name

    def __repr__(self) -> str:
        return f"KeyCheckedStore({self.inner!r})"

    def get(self, key: str) -> ChunkKV | None:
        kv = self.inner.get(key)
        if kv is None or self.expected_key(kv) == key:
            return kv
        with self._lock:
            self.stats.corrupt += 1
        self._log_error(
            "misfiled", "chunk %s: the stored entry's tokens do not hash to its key; refused, recompiling", key
        )
        return None

    def peek(self, key: str) -> RecordHead | None:
        return self.inner.peek(key)  # a filter only: what is used comes through `get`, checked above

    def put(self, kv: ChunkKV) -> None:
        self.inner.put(kv)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def contains(self, key: str) -> bool:
        return self.inner.contains(key)

    def usage(self) -> dict[str, int]:
        return self.inner.usage()

    def refresh(self) -> None:
        self.inner.refresh()

    def clear(self) -> int:
        return self.inner.clear()

    def tier_stats(self) -> dict[str, dict[str, float]]:
        return self.inner.tier_stats()

    def fleet_lock(self, key: str) -> FleetLock | None:
        return self.inner.fleet_lock(key)

    def close(self) -> None:
        self.inner.close()
