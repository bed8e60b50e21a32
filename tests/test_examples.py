"""The runnable examples (examples/*.py), run as a user runs them, each in its own process: every question is
answered, and every answer links its retrieved chunks from the compiles of ingest (none compiled at query time).
SmolLM2 here for speed (`--model`); the examples default to the demo's model."""

from __future__ import annotations

import re
import subprocess
import sys

import _engine_process
import pytest

pytestmark = [pytest.mark.smollm, pytest.mark.slow]  # each example starts its own engine

FIGURES = re.compile(r"linked (\d+) / recomputed (\d+) prompt tokens \| chunks: (\d+) hits, (\d+) compiled now")


def _run(script: str, *args: str) -> str:
    p = subprocess.run(
        [sys.executable, f"examples/{script}", "--model", "smollm2-135m-instruct", "--max-tokens", "16", *args],
        capture_output=True,
        text=True,
        cwd=_engine_process.ROOT,
        env=_engine_process.environment(),
        timeout=900,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


# Each example as the README swaps it in: LlamaIndex's stock query engine with EpicLLM, LangChain's LCEL recipe
# with ChatEpic (EpicSynthesizer and create_epic_rag_chain have their own SmolLM2 tests).
@pytest.mark.parametrize(
    "script, args, names_sources",
    [("llamaindex_rag.py", (), True), ("langchain_rag.py", ("--chain", "lcel"), False)],
    ids=["llamaindex-stock-query-engine", "langchain-lcel"],
)
def test_an_example_answers_both_questions_linking_every_retrieved_chunk_compiled_at_ingest(
    script, args, names_sources
):
    out = _run(script, *args)
    answers = re.findall(r"^Q: (.+)\nA: (.*)$", out, re.M)
    assert [q for q, _ in answers] == ["What does heapq.heappush do?", "What does heapq.heappop do?"], out
    assert all(a.strip() for _, a in answers), out
    figures = [tuple(map(int, m)) for m in FIGURES.findall(out)]
    assert len(figures) == 2, out
    for linked, recomputed, hits, compiled_now in figures:
        assert (hits, compiled_now) == (2, 0), out  # top-k 2, both compiled at ingest
        assert linked > recomputed > 0, out
    if names_sources:  # (an LCEL chain's message does not say which documents it got)
        sources = [
            [s.strip() for s in line.split(":", 1)[1].split(",")]
            for line in out.splitlines()
            if line.strip().startswith("sources:")
        ]
        assert len(sources) == 2 and sources[1] == sources[0][::-1], out  # the same two chunks, in the other order
