"""Compiled chunks found in a prompt's token ids, for clients that name no spans (the scheduler side).

The scheduler-side connector learns the chunks the worker compiles (each record's key, its tenant and the
chunk's own tokens, from the compile outcome) and indexes them by tenant and by the window of their first
ANCHOR tokens. A prompt is scanned left to right for its tenant only: where the window at a position is a
known anchor and the next n tokens equal one of its chunks exactly, that chunk is a span (the record's sink
left out: the prompt holds the chunk's own tokens, as legolink's default form links it), and the scan goes on
after it. Token-level, no separator strings: a chunk whose text tokenizes differently inside the prompt (a
merge across its edge) is not found, and is computed like any prompt text.

This runs on vLLM's scheduler thread, so its work is bounded whatever clients compile and send:
- a window is looked up by its bytes in a dict (hashed: one look-up per prompt position);
- at most PER_ANCHOR chunks are kept per (tenant, anchor) (a newer one pushes out the least recently used);
- a chunk is confirmed by one comparison of its int64 bytes (memcmp), and a request may compare at most
  BUDGET_PER_TOKEN x its prompt length + BUDGET_BASE tokens in all (then the scan stops: what was found is
  linked, the rest computed, never wrong);
- the index holds at most MAX_BYTES of chunk tokens (least recently learned or found dropped first).
"""

from __future__ import annotations

import logging
import sys
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from ...policy import SINK_LEN
from ..jobs import SpanRef

log = logging.getLogger(__name__)

ANCHOR = 16  # tokens a chunk is looked up by; shorter chunks are not indexed
PER_ANCHOR = 8  # chunks kept under one tenant's anchor
MAX_BYTES = 256 << 20  # chunk tokens (and their index entries) remembered, in bytes
BUDGET_PER_TOKEN, BUDGET_BASE = 2, 1 << 16  # chunk tokens one find may compare beyond the anchor look-ups
_ITEM = array("q").itemsize  # 8: tokens are compared as int64 bytes
_OVERHEAD = 256  # bytes an entry costs besides its tokens (key, dict slots, the entry itself), roughly


@dataclass(slots=True)
class _Entry:
    tenant: str
    anchor: bytes  # the first ANCHOR tokens' bytes
    tokens: bytes  # the chunk's tokens as int64 bytes
    n: int  # tokens

    @property
    def nbytes(self) -> int:
        return len(self.tokens) + sys.getsizeof(self.anchor) + _OVERHEAD


class ChunkFinder:
    def __init__(self, max_bytes: int = MAX_BYTES, per_anchor: int = PER_ANCHOR) -> None:
        self.max_bytes, self.per_anchor = max_bytes, per_anchor
        self.nbytes = 0
        self._chunks: OrderedDict[str, _Entry] = OrderedDict()  # key -> entry, least recently used first
        self._anchors: dict[str, dict[bytes, dict[str, None]]] = {}  # tenant -> anchor -> keys (LRU order)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._chunks)

    def add(self, key: str, tokens: list[int], tenant: str = "") -> None:
        """Learn a stored chunk record of `tenant`: its key and the chunk's tokens (without the sink)."""
        if len(tokens) < ANCHOR:
            return
        data = array("q", tokens).tobytes()
        with self._lock:
            if key in self._chunks:
                self._touch(key)
                return
            e = _Entry(tenant, data[: ANCHOR * _ITEM], data, len(tokens))
            bucket = self._anchors.setdefault(tenant, {}).setdefault(e.anchor, {})
            bucket[key] = None
            self._chunks[key] = e
            self.nbytes += e.nbytes
            if len(bucket) > self.per_anchor:
                self._drop(next(iter(bucket)))
            while self.nbytes > self.max_bytes and self._chunks:
                self._drop(next(iter(self._chunks)))

    def find(self, prompt: list[int], tenant: str = "") -> list[SpanRef]:
        """`tenant`'s known chunks in `prompt`, left to right, as spans of their records (the longest where two
        known chunks start alike; see the module docstring for the bounds)."""
        spans: list[SpanRef] = []
        n = len(prompt)
        with self._lock:
            anchors = self._anchors.get(tenant)
            if not anchors or n < ANCHOR:
                return spans
            data = array("q", prompt).tobytes()
            budget = BUDGET_PER_TOKEN * n + BUDGET_BASE
            w, p = ANCHOR * _ITEM, 0
            while p + ANCHOR <= n:
                keys = anchors.get(data[p * _ITEM : p * _ITEM + w])
                hit: tuple[str, _Entry] | None = None
                for key in keys or ():
                    e = self._chunks[key]
                    if e.n > n - p or (hit is not None and e.n <= hit[1].n):
                        continue
                    budget -= e.n
                    if budget < 0:
                        log.warning("chunk finder: comparison budget spent at position %d of %d; rest computed", p, n)
                        return spans
                    if data.startswith(e.tokens, p * _ITEM):
                        hit = (key, e)
                if hit is None:
                    p += 1
                    continue
                spans.append(SpanRef(hit[0], SINK_LEN, p, hit[1].n))
                self._touch(hit[0])
                p += hit[1].n
        return spans

    def _touch(self, key: str) -> None:
        """Mark `key` most recently used, in the whole index and under its anchor (the lock is held)."""
        e = self._chunks[key]
        self._chunks.move_to_end(key)
        bucket = self._anchors[e.tenant][e.anchor]
        del bucket[key]
        bucket[key] = None

    def _drop(self, key: str) -> None:
        """Forget `key` (the lock is held)."""
        e = self._chunks.pop(key)
        self.nbytes -= e.nbytes
        anchors = self._anchors[e.tenant]
        bucket = anchors[e.anchor]
        del bucket[key]
        if not bucket:
            del anchors[e.anchor]
            if not anchors:
                del self._anchors[e.tenant]
