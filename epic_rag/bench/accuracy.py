"""Accuracy runner: every policy on the same prompts, temperature 0, resumable from its JSONL file."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from ..prompt import render_request
from ..types import RagRequest
from .common import compile_for
from .datasets import Sample, multidoc_samples, needle_samples
from .metrics import first_line, rouge_l, substring_match, token_f1


def sample_segments(tokenizer, s: Sample) -> list:
    """Chat-templated prompt with each chunk its own segment, the answer prefix after the assistant header."""
    segs = render_request(tokenizer, RagRequest(question=s.question, chunks=list(s.chunks)))
    if s.answer_prefix:
        segs.append(s.answer_prefix)
    return segs


def build_samples(tokenizer, quick: bool = False) -> list[Sample]:
    if quick:
        return needle_samples(
            tokenizer, lengths=(512,), depths=(0.5,), per_cell=1, chunk_tokens=128
        ) + multidoc_samples(tokenizer, n=1, ctx_tokens=512, chunk_tokens=128)
    return needle_samples(tokenizer) + multidoc_samples(tokenizer)


def run_accuracy(
    engine, samples: list[Sample], policies: list[str], out: Path, max_tokens: int = 24, progress: bool = True
) -> list[dict]:
    """Generate every (sample, policy) not yet in `out` (JSONL), append each result as it comes."""
    from tqdm import tqdm

    done = set()
    rows: list[dict] = []
    if out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                rows.append(r)
                done.add((r["id"], r["policy"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = [(s, p) for s in samples for p in policies if (s.id, p) not in done]
    bar = tqdm(total=len(todo), desc="accuracy", disable=not progress, unit="gen")
    with out.open("a") as f:
        for s in samples:
            pols = [p for p in policies if (s.id, p) not in done]
            if not pols:
                continue
            compile_for(engine, list(s.chunks), pols)  # outside the timed generations, as a corpus would be
            segs = sample_segments(engine.tokenizer, s)
            for p in pols:
                g = engine.generate(segs, max_tokens=max_tokens, temperature=0.0, policy=p)
                pred = first_line(g.text)
                r = {
                    "id": s.id,
                    "task": s.task,
                    "policy": p,
                    "meta": s.meta,
                    "answer": s.answer,
                    "prediction": g.text,
                    "substring": substring_match(pred, s.answer),
                    "f1": token_f1(pred, s.answer),
                    "rouge_l": rouge_l(pred, s.answer),
                    "ttft_s": g.ttft_s,
                    "prompt_tokens": g.prompt_tokens,
                    "recomputed_tokens": g.recomputed_tokens,
                }
                f.write(json.dumps(r) + "\n")
                f.flush()
                rows.append(r)
                bar.update(1)
    bar.close()
    return rows


def summarize(rows: list[dict], policies: list[str]) -> list[dict]:
    by = defaultdict(list)
    for r in rows:
        by[r["policy"]].append(r)
    out = []
    for p in policies:
        rs = by.get(p, [])
        if not rs:
            continue
        row = {
            "policy": p,
            "n": len(rs),
            "substring_acc": 100 * statistics.mean(r["substring"] for r in rs),
            "f1": 100 * statistics.mean(r["f1"] for r in rs),
            "rouge_l": 100 * statistics.mean(r["rouge_l"] for r in rs),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
            "recomputed_median": statistics.median(r["recomputed_tokens"] for r in rs),
        }
        for task in sorted({r["task"] for r in rs}):
            t = [r for r in rs if r["task"] == task]
            row[f"{task}_substring_acc"] = 100 * statistics.mean(r["substring"] for r in t)
            row[f"{task}_f1"] = 100 * statistics.mean(r["f1"] for r in t)
            row[f"{task}_n"] = len(t)
        out.append(row)
    return out
