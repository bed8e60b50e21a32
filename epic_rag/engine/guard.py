"""The look-alike guard of policy `auto`: whether a request asks for a record that has a look-alike in another
linked chunk, in which case it is answered with exact KV (policy.AUTO_ESCALATED) instead of a link.

Why: chunks are compiled apart, so a record of one shape in a later chunk never saw the earlier ones; linked,
it "looks like the first of its kind" and the question's attention can go to it instead of the asked record.
On look-alike lookups every linking policy loses 33-42 points to full and no choice of recomputed tokens repairs
it (docs/bench/qwen-frontier/lookalike-dev.md); compiling each chunk behind its neighbours closes part of the
gap only. The failure needs a question key with a near twin in another chunk, which is cheap to see in the text.

A key is a word of the question that names one thing: it holds a digit or a `-`, `_` or `.` inside it (part
codes, versions, identifiers, dotted names), or it is capitalised other than at the start of a sentence, a
quotation or a line (names). A look-alike of a key is another word of the chunks that
- for a key of three or more `-_.`-separated parts, differs in exactly one part (HT-8957-B / HT-8975-B,
  1.13.0 / 1.14.0, sync_report_v2 / fetch_report_v2);
- for a two-part key, differs in its first part (archive_ledger / validate_ledger: the same name on another
  owner), or in its last part by a near edit (AX-4521 / AX-4512; os.path / os.stat are siblings);
- for a one-part key of 5+ characters, is a near edit of it with the same capital (Lindqvist / Linddvist).
A near edit: at most max(1, min(2, len // 4)) edits (Damerau-Levenshtein) between words of 2+ characters; an
inflection such as a plural (option_string / option_strings) never counts. The request is escalated when a key
has a look-alike and the key and its look-alikes sit in two or more chunks (twins inside one chunk were
compiled together, and saw each other).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rapidfuzz.distance import DamerauLevenshtein

from ..types import Chunk, ChunkRef, RagRequest

WORD = re.compile(r"[A-Za-z0-9$]+(?:[-_.][A-Za-z0-9]+)*")
PARTS = re.compile(r"[-_.]")
SPECIAL = re.compile(r"<\|[^|>]*\|>")  # chat-template markers (<|im_start|>): template text, not the question
SENTENCE_START = ".!?:\"'(`"  # a capitalised word right after one of these (or first) is not taken as a name
INFLECTIONS = ("s", "es", "ed", "d", "ing", "er", "ly")
REASON = "lookalike-keys"


@dataclass(frozen=True, slots=True)
class Twin:
    """A question key and a look-alike of it in the linked chunks."""

    key: str
    lookalike: str
    chunk: int  # the chunk holding the look-alike (prompt order)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The guard's decision for one request: escalate (reason set) or link as planned (reason None)."""

    reason: str | None
    twins: tuple[Twin, ...] = ()

    @property
    def escalate(self) -> bool:
        return self.reason is not None


def question_keys(question: str) -> set[str]:
    """The question's keys (see the module docstring)."""
    text = SPECIAL.sub(" ", question)
    keys = set()
    for m in WORD.finditer(text):
        w, gap = m.group(), text[: m.start()]
        before = gap.rstrip()
        starts = not before or before[-1] in SENTENCE_START or "\n" in gap[len(before) :]
        code = any(c.isdigit() for c in w) or PARTS.search(w) is not None
        name = w[0].isupper() and len(w) >= 3 and not starts
        if code or name:
            keys.add(w)
    return keys


def is_lookalike(key: str, word: str) -> bool:
    """Whether `word` is a near twin of `key`: one `-_.` part changed, or a short edit of a one-part key."""
    if word == key or word.lower() == key.lower():
        return False
    a, b = PARTS.split(key), PARTS.split(word)
    if len(a) != len(b):
        return False
    if len(a) == 1:  # a name: a twin keeps its capital (None / one is no twin) and has 5+ characters
        return len(key) >= 5 and key[0].isupper() == word[0].isupper() and _near(key, word)
    changed = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    # a two-part name with another last part is a sibling (os.path / os.stat, random.seed / random.shuffle): a
    # twin only where that part is a near edit; the same last part on another owner is one (archive_ledger /
    # validate_ledger), and with three parts or more any one part may change
    if len(changed) != 1:
        return False
    i = changed[0]
    return len(a) >= 3 or i < len(a) - 1 or _near(a[i], b[i])


def _near(a: str, b: str) -> bool:
    """A near edit: not an inflection, between words of 2+ characters, within the cutoff."""
    if min(len(a), len(b)) < 2 or _inflection(a, b):
        return False
    cutoff = max(1, min(2, max(len(a), len(b)) // 4))
    return DamerauLevenshtein.distance(a, b, score_cutoff=cutoff) <= cutoff


def _inflection(a: str, b: str) -> bool:
    short, long = sorted((a.lower(), b.lower()), key=len)
    return long.startswith(short) and long[len(short) :] in INFLECTIONS


def check(question: str, chunks: Iterable[str]) -> Verdict:
    """The guard's verdict for a question over the linked chunks' texts (in prompt order). `chunks` is read only
    when the question has a key: a generator spares the texts' making (decoding) for the requests without one."""
    keys = question_keys(question)
    if not keys:
        return Verdict(None)
    words = [set(WORD.findall(c)) for c in chunks]
    twins: list[Twin] = []
    for key in sorted(keys):
        held = {i for i, ws in enumerate(words) if key in ws}
        near = [Twin(key, w, i) for i, ws in enumerate(words) for w in ws if is_lookalike(key, w)]
        if near and len(held | {t.chunk for t in near}) >= 2:
            twins += sorted(near, key=lambda t: (t.chunk, t.lookalike))
    return Verdict(REASON if twins else None, tuple(twins))


def question_text(request: object, segments: Sequence) -> str:
    """What the guard reads keys from: a RagRequest's question; for a rendered prompt or segment list, its plain
    text after the last chunk (a RAG template's question, or a chat's turns after the documents)."""
    if isinstance(request, RagRequest):
        return request.question
    last = max((i for i, s in enumerate(segments) if isinstance(s, (Chunk, ChunkRef))), default=-1)
    return "".join(s for s in segments[last + 1 :] if isinstance(s, str))


def describe(v: Verdict) -> str:
    """The twins, for a log line: "HT-8957-B ~ HT-8975-B (chunk 3), ..."."""
    return ", ".join(f"{t.key} ~ {t.lookalike} (chunk {t.chunk})" for t in v.twins)
