"""Memory tier: an LRU dict of ChunkKV under a byte budget."""
from __future__ import annotations

from collections import OrderedDict

from .base import ChunkKV, ChunkStore


class MemoryStore(ChunkStore):
    name = "memory"

    def __init__(self, max_bytes: int = 4 << 30) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError("memory store budget must be positive")
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, ChunkKV] = OrderedDict()

    def get(self, key: str) -> ChunkKV | None:
        with self._lock:
            kv = self._items.get(key)
            if kv is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return kv

    def put(self, kv: ChunkKV) -> None:
        if kv.nbytes > self.max_bytes:
            return  # larger than the whole budget: lower tiers keep it
        with self._lock:
            old = self._items.pop(kv.key, None)
            if old is not None:
                self.stats.bytes -= old.nbytes
            self._items[kv.key] = kv
            self.stats.bytes += kv.nbytes
            self.stats.puts += 1
            while self.stats.bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self.stats.bytes -= evicted.nbytes
                self.stats.evictions += 1
            self.stats.entries = len(self._items)

    def delete(self, key: str) -> bool:
        with self._lock:
            kv = self._items.pop(key, None)
            if kv is None:
                return False
            self.stats.bytes -= kv.nbytes
            self.stats.entries = len(self._items)
            return True

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items
