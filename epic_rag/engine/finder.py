"""Compiled chunks found in a prompt's token ids, for clients that name no spans (the scheduler side).

The scheduler-side connector learns the chunks the worker compiles (each record's key and the chunk's own
tokens, from the compile outcome) and indexes them by their first ANCHOR tokens. A prompt is scanned left to
right: where the next ANCHOR tokens start a known chunk and the next n tokens equal it exactly, that chunk is
a span (the record's sink left out: the prompt holds the chunk's own tokens, as legolink's default form
links it), and the scan goes on after it. Token-level, no separator strings: a chunk whose text tokenizes
differently inside the prompt (a merge across its edge) is not found, and is computed like any prompt text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..policy import SINK_LEN
from .jobs import SpanRef

ANCHOR = 16  # tokens a chunk is looked up by; shorter chunks are not indexed
MAX_CHUNKS = 100_000  # chunks remembered (least recently learned or found dropped first)


class ChunkFinder:
    def __init__(self, max_chunks: int = MAX_CHUNKS) -> None:
        self.max_chunks = max_chunks
        self._chunks: OrderedDict[str, tuple[int, ...]] = OrderedDict()  # key -> chunk tokens
        self._by_anchor: dict[tuple[int, ...], dict[str, None]] = {}  # first ANCHOR tokens -> keys
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._chunks)

    def add(self, key: str, tokens: list[int]) -> None:
        """Learn a stored chunk record: its key and the chunk's tokens (without the sink)."""
        if len(tokens) < ANCHOR:
            return
        with self._lock:
            if key in self._chunks:
                self._chunks.move_to_end(key)
                return
            self._chunks[key] = tuple(tokens)
            self._by_anchor.setdefault(tuple(tokens[:ANCHOR]), {})[key] = None
            while len(self._chunks) > self.max_chunks:
                old, toks = self._chunks.popitem(last=False)
                keys = self._by_anchor[toks[:ANCHOR]]
                del keys[old]
                if not keys:
                    del self._by_anchor[toks[:ANCHOR]]

    def find(self, prompt: list[int]) -> list[SpanRef]:
        """The known chunks in `prompt`, left to right, as spans of their records (longest match first
        where two known chunks start alike)."""
        spans: list[SpanRef] = []
        p, n = 0, len(prompt)
        with self._lock:
            if not self._by_anchor:
                return spans
            while p + ANCHOR <= n:
                keys = self._by_anchor.get(tuple(prompt[p : p + ANCHOR]))
                hit = None
                for key in keys or ():
                    toks = self._chunks[key]
                    if len(toks) <= n - p and tuple(prompt[p : p + len(toks)]) == toks:
                        if hit is None or len(toks) > len(hit[1]):
                            hit = (key, toks)
                if hit is None:
                    p += 1
                    continue
                spans.append(SpanRef(hit[0], SINK_LEN, p, len(hit[1])))
                self._chunks.move_to_end(hit[0])
                p += len(hit[1])
        return spans
