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
