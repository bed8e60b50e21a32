"""The RAG trace's workload (`epic-rag bench trace`; the run itself is trace_run.py): a corpus of pydoc chunks,
questions generated from them, Zipf-skewed topic popularity, top-k embedding retrieval and multi-turn
conversations, all deterministic from the settings' seed.

- Corpus: the first `chunks` chunks of `chunk_tokens` tokens of the pydoc corpus, cut as the demo cuts its
  documents (corpus.chunk_document), embedded with MiniLM into a FAISS index (pydocqa.Retriever).
- Questions: each chunk's documented functions and methods (a header line `name(args)` followed by a
  docstring) give demo-style questions (pydocqa.open_question: "How do I <summary> with <module>?", "What
  does <module>.<name> do?"); a chunk without one gets a question about its first sentence of prose. Each
  question carries a reference answer (the entry's signature and summary), used as the assistant's previous
  answer in a follow-up turn, so that every policy gets token-identical prompts.
- Requests: a new conversation draws its topic chunk from a Zipf law over the chunks (rank r with
  probability ~ 1 / r**zipf_s, ranks assigned to chunks by a seeded shuffle), one of the topic's questions,
  and k ~ U[k_min, k_max]; its chunks are the question's top k by embedding search (the topic chunk among
  them or not, as retrieval finds). With probability `follow_share` a request is instead the next turn of a
  recent conversation (its last turn between min_gap and max_gap requests back, fewer than max_turns turns):
  the same chunks in the same order, the earlier turns' questions and answers, and a new question about the
  same topic chunk.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
import json
import random
import re
from collections.abc import Callable, Sequence

from ..corpus import TextChunk, chunk_document, pydoc_documents
from ..prompt import DEFAULT_INSTRUCTION
from .load import SweepSettings
from .pydocqa import DocFunction, open_question

ACCURATE_POLICY = "auto"  # the engine's default: legolink-16 where every chunk is refined, else query-20
FAST_POLICY = "legolink-16"
# Generic follow-ups, asked once a topic's own questions are used up.
FOLLOW_UPS = (
    "Can you show a short example of that?",
    "What arguments does it take?",
    "What does it return?",
    "Is there anything to watch out for when using it?",
)


@dataclasses.dataclass(frozen=True)
class TraceSettings(SweepSettings):
    """The trace's workload, the sweep to saturation per policy (SweepSettings, longer budget: the hit rates
    over time need minutes of run), and the scored and follow-up measurements."""

    max_minutes: float = 6.0
    chunks: int = 300
    chunk_tokens: int = 256  # as the demo cuts its corpus
    # as the demo does: every chunk the trace retrieves refined behind its nearest corpus chunks by the trace's
    # own FAISS index (EpicEngine.refine), after the plain compile and before any policy runs; 0: plain records
    refine_neighbours: int = 2
    zipf_s: float = 1.0  # topic popularity: rank r drawn with probability ~ 1 / r**zipf_s
    k_min: int = 4  # retrieved chunks per conversation, uniform in [k_min, k_max]
    k_max: int = 8
    follow_share: float = 0.3  # requests that are a recent conversation's next turn
    max_turns: int = 3
    min_gap: int = 2  # a follow-up comes min_gap to max_gap requests after its conversation's last turn
    max_gap: int = 24
    # conversations (all their turns) answered greedily by every policy and compared with full's answers: about
    # 11 requests, ~45 s per request for the four policies in fp32 on 2 cores
    scored: int = 8
    answer_tokens: int = 32  # the scored answers' length at most (EOS ends them): a first sentence fits
    followups: int = 8  # conversations of the follow-up measurement
    hit_window_s: float = 60.0  # hit rates over time: windows of this many seconds
    steady_after_s: float = 60.0  # the steady state is judged on the windows after this
    steady_tolerance: float = 0.05  # steady: the later half of those windows within this of the earlier half


QUICK_SETTINGS = TraceSettings(
    output_tokens=4,
    unloaded_requests=1,
    start_load=1.0,
    window_s=1.0,
    min_requests=3,
    max_requests=3,
    max_minutes=0.3,
    max_steps=2,
    chunks=12,
    chunk_tokens=96,
    k_min=2,
    k_max=3,
    follow_share=0.5,
    max_turns=2,
    min_gap=1,
    max_gap=4,
    scored=1,
    answer_tokens=8,
    followups=1,
    hit_window_s=2.0,
    steady_after_s=1.0,
)


# ---------------------------------------------------------------------- corpus and questions
@dataclasses.dataclass(frozen=True)
class Question:
    text: str
    answer: str  # a reference answer: the assistant's earlier answer when a follow-up repeats this turn


def trace_corpus(tokenizer, n: int, chunk_tokens: int) -> list[TextChunk]:
    """The first n distinct chunks of the pydoc corpus, cut as the demo cuts its documents."""
    out, seen = [], set()
    for doc in pydoc_documents():
        for c in chunk_document(doc, tokenizer, chunk_tokens):
            if c.text not in seen:
                seen.add(c.text)
                out.append(c)
            if len(out) == n:
                return out
    raise ValueError(f"the pydoc corpus has {len(out)} chunks of {chunk_tokens} tokens, {n} asked")


_GUTTER = re.compile(r"^\s*\|")  # pydoc's class-body gutter ("     |  method(self)")
_HEADER = re.compile(r"^([A-Za-z_]\w*)\((.*)\)(?:\s+from\s+\S+)?$")
_CLASS = re.compile(r"^class ([A-Za-z]\w*)\b")


def _lines(text: str) -> list[tuple[int, str]]:
    """(indent, text) per line, pydoc's class gutter removed."""
    out = []
    for raw in text.split("\n"):
        line = _GUTTER.sub("", raw, count=1).rstrip()
        out.append((len(line) - len(line.lstrip()), line.strip()))
    return out


def _sentence(words: str) -> str:
    return re.split(r"(?<=[.!?])\s", " ".join(words.split()), maxsplit=1)[0].rstrip(".")


_SECTION = re.compile(r"^[A-Z][A-Z ]+$")  # pydoc's section headers (DESCRIPTION, FUNCTIONS, DATA)


def _paragraphs(lines: list[tuple[int, str]]) -> list[tuple[int, int, str]]:
    """(first line's index, its indent, text) per run of non-blank lines; section headers end a run."""
    out: list[tuple[int, int, str]] = []
    prev_blank = True
    for i, (indent, line) in enumerate(lines):
        if not line or _SECTION.match(line):
            prev_blank = True
        elif prev_blank:
            out.append((i, indent, line))
            prev_blank = False
        else:
            out[-1] = (out[-1][0], out[-1][1], f"{out[-1][2]} {line}")
    return out


def chunk_entries(module: str, text: str) -> list[DocFunction]:
    """The documented functions and methods in a chunk: a header line `name(args)` followed by its docstring
    (indented deeper, or for a class's signature line, the next paragraph). Methods are named Class.method
    when the chunk shows their class; single-underscore names are private, dunders are kept."""
    lines = _lines(text)
    raw = text.split("\n")
    out, cls = [], None
    for i, (indent, line) in enumerate(lines):
        if m := _CLASS.match(line):
            cls = m[1]
            continue
        m = _HEADER.match(line)
        if not m or (m[1].startswith("_") and not m[1].startswith("__")):
            continue
        signature = i > 0 and _CLASS.match(lines[i - 1][1]) is not None  # a class's own signature line
        rest = lines[i + 1 :]
        if signature:
            rest = list(itertools.dropwhile(lambda x: not x[1], rest))
            body = list(itertools.takewhile(lambda x: x[1] and x[0] >= indent, rest))
        else:
            body = list(itertools.takewhile(lambda x: x[1] and x[0] > indent, rest))
        summary = _sentence(" ".join(t for _, t in body)).replace("``", "")
        if len(summary.split()) < 3 or _HEADER.match(summary):
            continue
        method = bool(_GUTTER.match(raw[i]))
        name = f"{cls}.{m[1]}" if method and cls and not signature else (cls if signature else m[1])
        out.append(DocFunction(module, name, line, summary))
    return out


BOILERPLATE = ("automatically generated", "Python Library Documentation", "MODULE REFERENCE")
QUESTION_WORDS = 16  # a prose question quotes at most this many words


def chunk_questions(module: str, text: str) -> list[Question]:
    """A chunk's questions (see the module docstring): one per documented entry, else one about its first
    sentence of prose, else one about the chunk's module."""
    entries = chunk_entries(module, text)
    public = [f for f in entries if not f.name.rpartition(".")[2].startswith("_")]  # dunders only when alone
    qs = []
    for f in public or entries:
        # seeded by the entry: the same chunk asks the same questions in every run
        q = open_question(f, random.Random(f"{module}.{f.name}"))
        qs.append(Question(q, f"`{module}.{f.name}` ({f.entry}): {f.summary}."))
    if qs:
        return list({q.text: q for q in qs}.values())
    for _, _, para in _paragraphs(_lines(text)):
        sentence = _sentence(para)
        words = sentence.split()
        prose = not _HEADER.match(para) and " = " not in sentence  # not an entry, not a DATA definition
        if len(words) >= 6 and prose and not any(b in para for b in BOILERPLATE):
            quoted = " ".join(words[:QUESTION_WORDS]) + (" ..." if len(words) > QUESTION_WORDS else "")
            return [Question(f'What does the {module} documentation mean by "{quoted}"?', f"{sentence}.")]
    return [Question(f"What is documented here about the {module} module?", f"Part of the {module} module.")]


def module_of(chunk: TextChunk) -> str:
    return chunk.doc.removeprefix("pydoc-").removesuffix(".txt")


# ---------------------------------------------------------------------- popularity
def zipf_weights(n: int, s: float) -> list[float]:
    """P(rank r) for r = 1..n, proportional to 1 / r**s (s = 0: uniform)."""
    w = [1.0 / r**s for r in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def popularity_order(n: int, seed: int) -> list[int]:
    """The chunk at each popularity rank: a seeded shuffle, so popularity is not the corpus order."""
    order = list(range(n))
    random.Random(f"popularity:{seed}").shuffle(order)
    return order


def zipf_draws(n_items: int, n: int, s: float, rng: random.Random) -> list[int]:
    """n popularity ranks (0-based) drawn from zipf_weights(n_items, s)."""
    cum = list(itertools.accumulate(zipf_weights(n_items, s)))
    return [min(bisect.bisect_left(cum, rng.random() * cum[-1]), n_items - 1) for _ in range(n)]


# ---------------------------------------------------------------------- conversations
@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: turn `turn` (0: the first) of conversation `conversation` about chunk
    `topic`, over `chunks` (indices, in prompt order); questions[i] is turn i's question, answers[i] its
    answer as the follow-up shows it (len(answers) == turn)."""

    index: int
    conversation: int
    turn: int
    topic: int
    chunks: tuple[int, ...]
    questions: tuple[str, ...]
    answers: tuple[str, ...]

    def messages(self, texts: Sequence[str]) -> list[dict]:
        """The chat: the first user message holds the documents as RagRequest's default template lays them
        out (so chunks are linked behind the lead they were compiled behind), then the turns."""
        docs = "".join(f"Document {i + 1}:\n{texts[c]}\n\n" for i, c in enumerate(self.chunks))
        out = [{"role": "user", "content": f"{DEFAULT_INSTRUCTION}{docs}Question: {self.questions[0]}"}]
        for a, q in zip(self.answers, self.questions[1:], strict=True):
            out += [{"role": "assistant", "content": a}, {"role": "user", "content": q}]
        return out


@dataclasses.dataclass
class _Conversation:
    id: int
    topic: int
    k: int
    pending: list[Question]  # its next questions, in order
    asked: list[Question]
    last: int  # index of its latest turn


def build_trace(
    questions: Sequence[Sequence[Question]],
    retrieve: Callable[[list[str], int], list[list[int]]],
    n: int,
    s: TraceSettings,
) -> list[TraceRequest]:
    """n requests (see the module docstring). `questions[c]`: chunk c's questions (at least one each);
    `retrieve(queries, k)`: each query's top-k chunk indices, best first (one call, for every conversation)."""
    rng = random.Random(f"trace:{s.seed}")
    order = popularity_order(len(questions), s.seed)
    convs: list[_Conversation] = []
    plan: list[tuple[int, int]] = []  # (conversation, turn) per request
    for i in range(n):
        open_ = [
            c
            for c in convs
            if len(c.asked) < s.max_turns and s.min_gap <= i - c.last <= s.max_gap
            # a follow-up is sent after its conversation's previous turn; never before its first turn's
        ]
        if open_ and rng.random() < s.follow_share:
            c = rng.choice(open_)
            c.asked.append(c.pending.pop(0) if c.pending else _generic(c, rng))
            c.last = i
        else:
            topic = order[zipf_draws(len(questions), 1, s.zipf_s, rng)[0]]
            qs = list(questions[topic])
            rng.shuffle(qs)
            c = _Conversation(len(convs), topic, rng.randint(s.k_min, s.k_max), qs[1:], [qs[0]], i)
            convs.append(c)
        plan.append((c.id, len(c.asked) - 1))
    ranked = retrieve([c.asked[0].text for c in convs], s.k_max) if convs else []
    out = []
    for i, (cid, turn) in enumerate(plan):
        c = convs[cid]
        asked = c.asked[: turn + 1]
        out.append(
            TraceRequest(
                i,
                cid,
                turn,
                c.topic,
                tuple(ranked[cid][: c.k]),
                tuple(q.text for q in asked),
                tuple(q.answer for q in asked[:-1]),
            )
        )
    return out


def _generic(c: _Conversation, rng: random.Random) -> Question:
    used = {q.text for q in c.asked}
    left = [q for q in FOLLOW_UPS if q not in used] or list(FOLLOW_UPS)
    return Question(rng.choice(left), c.asked[0].answer)


def trace_digest(trace: Sequence[TraceRequest]) -> str:
    """A short hash of the trace's content (what every policy is sent)."""
    rows = [[r.conversation, r.turn, r.topic, list(r.chunks), list(r.questions), list(r.answers)] for r in trace]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def conversations(trace: Sequence[TraceRequest]) -> dict[int, list[TraceRequest]]:
    """The trace's requests per conversation, turns in order (conversations in order of their first turn)."""
    out: dict[int, list[TraceRequest]] = {}
    for r in trace:
        out.setdefault(r.conversation, []).append(r)
    return out


def trace_length(s: TraceSettings) -> int:
    """The trace's requests: as many as a policy can be sent (the warm-up, the unloaded ones and every step at
    its maximum), and a tail where the follow-up measurement finds more two-turn conversations."""
    return 1 + s.unloaded_requests + s.max_steps * s.max_requests + 4 * s.followups
