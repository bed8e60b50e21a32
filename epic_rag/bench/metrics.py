"""Answer scores: substring accuracy, LongBench-style token F1, Rouge-L."""

from __future__ import annotations

import re
import string
from collections import Counter


def normalize_answer(s: str) -> str:
    """LongBench/SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def substring_match(prediction: str, answer: str) -> float:
    return float(normalize_answer(answer) in normalize_answer(prediction))


def token_f1(prediction: str, answer: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    p, r = same / len(pred), same / len(gold)
    return 2 * p * r / (p + r)


def rouge_l(prediction: str, answer: str) -> float:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"]).score(answer, prediction)["rougeL"].fmeasure


def first_line(text: str) -> str:
    """The first sentence (or line) of an answer: small models keep talking after answering."""
    text = text.strip().split("\n", 1)[0]
    return re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]


def name_match(prediction: str, name: str) -> float:
    """1.0 when `name` appears as a whole identifier ("dumps" in "json.dumps()", never in "dumpsx" or
    "loads" for "load"), case-sensitive as Python names are."""
    return float(re.search(rf"(?<!\w){re.escape(name)}(?!\w)", prediction) is not None)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


def is_degenerate(text: str, ngram: int = 4, repeats: int = 3, sentence_words: int = 5) -> bool:
    """True for an answer caught in a loop: a sentence of at least `sentence_words` words said twice, or a
    word n-gram (`ngram` words) occurring `repeats` or more times. Words only, so code punctuation and
    Markdown table rules do not count as repetition."""
    sentences = [" ".join(re.findall(r"\w+", s.lower())) for s in _SENTENCE_END.split(text)]
    seen = Counter(s for s in sentences if len(s.split()) >= sentence_words)
    if any(c >= 2 for c in seen.values()):
        return True
    words = re.findall(r"\w+", text.lower())
    grams = Counter(tuple(words[i : i + ngram]) for i in range(len(words) - ngram + 1))
    return any(c >= repeats for c in grams.values())
