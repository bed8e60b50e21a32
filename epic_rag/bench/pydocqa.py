"""Evaluation sets over the demo's corpus (Python's pydoc text, `builtin:pydoc`), generated deterministically.

- docs-QA: "Which function of the M module is described as "<summary>"?" where the summary is the first
  sentence of the function's docstring. The answer chunk is a run of M's FUNCTIONS entries (the function
  among its alphabetical neighbours, so it must be read, not guessed from the module), shown with three
  distractor runs from other modules in random order. Scored by the function's name in the answer.
- open: demo-style questions ("How do I get ... with M?", "What does M.f do?") answered over the top 4
  chunks the demo's retrieval finds (MiniLM + FAISS over 256-token chunks of the whole corpus). There is no
  gold answer: each policy is scored against `full`'s answer.

Every sample is built from a random.Random seeded by its own id, so a sample's content does not depend on
how many samples are asked for (results stay resumable and paired when --samples changes).
"""

from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache

from ..corpus import PYDOC_MODULES, pydoc_documents
from .datasets import Sample

_SECTION = re.compile(r"^[A-Z][A-Z ]+$")
_ENTRY = re.compile(r"^    (?! )(\S.*)$")  # 4-space indent: an entry's header line
_FUNC = re.compile(r"^([A-Za-z]\w*)\(")
ENTRY_LINES = 8  # header + the first paragraph, at most this many lines (long docstrings are cut)
RUN_TOKENS = 320  # a run of entries (one chunk) stays within this many tokens
DISTRACTORS = 3


@dataclass(frozen=True, slots=True)
class DocFunction:
    module: str
    name: str
    entry: str  # as pydoc renders it: the header, then the first paragraph indented by 8
    summary: str  # the docstring's first sentence, without its final period


@dataclass(frozen=True, slots=True)
class ModuleDoc:
    module: str
    title: str  # pydoc's first line ("Python Library Documentation: module os.path in os")
    functions: tuple[DocFunction, ...]


def _first_sentence(paragraph: str) -> str:
    text = " ".join(paragraph.split())
    return re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0].rstrip(".")


def _entries(lines: list[str]) -> list[list[str]]:
    """The FUNCTIONS section's entries, each a list of lines (header first)."""
    out: list[list[str]] = []
    for line in lines:
        if _ENTRY.match(line):
            out.append([line])
        elif out and (line.startswith("        ") or not line.strip()):
            out[-1].append(line)
    return out


@lru_cache(maxsize=2)
def pydoc_modules(modules: tuple[str, ...] = tuple(PYDOC_MODULES)) -> tuple[ModuleDoc, ...]:
    """Each module's public functions from its pydoc FUNCTIONS section, in pydoc's (alphabetical) order."""
    out = []
    for doc in pydoc_documents(list(modules)):
        module = doc.name.removeprefix("pydoc-").removesuffix(".txt")
        lines = doc.text.splitlines()
        try:
            start = lines.index("FUNCTIONS") + 1
        except ValueError:
            continue
        end = next((i for i in range(start, len(lines)) if _SECTION.match(lines[i])), len(lines))
        funcs = []
        for entry in _entries(lines[start:end]):
            m = _FUNC.match(entry[0].strip())
            if not m or m[1].startswith("_"):
                continue  # aliases ("x = f(...)") and private names
            body: list[str] = []
            for line in entry[1:]:
                if not line.strip():
                    if body:
                        break
                    continue
                body.append(line.rstrip())
            if not body:
                continue
            shown = [entry[0].rstrip()] + body[: ENTRY_LINES - 1]
            funcs.append(DocFunction(module, m[1], "\n".join(shown), _first_sentence(" ".join(body))))
        title = lines[0].strip()
        if not title.endswith(f" {module}"):  # os.path documents itself as "module posixpath"
            title = f"Python Library Documentation: module {module}"
        if funcs:
            out.append(ModuleDoc(module, title, tuple(funcs)))
    return tuple(out)


def _key(s: str) -> str:
    return " ".join(re.findall(r"\w+", s.lower()))


def docsqa_candidates(mods: tuple[ModuleDoc, ...]) -> list[DocFunction]:
    """Functions whose summary names them unambiguously: 4 to 30 words, shared with no other function,
    without the function's own name in it, no doctest, and a name unique within its module."""
    summaries = Counter(_key(f.summary) for m in mods for f in m.functions)
    out = []
    for m in mods:
        names = Counter(f.name for f in m.functions)
        for f in m.functions:
            words = f.summary.split()
            if not 4 <= len(words) <= 30 or summaries[_key(f.summary)] > 1 or names[f.name] > 1:
                continue
            if ">>>" in f.summary or re.search(rf"(?<!\w){re.escape(f.name)}(?!\w)", f.summary, re.I):
                continue
            out.append(f)
    return out


def _ntok(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def _run_text(mod: ModuleDoc, entries: list[DocFunction]) -> str:
    # pydoc's own layout: the title, the section header, entries separated by an indented blank line
    return f"{mod.title}\n\nFUNCTIONS\n" + "\n    \n".join(e.entry for e in entries)


def function_run(tokenizer, mod: ModuleDoc, at: int, rng: random.Random, budget: int = RUN_TOKENS) -> str:
    """A chunk: entry `at` of `mod` with neighbours around it (a random number before it), within budget."""
    fs = list(mod.functions)
    start = max(0, at - rng.randint(0, 3))
    run = fs[start : at + 1]
    while len(run) > 1 and _ntok(tokenizer, _run_text(mod, run)) > budget:
        run = run[1:]  # the entries before the target go first
    end = at + 1
    while end < len(fs) and _ntok(tokenizer, _run_text(mod, run + [fs[end]])) <= budget:
        run.append(fs[end])
        end += 1
    start = end - len(run)  # near the section's end: fill the budget backwards
    while start > 0 and _ntok(tokenizer, _run_text(mod, [fs[start - 1]] + run)) <= budget:
        start -= 1
        run.insert(0, fs[start])
    return _run_text(mod, run)


def _stable_order(items: list, salt: str) -> list:
    """A fixed pseudo-random order that does not depend on Python's hash seed or on how many are taken."""
    return sorted(items, key=lambda x: hashlib.sha256(f"{salt}:{x}".encode()).hexdigest())


def _take(order: list[str], n: int, from_end: bool) -> list[str]:
    """The first n of a fixed order, or the last n (a dev split disjoint from the first ones)."""
    return order[::-1][:n] if from_end else order[:n]


def docsqa_samples(
    tokenizer, n: int, modules: tuple[str, ...] = tuple(PYDOC_MODULES), from_end: bool = False
) -> list[Sample]:
    mods = pydoc_modules(modules)
    by_module = {m.module: m for m in mods}
    picked = {f"{f.module}.{f.name}": f for f in docsqa_candidates(mods)}
    out = []
    for qual in _take(_stable_order(list(picked), "docsqa"), n, from_end):
        f = picked[qual]
        sid = f"docsqa-{qual}"
        rng = random.Random(sid)
        mod = by_module[f.module]
        answer_chunk = function_run(tokenizer, mod, mod.functions.index(f), rng)
        # distractors: other modules without a function of the same name (the answer stays unique)
        others = [m for m in mods if m.module != f.module and all(g.name != f.name for g in m.functions)]
        chunks = [answer_chunk] + [
            function_run(tokenizer, m, rng.randrange(len(m.functions)), rng)
            for m in rng.sample(others, min(DISTRACTORS, len(others)))
        ]
        rng.shuffle(chunks)
        out.append(
            Sample(
                id=sid,
                task="docsqa",
                chunks=chunks,
                question=f'Which function of the {f.module} module is described as "{f.summary.replace("``", "")}"?',
                answer=f.name,
                # the module path steers the next token to a function name, the only thing scored
                answer_prefix=f"The function is `{f.module}.",
                meta={"module": f.module, "answer_chunk": chunks.index(answer_chunk)},
            )
        )
    return out


# ---------------------------------------------------------------------- open-ended questions
# Imperative first words of summaries and how a user would phrase them in "How do I ...?"
_VERBS = {"return": "get", "returns": "get", "test": "check", "tests": "check", "get": "get"}
_IMPERATIVE = re.compile(
    r"^(add|apply|build|calculate|change|check|choose|close|compile|compute|convert|copy|create|decode|"
    r"delete|deserialize|dump|encode|escape|expand|find|format|generate|join|list|load|make|match|merge|"
    r"move|normalize|open|parse|print|push|pop|read|recursively|register|remove|rename|replace|reset|"
    r"run|scan|search|serialize|set|shuffle|sort|split|strip|substitute|transform|unpack|wrap|write)$",
    re.I,
)


def open_question(f: DocFunction, rng: random.Random) -> str:
    """A demo-style question about `f`: from its summary when that starts with a verb, else about its name."""
    summary = f.summary.replace("``", "")
    first, _, rest = summary.partition(" ")
    verb = _VERBS.get(first.lower()) or (first.lower() if _IMPERATIVE.match(first) else None)
    if verb == "get" and rest.lower().startswith("true if "):
        verb, rest = "check if", rest[len("true if ") :]
    if verb and rest and len(summary.split()) <= 25:
        return f"How do I {verb} {rest[0].lower() + rest[1:]} with {f.module}?"
    return rng.choice([f"What does {f.module}.{f.name} do?", f"How do I use {f.module}.{f.name}?"])


@dataclass(slots=True)
class Retriever:
    """The demo's retrieval: the corpus in chunk_tokens-token chunks, MiniLM embeddings, FAISS inner
    product over normalised vectors, top k."""

    texts: list[str]
    index: object

    @classmethod
    def build(cls, tokenizer, modules: tuple[str, ...], chunk_tokens: int) -> Retriever:
        from ..corpus import chunk_document

        texts = [c.text for d in pydoc_documents(list(modules)) for c in chunk_document(d, tokenizer, chunk_tokens)]
        return cls.from_texts(texts)

    @classmethod
    def from_texts(cls, texts: list[str]) -> Retriever:
        """An index over these texts' embeddings (cached on disk by the texts' hash)."""
        import faiss
        import numpy as np

        from ..embeddings import sentence_encoder
        from ..paths import cache_dir

        # embedding the corpus takes a while on 2 cores: cached by the chunk texts' hash
        digest = hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:24]
        path = cache_dir() / "bench" / f"pydoc-minilm-{digest}.npy"
        try:
            emb = np.load(path)
        except (OSError, ValueError):
            emb = np.asarray(
                sentence_encoder().encode(texts, normalize_embeddings=True, batch_size=32, show_progress_bar=False),
                dtype=np.float32,
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npy")
            np.save(tmp, emb)
            tmp.replace(path)
        index = faiss.IndexFlatIP(emb.shape[1])
        index.add(emb)
        return cls(texts, index)

    def ranked(self, queries: list[str], k: int) -> list[list[int]]:
        """For each query, the indices of its top-k texts, best first (one batch of embeddings)."""
        import numpy as np

        from ..embeddings import sentence_encoder

        if not queries:
            return []
        vec = np.asarray(
            sentence_encoder().encode(queries, normalize_embeddings=True, batch_size=32, show_progress_bar=False),
            dtype=np.float32,
        )
        _, rows = self.index.search(vec, min(k, len(self.texts)))
        return [[int(r) for r in row if r >= 0] for row in rows]

    def search(self, query: str, k: int) -> list[str]:
        return [self.texts[r] for r in self.ranked([query], k)[0]]


def open_samples(
    tokenizer, n: int, modules: tuple[str, ...] = tuple(PYDOC_MODULES), from_end: bool = False
) -> list[Sample]:
    from epic_rag_demo.config import DemoConfig

    cfg = DemoConfig()  # the demo's defaults: chunk size and top k
    mods = pydoc_modules(modules)
    funcs = {f"{f.module}.{f.name}": f for m in mods for f in m.functions}
    quals = _take(_stable_order(list(funcs), "open"), n, from_end)
    if not quals:
        return []
    retriever = Retriever.build(tokenizer, modules, cfg.chunk_tokens)
    out = []
    for qual in quals:
        sid = f"open-{qual}"
        q = open_question(funcs[qual], random.Random(sid))
        out.append(Sample(id=sid, task="open", chunks=retriever.search(q, cfg.top_k), question=q, answer="", meta={}))
    return out
