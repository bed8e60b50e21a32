"""Dev-split screen: what `auto` could recompute instead of a full prefill when its guard escalates a look-alike
lookup (not shipped: the best dev variant, after-home, lost to no recompute at all on the test split;
docs/bench/qwen-escalate/escalation.md).

Per look-alike sample (dev split) that the guard escalates: `full` once, then the same prompt linked under
legolink-16 with a set of chunks recomputed whole, in context (given as plain prompt text), each row one variant:
- plain/inv: chunks compiled alone; the chunks holding the question's key or a look-alike of it recomputed;
- nbr2/none: chunks refined behind their 2 nearest (EpicEngine.refine_nearest), nothing recomputed;
- nbr2/inv: refined; the key's and the look-alikes' chunks recomputed;
- nbr2/later: refined; those chunks but the first of them;
- nbr2/from-first: refined; every chunk from the first of them on;
- nbr2/after-home: refined; the chunks after the asked record's (taken as the first chunk holding a key and no
  look-alike), the dev oracle's best partial set (docs/bench/qwen-frontier/lookalike-dev.md).
Greedy, 24 tokens, scored by substring, TTFT per row (every request its own cache salt; an exact head, the
template and the chunks before the first linked one, may be reused from the glue store across variants, so the
later variants' TTFT can be lower than a cold request's). Rows: docs/bench/qwen-escalate/dev/screen.jsonl.

    .venv/bin/python scripts/screen_escalation.py --samples 40 --out docs/bench/qwen-escalate/dev/screen.jsonl
    .venv/bin/python scripts/screen_escalation.py --out docs/bench/qwen-escalate/dev/screen.jsonl --report
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import uuid
from collections import defaultdict
from pathlib import Path

from epic_rag import EngineConfig, EpicEngine
from epic_rag.bench.accuracy import _score, build_samples, sample_segments
from epic_rag.engine import guard
from epic_rag.policy import parse_policy


def homes(v: guard.Verdict, texts: list[str]) -> set[int]:
    """The chunks holding a question key that has look-alikes."""
    keys = {t.key for t in v.twins}
    return {i for i, c in enumerate(texts) if keys & set(guard.WORD.findall(c))}


def involved(v: guard.Verdict, texts: list[str]) -> set[int]:
    """The chunks holding a key that has look-alikes, or a look-alike of it."""
    return homes(v, texts) | {t.chunk for t in v.twins}


def after_home(v: guard.Verdict, texts: list[str]) -> int:
    """The chunk after the asked record's, taken as the first holding a key and no look-alike (else the first
    holding either): where the after-home variant starts recomputing."""
    held, near = homes(v, texts), {t.chunk for t in v.twins}
    return min([i for i in held if i not in near] or held | near) + 1


def variants(v: guard.Verdict, texts: list[str]) -> list[tuple[str, set[int]]]:
    """(name, chunks recomputed whole) of each refined variant."""
    n, inv = len(texts), involved(v, texts)
    first = min(inv)
    return [
        ("nbr2/none", set()),
        ("nbr2/inv", inv),
        ("nbr2/later", inv - {first}),
        ("nbr2/from-first", set(range(first, n))),
        ("nbr2/after-home", set(range(after_home(v, texts), n))),
    ]


def run(eng: EpicEngine, prep, drop: set[int], name: str, s, out) -> None:
    chunks = [c for i, c in enumerate(prep.chunks) if i not in drop]
    g = eng.generate(dataclasses.replace(prep, chunks=chunks, options={"cache_salt": uuid.uuid4().hex}))
    row = {"id": s.id, "task": s.task, "variant": name, "ok": _score(s, g.text)["substring"], "pred": g.text[:40]}
    row |= {"rec": g.recomputed_tokens, "prompt": g.prompt_tokens, "ttft": g.ttft_s, "drop": sorted(drop)}
    row["nch"] = len(prep.chunks)
    print(json.dumps({k: row[k] for k in ("id", "variant", "ok", "ttft", "drop")}), flush=True)
    out.write(json.dumps(row) + "\n")
    out.flush()


def report(rows: list[dict]) -> str:
    by: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        by[r["id"]][r["variant"]] = r
    lines = ["| variant | correct (full) | TTFT / full's (median) | chunks recomputed (mean share) |"]
    lines.append("|---|---|---|---|")
    for v in dict.fromkeys(r["variant"] for r in rows):
        ids = [i for i in by if v in by[i] and "full" in by[i]]
        ok, fok = sum(by[i][v]["ok"] for i in ids), sum(by[i]["full"]["ok"] for i in ids)
        ratio = statistics.median(by[i][v]["ttft"] / by[i]["full"]["ttft"] for i in ids)
        share = statistics.mean(len(by[i][v]["drop"]) / max(by[i][v]["nch"], 1) for i in ids)
        lines.append(f"| `{v}` | {ok:.0f} / {len(ids)} ({fok:.0f}) | {ratio:.2f} | {share:.2f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--report", action="store_true", help="print the Markdown table of --out instead of running")
    a = ap.parse_args()
    if a.report:
        print(report([json.loads(line) for line in a.out.read_text().splitlines()]))
        return
    eng = EpicEngine(
        EngineConfig(model="qwen2.5-coder-0.5b-instruct", dtype=a.dtype, max_model_len=8192, kv_cache_gib=4)
    )
    tok = eng.tokenizer
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("a") as out:
        for s in build_samples(tok, {"lookalike": a.samples}, tasks=("lookalike",), split="dev"):
            segs, chunks = sample_segments(tok, s), list(s.chunks)
            eng.compile(chunks)
            prep = eng.prepare(segs, policy="legolink-16", max_tokens=24)
            texts = [tok.decode(c.token_ids) for c in prep.chunks]
            v = guard.check(s.question, texts)
            run(eng, dataclasses.replace(prep, policy=parse_policy("full"), chunks=[]), set(), "full", s, out)
            if not v.escalate:
                continue
            run(eng, prep, involved(v, texts), "plain/inv", s, out)
            eng.refine_nearest(chunks, k=2)
            try:
                for name, drop in variants(v, texts):
                    run(eng, prep, drop, name, s, out)
            finally:
                eng.unrefine(chunks)
    eng.shutdown()


if __name__ == "__main__":
    main()
