"""Find compiled chunk texts inside a prompt that a framework has already rendered to one string.

LlamaIndex and LangChain format retrieved documents into a single prompt before the LLM sees it. The engine
registers the exact text of every chunk it compiles here; a rendered prompt is then split back into glue
strings and ChunkRefs by exact substring matching, and each piece is tokenized on its own (tokenizing the
whole prompt would merge tokens across chunk boundaries, e.g. '.\\n\\n').

Matching uses a fixed-length anchor (the first `anchor` characters of each text) looked up in a hash table
at every prompt position, then confirms the whole text; cost is linear in the prompt length, not in the
number of registered chunks.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from .types import ChunkRef, Segment

MAX_TEXTS = 100_000  # texts remembered (least recently added or matched go first): memory stays bounded


class ChunkTextIndex:
    """Registered chunk texts (text -> ChunkRef) and the splitting of rendered prompts.

    Texts shorter than `min_chars` are not matched (they would match ordinary prose by accident). A match
    must also sit on word boundaries: a chunk starting or ending with a letter or digit is not matched
    inside a longer word. At most `max_texts` texts are kept (LRU): a forgotten chunk is still linked when
    given as a ChunkRef; inside a rendered string it is then plain glue (recomputed, never wrong).
    """

    def __init__(self, min_chars: int = 16, anchor: int = 32, max_texts: int = MAX_TEXTS) -> None:
        if min_chars < 1 or anchor < min_chars:
            raise ValueError("need 1 <= min_chars <= anchor")
        if max_texts < 1:
            raise ValueError("max_texts must be at least 1")
        self.min_chars = min_chars
        self.anchor = anchor
        self.max_texts = max_texts
        self._refs: OrderedDict[str, ChunkRef] = OrderedDict()
        # anchor length -> anchor string -> texts starting with it
        self._tables: dict[int, dict[str, list[str]]] = {}
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
            self._refs.move_to_end(text)
            if known:
                return
            n = min(len(text), self.anchor)
            table = self._tables.get(n)
            if table is None:
                table = self._tables[n] = {}
            table.setdefault(text[:n], []).append(text)
            while len(self._refs) > self.max_texts:
                self._forget(self._refs.popitem(last=False)[0])

    def _forget(self, text: str) -> None:
        """Drop `text` from its anchor table (the lock is held)."""
        n = min(len(text), self.anchor)
        table = self._tables[n]
        texts = table[text[:n]]
        texts.remove(text)
        if not texts:
            del table[text[:n]]
            if not table:
                del self._tables[n]

    def find(self, prompt: str) -> list[tuple[int, int, ChunkRef]]:
        """Non-overlapping (start, end, ref) matches, left to right; the longest text wins at one start."""
        if not self._refs or len(prompt) < self.min_chars:
            return []
        with self._lock:
            tables = list(self._tables.items())
        found: list[tuple[int, int, str]] = []
        for n, table in tables:
            for i in range(len(prompt) - n + 1):
                texts = table.get(prompt[i : i + n])
                if texts:
                    for t in tuple(texts):
                        if prompt.startswith(t, i) and _on_boundaries(prompt, i, i + len(t)):
                            found.append((i, i + len(t), t))
        found.sort(key=lambda m: (m[0], -m[1]))
        out: list[tuple[int, int, ChunkRef]] = []
        pos = 0
        with self._lock:
            for s, e, t in found:
                ref = self._refs.get(t)  # None: forgotten since the tables were read
                if s >= pos and ref is not None:
                    out.append((s, e, ref))
                    self._refs.move_to_end(t)
                    pos = e
        return out

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
