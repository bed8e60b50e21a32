"""Accuracy runner: every policy on the same prompts (paired), temperature 0, resumable from its JSONL file.

Tasks: `niah` and `multidoc` (datasets.py), `docsqa` and `open` (pydocqa.py), `lookalike` (lookalike.py).
All but `open` have a gold answer (accuracy); `open` is scored against `full`'s answer (token F1, Rouge-L) and
by how often an answer loops (`is_degenerate`). Each (sample, policy) result is one line of
<out>/accuracy_rows.jsonl, written as it comes; a rerun generates only what is missing. A line counts only for
the setup it was made with (model, dtype, answer length, ROWS_VERSION), so rows from another model or an older
harness are never mixed in.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from ..policy import parse_policy
from ..prompt import render_request
from ..types import RagRequest
from .common import refined_policy
from .datasets import Sample, multidoc_samples, needle_samples
from .lookalike import lookalike_samples
from .metrics import first_line, is_degenerate, name_match, rouge_l, substring_match, token_f1
from .stats import mean_ci, paired_diff, proportion

TASKS = ("niah", "multidoc", "docsqa", "lookalike", "open")
SCORED = ("niah", "multidoc", "docsqa", "lookalike")  # tasks with a gold answer
TASK_TITLES = {
    "niah": "Needle in a haystack",
    "multidoc": "Multi-document QA (hard-needle)",
    "docsqa": "Docs-QA (pydoc functions)",
    "lookalike": "Look-alike records (one of many records of one shape)",
    "open": "Open-ended (demo questions)",
}
# Both LegoLink forms, the sink-only link, and the baselines they must be told apart from.
ACCURACY_POLICIES = ["full", "naive", "legolink-0", "legolink-epic-16", "legolink-sink-16", "cacheblend-15"]
REFERENCE = "full"
DEFAULT_SAMPLES = 100  # per task (open and docsqa are capped by the functions the corpus documents)
QUICK_SAMPLES = 2
OPEN_MAX_TOKENS = 64
QUICK_OPEN_MAX_TOKENS = 16
QUICK_MODULES = ("json", "os.path", "heapq", "bisect", "textwrap", "string")  # a small corpus: quick to embed
ROWS_VERSION = 2  # bump when a task's prompts or a policy's meaning change: older rows stop counting


def sample_segments(tokenizer, s: Sample) -> list:
    """Chat-templated prompt with each chunk its own segment, the answer prefix after the assistant header."""
    segs = render_request(tokenizer, RagRequest(question=s.question, chunks=list(s.chunks)))
    if s.answer_prefix:
        segs.append(s.answer_prefix)
    return segs


SPLITS = ("test", "dev")
DEV_SEED = 7_000  # niah and multidoc dev samples come from other seeds than the test samples


def build_samples(
    tokenizer, n: int | dict[str, int] | None = None, quick: bool = False, tasks=TASKS, split: str = "test"
) -> list[Sample]:
    """`n` samples per task, or a count per task (default DEFAULT_SAMPLES, QUICK_SAMPLES in quick mode, at
    small sizes). `split`: "test", the samples every published table reports; "dev", disjoint ones to tune
    on (other seeds; the docs functions taken from the other end of their fixed order: disjoint from the
    test's while the two counts add up to at most the pool, 117 docsqa and 176 open functions), ids "dev-..."."""
    from .pydocqa import PYDOC_MODULES, docsqa_samples, open_samples

    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    dev = split == "dev"

    per_task = n if isinstance(n, dict) else {}
    default = n if isinstance(n, int) else (QUICK_SAMPLES if quick else DEFAULT_SAMPLES)
    modules = QUICK_MODULES if quick else tuple(PYDOC_MODULES)
    out: list[Sample] = []
    for task in tasks:
        n = per_task.get(task, default)
        if task == "niah":
            kw = dict(lengths=(512,), depths=(0.3, 0.7), chunk_tokens=128) if quick else {}
            out += needle_samples(tokenizer, n=n, seed=DEV_SEED if dev else 0, **kw)
        elif task == "multidoc":
            kw = dict(ctx_tokens=512, chunk_tokens=128) if quick else {}
            out += multidoc_samples(tokenizer, n=n, **kw, **({"seed": DEV_SEED} if dev else {}))
        elif task == "docsqa":
            out += docsqa_samples(tokenizer, n, modules, from_end=dev)
        elif task == "lookalike":
            kw = dict(chunks=3, chunk_tokens=96, records=2) if quick else {}
            out += lookalike_samples(tokenizer, n=n, seed=DEV_SEED if dev else 300, **kw)
        elif task == "open":
            out += open_samples(tokenizer, n, modules, from_end=dev)
        else:
            raise ValueError(f"unknown task {task!r}; expected one of {', '.join(TASKS)}")
    for s in out:  # quick: smaller prompts under the same names, never taken for full-size results
        s.id = "quick-" * quick + "dev-" * dev + s.id
    return out


def _score(s: Sample, text: str) -> dict:
    pred = first_line(text)
    if s.task == "open":  # scored against full's answer when summarized
        return {"substring": None, "f1": None, "rouge_l": None}
    hit = name_match(pred, s.answer) if s.task == "docsqa" else substring_match(pred, s.answer)
    return {"substring": hit, "f1": token_f1(pred, s.answer), "rouge_l": rouge_l(pred, s.answer)}


OLD_DTYPE = "float32"  # rows written before the dtype was recorded ran in fp32
OLD_COMPILE = "sink1"  # rows written before the compile form was recorded linked chunks compiled this way


def row_setup(setup: dict, task: str, policy: str, compile_variant: str) -> dict:
    """What a row's result depends on: the task's setup, and for a linking policy the chunks' compile form."""
    want = dict(setup[task])
    k, base = refined_policy(policy)
    if parse_policy(base).links_chunks:
        want["compile"] = compile_variant + (f"+nbr{k}" if k else "")
    return want


def load_rows(out: Path, setup: dict, compile_variant: str = OLD_COMPILE) -> tuple[list[dict], int]:
    """Rows of `out` made with `setup` (per task: model, max_tokens, version; and for linking policies the
    compile form), and how many others it holds."""
    rows, other = [], 0
    if out.exists():
        for line in out.read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            made = r.get("setup") or {}
            made = {"dtype": OLD_DTYPE} | made
            if parse_policy(refined_policy(r["policy"])[1]).links_chunks:
                made = {"compile": OLD_COMPILE} | made
            if r.get("task") in setup and made == row_setup(setup, r["task"], r["policy"], compile_variant):
                rows.append(r)
            else:
                other += 1
    return rows, other


def run_accuracy(
    engine,
    samples: list[Sample],
    policies: list[str],
    out: Path,
    max_tokens: int = 24,
    open_max_tokens: int = OPEN_MAX_TOKENS,
    progress: bool = True,
) -> list[dict]:
    """Generate every (sample, policy) not yet in `out` (JSONL), append each result as it comes; returns the
    rows of these samples and policies (old and new)."""
    from tqdm import tqdm

    model = Path(str(engine.model_dir)).name
    setup = {
        t: {
            "model": model,
            "max_tokens": open_max_tokens if t == "open" else max_tokens,
            "version": ROWS_VERSION,
            "dtype": str(engine.dtype),
        }
        for t in TASKS
    }
    variant = engine.chunks.variant
    rows, other = load_rows(out, setup, variant)
    if other and progress:
        print(f"{out}: {other} rows from another setup (model, answer length, compile form, harness version) ignored")
    done = {(r["id"], r["policy"]) for r in rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    todo = [(s, p) for s in samples for p in policies if (s.id, p) not in done]
    bar = tqdm(total=len(todo), desc="accuracy", disable=not progress, unit="gen")
    with out.open("a") as f:
        for s in samples:
            pols = [p for p in policies if (s.id, p) not in done]
            if not pols:
                continue
            engine.compile(list(s.chunks))  # outside the timed generations, as a corpus would be
            segs = sample_segments(engine.tokenizer, s)
            for p, refine_s in _linked_in_form(engine, s, pols, segs):
                base = refined_policy(p)[1]
                g = engine.generate(segs, max_tokens=setup[s.task]["max_tokens"], temperature=0.0, policy=base)
                r = {
                    "id": s.id,
                    "task": s.task,
                    "policy": p,
                    "setup": row_setup(setup, s.task, p, variant),
                    "meta": s.meta,
                    "question": s.question,
                    "answer": s.answer,
                    "prediction": g.text,
                    **_score(s, g.text),
                    "degenerate": is_degenerate(g.text),
                    "ttft_s": g.ttft_s,
                    "total_s": g.total_s,
                    "prompt_tokens": g.prompt_tokens,
                    "recomputed_tokens": g.recomputed_tokens,
                }
                if refine_s is not None:  # what the refine pass cost this sample (once, at compile time)
                    r["refine_s"] = refine_s
                if parse_policy(base).kind == "auto":  # what it ran, and why where its guard escalated
                    r |= {"ran": g.policy, "escalated": g.escalated}
                f.write(json.dumps(r) + "\n")
                f.flush()
                rows.append(r)
                bar.update(1)
    bar.close()
    ids = {s.id for s in samples}
    return [r for r in rows if r["id"] in ids and r["policy"] in policies]


def _linked_in_form(engine, s: Sample, pols: list[str], segs):
    """(policy, refine seconds or None) in the order to run them: plain policies over the plain records first,
    then per K the `nbr<K>/` ones, with the sample's chunks refined behind their K nearest (timed) and linked
    plain again afterwards, so no other row ever links a refined record. A group of `auto` policies whose guard
    escalates this sample links nothing, refined or not: it runs without the refine."""
    import time

    by_k: dict[int, list[str]] = defaultdict(list)
    for p in pols:
        by_k[refined_policy(p)[0]].append(p)
    for p in by_k.pop(0, []):
        yield p, None
    chunks = list(s.chunks)
    for k, group in sorted(by_k.items()):
        bases = {refined_policy(p)[1] for p in group}
        if all(parse_policy(b).kind == "auto" for b in bases) and engine.prepare(segs, policy="auto").escalated:
            yield from ((p, None) for p in group)
            continue
        t0 = time.perf_counter()
        if len(chunks) > 1:
            engine.refine_nearest(chunks, k=min(k, len(chunks) - 1))
        took = round(time.perf_counter() - t0, 3)
        try:
            for p in group:
                yield p, took
        finally:
            engine.unrefine(chunks)


# ---------------------------------------------------------------------- summaries
def _paired(rows: list[dict], policy: str, key: str) -> tuple[list[float], list[float]]:
    """`key` of `policy` and of the reference on the samples both answered, in sample order."""
    mine = {r["id"]: r[key] for r in rows if r["policy"] == policy}
    ref = {r["id"]: r[key] for r in rows if r["policy"] == REFERENCE}
    both = [i for i in mine if i in ref]
    return [float(mine[i]) for i in both], [float(ref[i]) for i in both]


def accuracy_table(rows: list[dict], policies: list[str]) -> list[dict]:
    """Per policy: accuracy with its Wilson interval, and the paired difference to `full` (bootstrap
    interval, exact McNemar) where `full` ran. Rates in percent."""
    out = []
    for p in policies:
        mine = [r["substring"] for r in rows if r["policy"] == p]
        if not mine:
            continue
        acc = proportion(mine)
        row = {"policy": p, "n": acc.n, "correct": acc.k, "acc": 100 * acc.rate}
        row |= {"acc_low": 100 * acc.low, "acc_high": 100 * acc.high}
        if p != REFERENCE and any(r["policy"] == REFERENCE for r in rows):
            d = paired_diff(*_paired(rows, p, "substring"))
            row |= {"pairs": d.n, "diff": 100 * d.diff, "diff_low": 100 * d.low, "diff_high": 100 * d.high}
            row |= {"better": d.better, "worse": d.worse, "p_value": d.p_value}
        out.append(row)
    return out


def open_table(rows: list[dict], policies: list[str]) -> list[dict]:
    """Open-ended answers per policy: token F1 and Rouge-L against `full`'s answer to the same question (mean,
    bootstrap interval), and the degenerate (looping) rate with its difference to `full`."""
    ref = {r["id"]: r["prediction"] for r in rows if r["policy"] == REFERENCE}
    out = []
    for p in policies:
        mine = [r for r in rows if r["policy"] == p]
        if not mine:
            continue
        deg = proportion([float(r["degenerate"]) for r in mine])
        row = {"policy": p, "n": deg.n, "degenerate": 100 * deg.rate}
        row |= {"degenerate_low": 100 * deg.low, "degenerate_high": 100 * deg.high}
        paired = [r for r in mine if r["id"] in ref]
        if paired and p != REFERENCE:
            f1 = mean_ci([token_f1(r["prediction"], ref[r["id"]]) for r in paired])
            rl = mean_ci([rouge_l(r["prediction"], ref[r["id"]]) for r in paired])
            d = paired_diff(*_paired(rows, p, "degenerate"))
            row |= {"pairs": len(paired), "f1": 100 * f1.mean, "f1_low": 100 * f1.low, "f1_high": 100 * f1.high}
            row |= {"rouge_l": 100 * rl.mean, "rouge_l_low": 100 * rl.low, "rouge_l_high": 100 * rl.high}
            row |= {"degenerate_diff": 100 * d.diff, "degenerate_diff_low": 100 * d.low}
            row |= {"degenerate_diff_high": 100 * d.high, "degenerate_p": d.p_value}
        out.append(row)
    return out


def _pct(rows: list[dict], key: str) -> float:
    return 100 * statistics.mean(float(r[key]) for r in rows) if rows else float("nan")


def summarize(rows: list[dict], policies: list[str]) -> dict:
    """The accuracy.json content: a per-policy summary (pooled over the scored tasks), accuracy tables per
    task and overall, and the open-ended table."""
    by = defaultdict(list)
    for r in rows:
        by[r["policy"]].append(r)
    scored = [r for r in rows if r["task"] in SCORED]
    tasks = sorted({r["task"] for r in scored}, key=TASKS.index)
    summary = []
    for p in policies:
        rs = by.get(p, [])
        if not rs:
            continue
        sc = [r for r in rs if r["task"] in SCORED]
        row = {
            "policy": p,
            "n": len(rs),
            "substring_acc": _pct(sc, "substring"),
            "f1": _pct(sc, "f1"),
            "rouge_l": _pct(sc, "rouge_l"),
            "degenerate": 100 * statistics.mean(float(r["degenerate"]) for r in rs),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in rs),
            "recomputed_median": statistics.median(r["recomputed_tokens"] for r in rs),
        }
        for task in sorted({r["task"] for r in rs}, key=TASKS.index):
            t = [r for r in rs if r["task"] == task]
            row[f"{task}_n"] = len(t)
            if task in SCORED:
                row[f"{task}_substring_acc"] = _pct(t, "substring")
                row[f"{task}_f1"] = _pct(t, "f1")
        summary.append(row)
    per_task = {t: accuracy_table([r for r in scored if r["task"] == t], policies) for t in tasks}
    if len(tasks) > 1:
        per_task["overall"] = accuracy_table(scored, policies)
    opened = [r for r in rows if r["task"] == "open"]
    return {"summary": summary, "tasks": per_task, "open": open_table(opened, policies) if opened else []}


def refine_seconds(rows: list[dict]) -> dict:
    """Median seconds the refine pass took per sample, by task and refined policy (its compile-time cost)."""
    by = defaultdict(list)
    for r in rows:
        if "refine_s" in r:
            by[(r["task"], r["policy"])].append(r["refine_s"])
    return {f"{t}/{p}": round(statistics.median(v), 3) for (t, p), v in sorted(by.items())}


def escalations(rows: list[dict]) -> list[dict]:
    """Per task and `auto` policy (rows that record `escalated`): the share its guard escalated, and the median
    ratio of its TTFT to full's on the same sample, apart for the requests it linked and those it escalated."""
    full = {r["id"]: r["ttft_s"] for r in rows if r["policy"] == REFERENCE}
    by = defaultdict(list)
    for r in rows:
        if "escalated" in r:
            by[(r["task"], r["policy"])].append(r)
    out = []
    for (task, policy), rs in sorted(by.items(), key=lambda kv: (TASKS.index(kv[0][0]), kv[0][1])):
        row = {
            "task": task,
            "policy": policy,
            "n": len(rs),
            "escalated": 100 * sum(bool(r["escalated"]) for r in rs) / len(rs),
        }
        for name, group in (
            ("linked", [r for r in rs if not r["escalated"]]),
            ("escalated", [r for r in rs if r["escalated"]]),
        ):
            ratios = [r["ttft_s"] / full[r["id"]] for r in group if full.get(r["id"])]
            row[f"{name}_ttft_vs_full"] = statistics.median(ratios) if ratios else None
        out.append(row)
    return out


def gen_seconds(rows: list[dict]) -> dict:
    """Median seconds per generation by task and policy (what a full run costs per sample and policy)."""
    by = defaultdict(list)
    for r in rows:
        by[(r["task"], r["policy"])].append(r.get("total_s", r["ttft_s"]))
    return {f"{t}/{p}": round(statistics.median(v), 3) for (t, p), v in sorted(by.items())}


# ---------------------------------------------------------------------- the part
def run(
    engine,
    out: Path,
    model: str,
    policies: list[str] | None = None,
    samples: int | None = None,
    quick: bool = False,
    tasks=TASKS,
    max_tokens: int = 24,
    open_max_tokens: int | None = None,
    progress: bool = True,
    split: str = "test",
) -> dict:
    """Build the samples, generate what is missing, write accuracy.json, accuracy.md and accuracy.png."""
    from .common import command_line, load_json, machine, save_json
    from .report import accuracy_markdown, accuracy_plot

    policies = list(policies or ACCURACY_POLICIES)
    if open_max_tokens is None:
        open_max_tokens = QUICK_OPEN_MAX_TOKENS if quick else OPEN_MAX_TOKENS
    built = build_samples(engine.tokenizer, samples, quick, tasks, split)
    rows = run_accuracy(engine, built, policies, out / "accuracy_rows.jsonl", max_tokens, open_max_tokens, progress)
    before = load_json(out, "accuracy") or {}
    commands = before.get("commands", []) if before.get("model") == model else []
    if command_line() not in commands:
        commands.append(command_line())
    n_task = defaultdict(int)
    for s in built:
        n_task[s.task] += 1
    data = {
        "model": model,
        "machine": machine(),
        "commands": commands,
        "split": split,
        "n_samples": len(built),
        "samples_per_task": dict(n_task),
        "policies": policies,
        "max_tokens": max_tokens,
        "open_max_tokens": open_max_tokens,
        "compile_lead": engine.chunks.variant,
        "reference": REFERENCE,
        "stats": {"ci": "95% Wilson (rates), 95% paired bootstrap, 10k resamples, seed 0 (differences, means)"},
        "gen_seconds_median": gen_seconds(rows),
        "refine_seconds_median": refine_seconds(rows),
        "escalations": escalations(rows),
        **summarize(rows, policies),
    }
    save_json(out, "accuracy", data)
    plot = accuracy_plot(out, data)
    (out / "accuracy.md").write_text(accuracy_markdown(data, plot))
    return data
