"""`epic-rag bench {link,store,accuracy,sync,load,scaling,serve,trace,all,report}` with `--quick` for CI smoke
tests.

Every part writes `<out>/<part>.json` and Markdown into `--out` (default docs/bench for SmolLM2,
docs/bench/qwen for Qwen2.5-Coder-0.5B): link.md, store.md, load.md (+ throughput_vs_rate.png,
itl_vs_rate.png), trace.md (+ trace.png) and accuracy.md (+ accuracy.png) for those parts; the comparisons
(accuracy, sync, load, scaling) one report, README.md, with meta.json (model, machine, the commands that made
them) and plots.
`async` is the load part's former name, kept as an alias.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ..policy import parse_policy
from .accuracy import (
    ACCURACY_POLICIES,
    DEFAULT_SAMPLES,
    OPEN_MAX_TOKENS,
    QUICK_OPEN_MAX_TOKENS,
    QUICK_SAMPLES,
    TASKS,
)
from .common import DEFAULT_OUT, MODEL_OUT, default_out
from .load import QUICK_SETTINGS, LoadSettings
from .trace import ACCURATE_POLICY, TraceSettings
from .trace import QUICK_SETTINGS as TRACE_QUICK

PARTS = ["link", "store", "accuracy", "sync", "load", "scaling"]
ALIASES = {"async": "load"}  # former part names
REPORTED = {"accuracy", "sync", "load", "scaling"}  # the parts docs/bench/README.md reports
DEFAULT_MODEL = "smollm2-135m-instruct"
PART_MODEL = {"trace": "qwen2.5-coder-0.5b-instruct"}  # parts whose default model is the demo's
# The trace's own options: flag -> (TraceSettings field, type, what it sets)
TRACE_OPTIONS = {
    "--trace-chunks": ("chunks", int, "corpus chunks, embedded and compiled"),
    "--zipf": ("zipf_s", float, "Zipf exponent of topic popularity, 0: uniform"),
    "--follow-share": ("follow_share", float, "share of requests that are follow-up turns"),
    "--refine-neighbours": ("refine_neighbours", int, "each retrieved chunk refined behind this many nearest, 0: none"),
    "--scored": ("scored", int, "conversations answered by every policy and compared with full's answers"),
    "--followups": ("followups", int, "two-turn conversations of the follow-up TTFT measurement"),
}
QUICK = dict(
    contexts=(256, 512),
    chunk_tokens=128,
    reps=1,
    counts=(2, 4),
    scaling_chunk_tokens=64,
    link_chunks=2,
    link_chunk_tokens=64,
    link_rounds=1,
    store_chunk_tokens=64,
    loads=2,
    compiles=1,
)


def run(args: argparse.Namespace, engine=None) -> Path:
    """Run the part(s) `args.what` names on `engine` (one made here when None); returns the report's path
    (README.md), or the part's Markdown for link and store alone."""
    from .. import EngineConfig, EpicEngine
    from . import accuracy as A
    from . import latency as L
    from . import link, store
    from . import load as LD
    from .common import command_line, load_json, machine, save_json
    from .report import write_report

    what = ALIASES.get(args.what, args.what)
    args.model = args.model or PART_MODEL.get(what, DEFAULT_MODEL)
    out = Path(args.out) if args.out else default_out(args.model)
    trace_s = trace_settings(args) if what == "trace" else None  # checked before an engine starts
    if what == "serve":  # runs its own engines and server, one per process
        from . import serve

        serve.run(out, args.model, serve.QUICK_SETTINGS if args.quick else None)
        return out / "serve.md"
    parts = PARTS if what == "all" else [what]
    own = engine is None
    if own:
        size = (
            dict(max_model_len=2048, kv_cache_gib=1, max_num_seqs=4)
            if what == "store"
            else dict(max_model_len=8192, kv_cache_gib=4)
        )
        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            compile_lead=args.compile_lead,
            async_links=not args.sync_links,
            **size,
        )
        engine = EpicEngine(config)
    links = "links synchronous" if args.sync_links else "links asynchronous"
    model = f"{args.model} ({engine.dtype}, vLLM CPU, {links})" if own else str(engine.model_dir)
    q = args.quick
    pols = args.policies
    progress = not args.no_progress
    if REPORTED & set(parts):
        meta = load_json(out, "meta") or {"commands": []}
        meta.update(model=model, machine=machine())
        if command_line() not in meta["commands"]:
            meta["commands"].append(command_line())
        save_json(out, "meta", meta)
    if "link" in parts:
        link.run(
            engine,
            out,
            model,
            chunks=QUICK["link_chunks"] if q else args.chunks,
            chunk_tokens=QUICK["link_chunk_tokens"] if q else args.chunk_tokens or 512,
            reps=QUICK["reps"] if q else args.reps or 5,
            policies=pols,
            rounds=QUICK["link_rounds"] if q else 3,
            progress=progress,
        )
    if "store" in parts:
        store.run(
            engine,
            out,
            model,
            loads=QUICK["loads"] if q else args.loads,
            compiles=QUICK["compiles"] if q else args.compiles,
            chunk_tokens=QUICK["store_chunk_tokens"] if q else args.chunk_tokens or 512,
            release=own and what == "store",
        )
    if "accuracy" in parts:
        A.run(
            engine,
            out,
            model,
            policies=pols,
            samples=samples_per_task(args.samples),
            quick=q,
            tasks=tuple(args.tasks),
            max_tokens=args.max_tokens,
            open_max_tokens=args.open_max_tokens,
            progress=progress,
            split=args.split,
        )
    if "sync" in parts:
        rows = L.sync_latency(
            engine,
            contexts=QUICK["contexts"] if q else (1024, 2048, 4096, 7168),
            chunk_tokens=QUICK["chunk_tokens"] if q else 512,
            policies=pols or L.COMPARED_POLICIES,
            reps=QUICK["reps"] if q else args.reps or 3,
            progress=progress,
        )
        save_json(out, "sync", rows)
    if "load" in parts:
        LD.run(engine, out, model, policies=pols, settings=load_settings(args), progress=progress)
    if "trace" in parts:
        from . import trace_run

        trace_run.run(
            engine,
            out,
            model,
            policies=pols,
            accurate=args.accurate_policy,
            settings=trace_s,
            progress=progress,
        )
    if "scaling" in parts:
        kw = dict(counts=QUICK["counts"], chunk_tokens=QUICK["scaling_chunk_tokens"], reps=1) if q else {}
        rows = L.scaling(engine, policies=tuple(pols or L.LOAD_POLICIES), progress=progress, **kw)
        save_json(out, "scaling", rows)
    path = write_report(out) if REPORTED & set(parts) else out / f"{what}.md"
    if own:
        engine.shutdown()
    return path


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "what",
        choices=[*PARTS, *ALIASES, "serve", "trace", "all", "report"],
        nargs="?",
        default="all",
        help="all: every part but serve and trace; serve: the embedded engine vs its core in its own process vs "
        "`vllm serve` (serve.md); trace: a RAG trace (Zipf-popular topics, top-k retrieval, follow-up turns) "
        "through prefix caching, the accurate policy, legolink-16 and full (trace.md); report: rewrite README.md "
        "from the results in --out",
    )
    b.add_argument("--quick", action="store_true", help="tiny settings: a smoke test of the harness")
    b.add_argument(
        "--out",
        default=None,
        help="results folder (default: "
        + ", ".join(f"{p} for {m}" for m, p in MODEL_OUT.items())
        + f", else {DEFAULT_OUT}/<model>)",
    )
    b.add_argument(
        "--model",
        default=None,
        help="smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct, a model folder or a Hugging Face id "
        + f"(default {DEFAULT_MODEL}; "
        + ", ".join(f"{part}: {m}" for part, m in PART_MODEL.items())
        + ")",
    )
    b.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the engine's dtype (bfloat16: fast on CPUs with AMX only); tables and rows record it",
    )
    b.add_argument(
        "--policies",
        nargs="*",
        default=None,
        help="default: every compared policy (accuracy: "
        + " ".join(ACCURACY_POLICIES)
        + "; trace: prefix, the accurate policy, legolink-16, full)",
    )
    b.add_argument(
        "--samples",
        nargs="+",
        type=_samples_arg,
        default=None,
        metavar="N|TASK=N",
        help=f"accuracy: samples per task (default {DEFAULT_SAMPLES}; --quick {QUICK_SAMPLES}); TASK=N sets one task's",
    )
    b.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS, help="accuracy: tasks to run")
    b.add_argument(
        "--split",
        default="test",
        choices=["test", "dev"],
        help="accuracy: the published samples (test) or disjoint ones to tune on (dev: other seeds, other functions)",
    )
    b.add_argument("--reps", type=int, default=None, help="prompts per policy (default: link 5, sync 3)")
    b.add_argument("--max-tokens", type=int, default=24, help="accuracy: answer length (gold-answer tasks)")
    b.add_argument(
        "--open-max-tokens",
        type=int,
        default=None,
        help=f"accuracy: answer length of the open-ended task (default {OPEN_MAX_TOKENS}; "
        f"--quick {QUICK_OPEN_MAX_TOKENS})",
    )
    b.add_argument(
        "--sync-links",
        action="store_true",
        help="link each request whole inside the step that schedules it (EngineConfig.async_links=False)",
    )
    b.add_argument("--chunks", type=int, default=8, help="link: chunks per prompt")
    b.add_argument(
        "--chunk-tokens",
        type=int,
        default=None,
        help=f"link, store and trace: tokens per chunk (default 512; trace {TraceSettings.chunk_tokens})",
    )
    b.add_argument("--loads", type=int, default=20, help="store: loads per tier")
    b.add_argument("--compiles", type=int, default=5, help="store: fresh chunks compiled for the compile time")
    b.add_argument(
        "--compile-lead",
        choices=("template", "sink"),
        default="template",
        help="what chunks are compiled behind: the default prompt up to its first document (template), or the "
        "sink token alone (EPIC's reference compile); rows record it",
    )
    b.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help=f"load, trace: time budget of each policy's rate sweep (default {LoadSettings.max_minutes:g}, trace "
        f"{TraceSettings.max_minutes:g}); a sweep that reaches it before saturating is recorded as ended by `cap`",
    )
    b.add_argument(
        "--rate-factor",
        type=float,
        default=None,
        help=f"load, trace: rate ratio between steps (default {LoadSettings.factor:g})",
    )
    b.add_argument(
        "--start-load",
        type=float,
        default=None,
        help=f"load, trace: first rate ~ this / the policy's unloaded service time (default "
        f"{LoadSettings.start_load:g})",
    )
    b.add_argument(
        "--output-tokens",
        type=int,
        default=None,
        help=f"load, trace: tokens generated per request, EOS ignored (default {LoadSettings.output_tokens})",
    )
    b.add_argument(
        "--accurate-policy",
        default=ACCURATE_POLICY,
        help=f"trace: the accurate policy compared with prefix caching (default {ACCURATE_POLICY})",
    )
    for flag, (field, kind, what) in TRACE_OPTIONS.items():
        b.add_argument(flag, type=kind, default=None, help=f"trace: {what} (default {getattr(TraceSettings, field):g})")
    b.add_argument("--no-progress", action="store_true")


def _sweep_options(args: argparse.Namespace) -> dict:
    """The sweep options given, checked (load and trace)."""
    given = {
        "max_minutes": args.max_minutes,
        "factor": args.rate_factor,
        "start_load": args.start_load,
        "output_tokens": args.output_tokens,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if given.get("factor", 2.0) <= 1.0:
        raise SystemExit("--rate-factor must be above 1")
    if given.get("output_tokens", 2) < 2:
        raise SystemExit("--output-tokens must be at least 2 (an inter-token latency needs two tokens)")
    if given.get("max_minutes", 1.0) <= 0 or given.get("start_load", 1.0) <= 0:
        raise SystemExit("--max-minutes and --start-load must be positive")
    return given


def load_settings(args: argparse.Namespace) -> LoadSettings:
    """The load part's settings: the defaults (QUICK_SETTINGS with --quick), then the options given."""
    base = QUICK_SETTINGS if args.quick else LoadSettings()
    return dataclasses.replace(base, **_sweep_options(args))


def trace_settings(args: argparse.Namespace) -> TraceSettings:
    """The trace part's settings: the defaults (trace.QUICK_SETTINGS with --quick), then the options given."""
    base = TRACE_QUICK if args.quick else TraceSettings()
    fields = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in TRACE_OPTIONS.items()}
    given = {k: v for k, v in {**fields, "chunk_tokens": args.chunk_tokens}.items() if v is not None}
    if given.get("chunks", 1) < 1 or given.get("chunk_tokens", 16) < 16:
        raise SystemExit("--trace-chunks must be positive and --chunk-tokens at least 16")
    if not 0.0 <= given.get("follow_share", 0.0) <= 1.0 or given.get("zipf_s", 0.0) < 0:
        raise SystemExit("--follow-share must be in [0, 1] and --zipf at least 0")
    if given.get("scored", 0) < 0 or given.get("followups", 0) < 0 or given.get("refine_neighbours", 0) < 0:
        raise SystemExit("--scored, --followups and --refine-neighbours must be at least 0")
    s = dataclasses.replace(base, **_sweep_options(args), **given)
    try:
        parse_policy(args.accurate_policy)
    except ValueError as e:
        raise SystemExit(f"--accurate-policy: {e}") from None
    if s.chunks < s.k_max:
        raise SystemExit(f"--trace-chunks must be at least {s.k_max} (the most chunks a request retrieves)")
    return s


def _samples_arg(text: str) -> tuple[str | None, int]:
    task, _, n = text.rpartition("=")
    if task and task not in TASKS or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"expected N or TASK=N with TASK in {', '.join(TASKS)}, got {text!r}")
    return task or None, int(n)


def samples_per_task(items: list[tuple[str | None, int]] | None) -> int | dict[str, int] | None:
    """--samples as build_samples takes it: None, one count for every task, or a count per task."""
    if not items:
        return None
    default = next((n for t, n in items if t is None), DEFAULT_SAMPLES)
    per = {t: n for t, n in items if t is not None}
    return {t: per.get(t, default) for t in TASKS} if per else default


def register(sub) -> None:
    b = sub.add_parser(
        "bench", help="link, store, latency, throughput, scaling and accuracy benchmarks (EPIC's comparisons)"
    )
    add_arguments(b)

    def _run(args):
        if args.what == "report":
            from .report import write_report

            print(write_report(Path(args.out) if args.out else default_out(args.model or DEFAULT_MODEL)))
        else:
            print(run(args))
        return 0

    b.set_defaults(func=_run)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The arguments of `epic-rag bench <argv>`."""
    b = argparse.ArgumentParser(prog="epic-rag bench")
    add_arguments(b)
    return b.parse_args(argv)
