"""What every benchmark shares: machine facts and the command line for the record, result files
(`<out>/<name>.json` + `<out>/<name>.md`), medians and percentiles, and the pydoc text chunks the timings
run on; the name of a policy linked over refined chunks."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import uuid
from functools import lru_cache
from pathlib import Path

from ..corpus import pydoc_documents
from ..policy import parse_policy

# ---------------------------------------------------------------------- the record
DEFAULT_OUT = Path("docs/bench")
# Results of other models go to a folder of their own under DEFAULT_OUT.
MODEL_OUT = {"smollm2-135m-instruct": DEFAULT_OUT, "qwen2.5-coder-0.5b-instruct": DEFAULT_OUT / "qwen"}


def default_out(model: str) -> Path:
    """Where a model's results go when --out is not given."""
    return MODEL_OUT.get(model, DEFAULT_OUT / Path(model).name)


def machine() -> dict:
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    try:
        amx = "amx_bf16" in open("/proc/cpuinfo").read()
    except OSError:
        amx = False
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "amx_bf16": amx,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit,
    }


def command_line(module: str | None = None) -> str:
    """The command that is running, as a reader would type it: `epic-rag ...`, or `.venv/bin/python -m
    <module> ...` for a module run with -m."""
    if module:
        return " ".join([".venv/bin/python", "-m", module] + sys.argv[1:])
    if sys.argv and sys.argv[0].endswith("epic-rag"):
        return " ".join(["epic-rag"] + sys.argv[1:])
    return " ".join(sys.argv)


def save_json(out: Path, name: str, data) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2) + "\n")


def load_json(out: Path, name: str):
    p = out / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def write(out: Path, name: str, data: dict, markdown: str) -> Path:
    """`<out>/<name>.json` and `<out>/<name>.md`; the Markdown is printed too."""
    save_json(out, name, data)
    path = out / f"{name}.md"
    path.write_text(markdown)
    print(markdown)
    return path


def table(columns: list[str], rows: list[list]) -> list[str]:
    """A Markdown table, one line per row."""
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + [
        "| " + " | ".join(str(c) for c in row) + " |" for row in rows
    ]


# ---------------------------------------------------------------------- statistics
def no_reuse(policy: str) -> dict:
    """Keywords that keep a timed request from reusing an earlier request's blocks through vLLM's prefix cache
    (a cache_salt of its own): what is timed is the link, not a cache hit. `prefix` keeps the engine's shared
    salt: exact prefix caching is what it measures."""
    return {} if policy == "prefix" else {"cache_salt": uuid.uuid4().hex}


def median(xs: list[float]) -> float:
    """Median; NaN for no samples."""
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); NaN for no samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


# ---------------------------------------------------------------------- inputs
@lru_cache(maxsize=2)
def _corpus_ids(tokenizer) -> list[int]:
    """The pydoc corpus tokenized once per tokenizer (rendering and encoding it takes seconds)."""
    return tokenizer.encode("\n\n".join(d.text for d in pydoc_documents()), add_special_tokens=False)


def corpus_chunks(tokenizer, n: int, chunk_tokens: int, offset: int = 0) -> list[str]:
    """`n` consecutive `chunk_tokens`-token pieces of the pydoc corpus, starting `offset` pieces in."""
    ids = _corpus_ids(tokenizer)
    need = (offset + n) * chunk_tokens
    if need > len(ids):
        raise ValueError(f"corpus has {len(ids)} tokens, {need} needed")
    return [tokenizer.decode(ids[(offset + i) * chunk_tokens : (offset + i + 1) * chunk_tokens]) for i in range(n)]


# ---------------------------------------------------------------------- refined policies
def refined_policy(name: str) -> tuple[int, str]:
    """`nbr<K>/<policy>` -> (K, policy): the policy linked over chunks refined behind their K nearest among the
    sample's chunks (EpicEngine.refine_nearest, the packaged MiniLM); a plain policy name -> (0, name)."""
    m = re.fullmatch(r"nbr(\d+)/(.+)", name)
    if m is None:
        return 0, name
    k, base = int(m[1]), m[2]
    if k < 1 or not parse_policy(base).links_chunks:
        raise ValueError(f"{name!r}: nbr<K>/ takes K >= 1 and a linking policy")
    return k, base
