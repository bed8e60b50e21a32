"""Find compiled chunk texts inside a prompt that a framework has already rendered to one string.

LlamaIndex and LangChain format retrieved documents into a single prompt before the LLM sees it. The engine
registers the exact text of every chunk it compiles here; a rendered prompt is then split back into glue
strings and ChunkRefs by exact substring matching, and each piece is tokenized on its own (tokenizing the
whole prompt would merge tokens across chunk boundaries, e.g. '.\\n\\n').

Matching uses a fixed-length anchor (the first `anchor` characters of each text) looked up in a hash table
at every prompt position, then confirms a whole text with one comparison. The work is bounded whatever texts
are registered and whatever the prompt holds: at most `per_anchor` texts are kept under one anchor (a newer
one pushes out the least recently used), and one prompt may compare at most BUDGET_PER_CHAR x its length +
BUDGET_BASE characters of candidate texts (then matching stops: the rest of the prompt is glue, recomputed,
never wrong). So a split costs a hash look-up per position and anchor length, and the comparisons' budget:
linear in the prompt, not in the number of registered chunks.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections import OrderedDict

from .types import ChunkRef, Segment

log = logging.getLogger(__name__)

MAX_TEXTS = 100_000  # texts remembered (least recently added or matched go first)
MAX_BYTES = 256 << 20  # and at most this much memory of text
PER_ANCHOR = 8  # texts kept under one anchor
BUDGET_PER_CHAR, BUDGET_BASE = 2, 1 << 16  # characters of candidate texts one split may compare


class ChunkTextIndex:
    """Registered chunk texts (text -> ChunkRef) and the splitting of rendered prompts.

    Texts shorter than `min_chars` are not matched (they would match ordinary prose by accident). A match
    must also sit on word boundaries: a chunk starting or ending with a letter or digit is not matched
    inside a longer word. At most `max_texts` texts of at most `max_bytes` together are kept (LRU), and
    `per_anchor` under one anchor: a forgotten chunk is still linked when given as a ChunkRef; inside a
    rendered string it is then plain glue (recomputed, never wrong).
    """

    def __init__(
        self,
        min_chars: int = 16,
        anchor: int = 32,
        max_texts: int = MAX_TEXTS,
        max_bytes: int = MAX_BYTES,
        per_anchor: int = PER_ANCHOR,
    ) -> None:
        if min_chars < 1 or anchor < min_chars:
            raise ValueError("need 1 <= min_chars <= anchor")
        if max_texts < 1 or max_bytes < 1 or per_anchor < 1:
            raise ValueError("max_texts, max_bytes and per_anchor must be at least 1")
        self.min_chars = min_chars
        self.anchor = anchor
        self.max_texts, self.max_bytes, self.per_anchor = max_texts, max_bytes, per_anchor
        self.nbytes = 0
        self._refs: OrderedDict[str, ChunkRef] = OrderedDict()
        # anchor length -> anchor string -> texts starting with it (least recently used first)
        self._tables: dict[int, dict[str, dict[str, None]]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._refs)

    def __contains__(self, text: object) -> bool:
        return text in self._refs

    def get(self, text: str) -> ChunkRef | None:
        return self._refs.get(text)

    def add(self, ref: ChunkRef) -> None:
        """Register a compiled chunk by its text (a later ref for the same text replaces the earlier)."""
        text = ref.text
        if not text or len(text) < self.min_chars:
            return
        with self._lock:
            known = text in self._refs
            self._refs[text] = ref
            self._touch(text)
            if known:
                return
            self.nbytes += sys.getsizeof(text)
            bucket = self._bucket(text, create=True)
            bucket[text] = None
            if len(bucket) > self.per_anchor:
                self._forget(next(iter(bucket)))
            while len(self._refs) > self.max_texts or (self.nbytes > self.max_bytes and self._refs):
                self._forget(next(iter(self._refs)))

    def _bucket(self, text: str, create: bool = False) -> dict[str, None]:
        n = min(len(text), self.anchor)
        table = self._tables.setdefault(n, {}) if create else self._tables[n]
        return table.setdefault(text[:n], {}) if create else table[text[:n]]

    def _touch(self, text: str) -> None:
        """Mark `text` most recently used (the lock is held)."""
        self._refs.move_to_end(text)
        n = min(len(text), self.anchor)
        bucket = self._tables.get(n, {}).get(text[:n])
        if bucket is not None and text in bucket:
            del bucket[text]
            bucket[text] = None

    def _forget(self, text: str) -> None:
        """Drop `text` (the lock is held)."""
        del self._refs[text]
        self.nbytes -= sys.getsizeof(text)
        n = min(len(text), self.anchor)
        table = self._tables[n]
        texts = table[text[:n]]
        del texts[text]
        if not texts:
            del table[text[:n]]
            if not table:
                del self._tables[n]

    def find(self, prompt: str) -> list[tuple[int, int, ChunkRef]]:
        """Non-overlapping (start, end, ref) matches, left to right; the longest text wins at one start."""
        if not self._refs or len(prompt) < self.min_chars:
            return []
        found: list[tuple[int, int, str]] = []
        budget = BUDGET_PER_CHAR * len(prompt) + BUDGET_BASE
        with self._lock:
            tables = sorted(self._tables.items())
            i = 0
            while i < len(prompt):
                best: tuple[int, int, str] | None = None
                for n, table in tables:
                    for t in table.get(prompt[i : i + n], ()) if i + n <= len(prompt) else ():
                        budget -= len(t)
                        if budget < 0:
                            log.warning("chunk text matching: comparison budget spent; the rest is glue")
                            return self._resolve(found)
                        if prompt.startswith(t, i) and _on_boundaries(prompt, i, i + len(t)):
                            if best is None or len(t) > best[1] - best[0]:
                                best = (i, i + len(t), t)
                if best is None:
                    i += 1
                else:
                    # Leftmost, then longest, wins: nothing starting inside it is looked at (a chunk's own
                    # repeated boilerplate, e.g. pydoc's "Data descriptors defined here", spent the budget).
                    found.append(best)
                    i = best[1]
            return self._resolve(found)

    def _resolve(self, found: list[tuple[int, int, str]]) -> list[tuple[int, int, ChunkRef]]:
        """The matches (already leftmost-longest, non-overlapping) with their refs, each text marked recently
        used (the lock is held)."""
        for _, _, t in found:
            self._touch(t)
        return [(s, e, self._refs[t]) for s, e, t in found]

    def split(self, prompt: str) -> list[Segment]:
        """The prompt as glue strings and ChunkRefs (in order; concatenating their texts gives the prompt)."""
        if not isinstance(prompt, str):
            raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
        segments: list[Segment] = []
        pos = 0
        for s, e, ref in self.find(prompt):
            if s > pos:
                segments.append(prompt[pos:s])
            segments.append(ref)
            pos = e
        if pos < len(prompt):
            segments.append(prompt[pos:])
        return segments


def _on_boundaries(prompt: str, s: int, e: int) -> bool:
    if s > 0 and prompt[s - 1].isalnum() and prompt[s].isalnum():
        return False
    if e < len(prompt) and prompt[e].isalnum() and prompt[e - 1].isalnum():
        return False
    return True
