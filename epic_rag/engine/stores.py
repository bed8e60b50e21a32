"""The stores a worker links from and compiles into, found from the connector's extra config.

The connector reads chunk KV itself (a link job names records by key, jobs.py), so the worker side needs
the stores. Two ways to name them in `kv_connector_extra_config`:
- {"local": handle}: an EpicEngine whose engine core runs in this process registered its stores under
  `handle` (register_local): the worker uses the very same objects, so compiled chunks in its memory tier are
  visible to both sides;
- {"store": spec}: the worker opens the spec itself (epic_rag.store.open_store): vLLM's multiprocess engine
  core, `vllm serve`. Its memory tier is the worker's own; disk and Redis tiers are shared as usual. Entries
  are read through the key check (store/checked.py) with the worker's own fingerprint, glue too.
Either way the glue store (system prompts and other client-controlled text before the first chunk) is a
bounded, process-private LRU, never shared; and the records this process compiled lately are kept in a
bounded process-private LRU too (`recent`: references to the same tensors a memory tier holds, so no second
copy there), from which links read them when the chunk store does not have them: it refused the write (a
full or read-only disk, Redis down: tiers log and go on) or its copy was lost or damaged since.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..keys import record_key
from ..store import ChunkKV, ChunkStore, KeyCheckedStore, MemoryStore, RecordHead, open_store

# The glue before the first chunk (system prompt, instructions) is client-controlled: its KV stays in this
# bounded process-private LRU and never reaches the shared tiers, where every new system prompt would add
# an entry no budget was set for.
GLUE_CACHE_BYTES = 256 << 20
RECENT_CACHE_BYTES = 256 << 20
RETRY_S = 2.0  # a chunk store that refused a write is offered the next one after this long


@dataclass(slots=True)
class ChunkStores:
    chunks: ChunkStore  # compiled chunks (read through the key check)
    glue: ChunkStore  # leading prefixes, process-private
    recent: ChunkStore = field(default_factory=lambda: MemoryStore(max_bytes=RECENT_CACHE_BYTES))
    _retry_at: float = 0.0  # when a record read from `recent` is next offered to the chunk store again

    def get(self, key: str, glue: bool = False) -> ChunkKV | None:
        """A record, read and checked (exact spans are leading prefixes: in the glue store). One found only
        in `recent` is written to the chunk store again (at most every RETRY_S while it refuses), so the
        fleet finds it there once Redis is back, the disk has room, or a damaged file is replaced."""
        if glue:
            return self.glue.get(key)
        kv = self.chunks.get(key)
        if kv is not None:
            return kv
        kv = self.recent.get(key)
        if kv is not None and time.monotonic() >= self._retry_at:
            self.chunks.put(kv)
            if not self.chunks.contains(key):
                self._retry_at = time.monotonic() + RETRY_S
        return kv

    def peek(self, key: str, glue: bool = False) -> RecordHead | None:
        """A record's tokens and context without its KV (ChunkStore.peek), from where `get` would read it."""
        if glue:
            return self.glue.peek(key)
        return self.chunks.peek(key) or self.recent.peek(key)

    def put(self, kv: ChunkKV, glue: bool = False) -> None:
        """Store a record this process compiled."""
        if glue:
            self.glue.put(kv)
            return
        self.chunks.put(kv)
        self.recent.put(kv)

    def forget_recent(self) -> None:
        """Drop `recent` (the chunk store was swapped: records are looked up in the new one only)."""
        self.recent.clear()
        self._retry_at = 0.0


_LOCAL: dict[str, ChunkStores] = {}
_OPENED: dict[tuple[str, str], ChunkStores] = {}
_lock = threading.Lock()


def new_glue_store() -> ChunkStore:
    return MemoryStore(max_bytes=GLUE_CACHE_BYTES)


def register_local(stores: ChunkStores) -> str:
    """A handle the connector of this process resolves to `stores` (unregister_local when done)."""
    handle = uuid.uuid4().hex
    with _lock:
        _LOCAL[handle] = stores
    return handle


def unregister_local(handle: str) -> None:
    with _lock:
        _LOCAL.pop(handle, None)


def worker_stores(extra: dict[str, Any], fingerprint: str) -> ChunkStores:
    """The stores named by the connector's extra config (see the module docstring); one per spec and
    fingerprint in a process. Raises ValueError for a handle of another process or a malformed spec."""
    if "local" in extra:
        with _lock:
            stores = _LOCAL.get(extra["local"])
        if stores is None:
            raise ValueError(
                "kv_connector_extra_config names in-process stores this process does not hold: the engine core "
                "runs in another process; name a store spec ('store') instead"
            )
        return stores
    spec = extra.get("store", "memory")
    if not isinstance(spec, str):
        raise ValueError(f"kv_connector_extra_config['store'] must be a store spec string, got {spec!r}")
    with _lock:
        stores = _OPENED.get((spec, fingerprint))
        if stores is None:
            stores = _OPENED[(spec, fingerprint)] = ChunkStores(
                checked_store(open_store(spec), fingerprint), checked_store(new_glue_store(), fingerprint)
            )
        return stores


def checked_store(store: ChunkStore, fingerprint: str) -> KeyCheckedStore:
    """`store` read through the key check: a record is served only under the key its own tenant, lead and
    tokens hash to (keys.record_key), so one computed in another context or filed under another key is a miss."""
    return KeyCheckedStore(store, lambda kv: record_key(fingerprint, kv))
