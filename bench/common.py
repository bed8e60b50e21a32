"""Shared helpers for the benchmarks: machine facts, token-exact chunks, result files."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        commit = ""
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
            "cores": os.cpu_count(), "python": platform.python_version(), "commit": commit}


def command() -> str:
    return " ".join([".venv/bin/python", os.path.relpath(sys.argv[0], Path(__file__).parent.parent)] + sys.argv[1:])


def token_chunks(tokenizer, text: str, n_tokens: int, count: int, start: int = 0) -> list[str]:
    """`count` chunks of about n_tokens tokens, cut from consecutive token windows of `text`."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    out = []
    for i in range(count):
        lo = start + i * n_tokens
        if lo + n_tokens > len(ids):
            raise ValueError("text too short for the requested chunks")
        out.append(tokenizer.decode(ids[lo: lo + n_tokens]))
    return out


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def write(name: str, data: dict, markdown: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown)
    print(markdown)
