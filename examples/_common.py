"""What both examples share: their command line, the documents, the engine, and the figures printed per answer.

The examples run the demo's model (Qwen2.5-Coder-0.5B-Instruct) by default: SmolLM2-135M (`--model
smollm2-135m-instruct`) starts faster but answers such questions poorly.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep vLLM's INFO lines out of the answers

QUESTIONS = ["What does heapq.heappush do?", "What does heapq.heappop do?"]  # the same chunks, opposite order
DEFAULT_MODULES = ["json", "heapq", "bisect"]


def parse_args(doc: str, argv: list[str] | None, add: Callable[[argparse.ArgumentParser], None]):
    """The shared options, then the example's own (`add`)."""
    from epic_rag.models import DEMO_MODEL

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument(
        "--docs", default=None, help="builtin:pydoc, a file or a folder (default: pydoc of json, heapq, bisect)"
    )
    ap.add_argument("--question", action="append", help="ask this (repeatable; default: two heapq questions)")
    ap.add_argument(
        "--model", default=DEMO_MODEL, help=f"packaged name, model folder or Hugging Face id (default {DEMO_MODEL})"
    )
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=192)
    ap.add_argument("--max-tokens", type=int, default=64)
    add(ap)
    return ap.parse_args(argv)


def start(args):
    """The documents to index (pydoc text or the given files) and the engine."""
    from epic_rag import EngineConfig, EpicEngine
    from epic_rag.corpus import load_documents, pydoc_documents

    docs = pydoc_documents(DEFAULT_MODULES) if args.docs is None else load_documents(args.docs)
    print(f"starting the engine ({args.model})...", file=sys.stderr)
    return docs, EpicEngine(EngineConfig(model=args.model))


def chunks(docs, engine, args):
    """The documents cut into chunks of at most --chunk-tokens tokens of the engine's tokenizer."""
    from epic_rag.corpus import chunk_document

    return [c for d in docs for c in chunk_document(d, engine.tokenizer, max_tokens=args.chunk_tokens)]


def print_figures(stats: dict, sources: list[str]) -> None:
    """One answer's sources (when known) and linking figures (the engine's Generation fields)."""
    if sources:
        print("   sources:", ", ".join(sources))
    print(
        f"   ttft {stats['ttft_s'] * 1000:.0f} ms | linked {stats['linked_tokens']} / "
        f"recomputed {stats['recomputed_tokens']} prompt tokens | chunks: {stats['chunk_hits']} hits, "
        f"{stats['chunk_misses']} compiled now | policy {stats['policy']}"
    )
