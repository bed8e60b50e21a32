"""`epic-rag bench {all,latency,async,scaling,accuracy,report}` with `--quick` for CI smoke tests."""
from __future__ import annotations

import argparse
from pathlib import Path

QUICK = dict(contexts=(256, 512), chunk_tokens=128, reps=1, rates=(0.5,), n_requests=2, pool_size=4,
             counts=(2, 4), scaling_chunk_tokens=64)


def run(args: argparse.Namespace, engine=None) -> Path:
    from .. import EngineConfig, EpicEngine
    from . import accuracy as A
    from . import latency as L
    from .report import command_line, load_json, machine, save_json, write_report

    out = Path(args.out)
    own = engine is None
    if own:
        engine = EpicEngine(EngineConfig(model=args.model, dtype="float32", max_model_len=8192, kv_cache_gib=4))
    q = args.quick
    meta = load_json(out, "meta") or {"commands": []}
    meta.update(model=f"{args.model} ({engine.dtype}, vLLM CPU)" if own else str(engine.model_dir),
                machine=machine())
    if command_line() not in meta["commands"]:
        meta["commands"].append(command_line())
    save_json(out, "meta", meta)
    what = args.what
    pols = args.policies
    if what in ("all", "accuracy"):
        samples = A.build_samples(engine.tokenizer, quick=q)
        apols = pols or L.COMPARED_POLICIES
        rows = A.run_accuracy(engine, samples, apols, out / "accuracy_rows.jsonl", max_tokens=args.max_tokens,
                              progress=not args.no_progress)
        save_json(out, "accuracy", {"n_samples": len(samples), "max_tokens": args.max_tokens,
                                    "summary": A.summarize(rows, apols)})
    if what in ("all", "latency"):
        rows = L.sync_latency(engine, contexts=QUICK["contexts"] if q else (1024, 2048, 4096, 7168),
                              chunk_tokens=QUICK["chunk_tokens"] if q else 512, policies=pols or L.COMPARED_POLICIES,
                              reps=QUICK["reps"] if q else args.reps, progress=not args.no_progress)
        save_json(out, "sync", rows)
    if what in ("all", "async"):
        kw = dict(rates=QUICK["rates"], n_requests=QUICK["n_requests"], pool_size=QUICK["pool_size"],
                  chunk_tokens=QUICK["chunk_tokens"]) if q else {}
        rows = L.async_load(engine, policies=tuple(pols or L.LOAD_POLICIES),
                            progress=not args.no_progress, **kw)
        save_json(out, "async", rows)
    if what in ("all", "scaling"):
        kw = dict(counts=QUICK["counts"], chunk_tokens=QUICK["scaling_chunk_tokens"], reps=1) if q else {}
        rows = L.scaling(engine, policies=tuple(pols or L.LOAD_POLICIES),
                         progress=not args.no_progress, **kw)
        save_json(out, "scaling", rows)
    path = write_report(out)
    if own:
        engine.shutdown()
    return path


def register(sub) -> None:
    b = sub.add_parser("bench", help="latency, throughput, scaling and accuracy benchmarks (EPIC's comparisons)")
    b.add_argument("what", choices=["all", "latency", "async", "scaling", "accuracy", "report"], nargs="?",
                   default="all")
    b.add_argument("--quick", action="store_true", help="tiny settings: a smoke test of the harness")
    b.add_argument("--out", default="docs/bench")
    b.add_argument("--model", default="smollm2-135m-instruct")
    b.add_argument("--policies", nargs="*", default=None)
    b.add_argument("--reps", type=int, default=3)
    b.add_argument("--max-tokens", type=int, default=24)
    b.add_argument("--no-progress", action="store_true")

    def _run(args):
        if args.what == "report":
            from .report import write_report
            print(write_report(Path(args.out)))
        else:
            print(run(args))
        return 0

    b.set_defaults(func=_run)
