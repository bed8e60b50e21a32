"""Shared helpers for the benchmark scripts: machine facts, command line, result files."""
from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

from epic_rag.bench.report import machine, save_json  # noqa: F401  (machine: re-exported for the bench scripts)

RESULTS = Path(__file__).resolve().parent / "results"


def command() -> str:
    return " ".join([".venv/bin/python", os.path.relpath(sys.argv[0], Path(__file__).parent.parent)] + sys.argv[1:])


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write(name: str, data: dict, markdown: str, out: Path = RESULTS) -> None:
    save_json(out, name, data)
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
