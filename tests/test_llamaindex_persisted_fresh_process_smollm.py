"""A LlamaIndex app persisted in one process and queried in a fresh one (issue 14): the index and the disk
chunk store written by the first process are all the second has; its queries link the stored chunks
(found in the store, not compiled again), and a request that links nothing says so. The two processes run
tests/_li_persisted_app.py on the real SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.embeddings.huggingface")

pytestmark = pytest.mark.smollm

ROOT = Path(__file__).resolve().parent.parent
APP = ROOT / "tests" / "_li_persisted_app.py"


def _run(step: str, folder: Path) -> dict:
    # This checkout's epic_rag first (the script's own folder is tests/, not the repository root).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["HF_HUB_OFFLINE"] = "1"
    proc = subprocess.run(
        [sys.executable, str(APP), step, str(folder)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{step} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> tuple[dict, dict]:
    folder = tmp_path_factory.mktemp("li-persisted")
    built = _run("build", folder)
    return built, _run("query", folder)


def test_first_process_compiles_every_node_into_the_disk_store_and_persists_the_index(two_processes):
    built, _ = two_processes
    assert len(built["node_texts"]) == 4 and built["puts"] == 4
    assert sorted(built["chunk_keys"].values()) == built["store_keys"]


def test_fresh_process_links_stored_chunks_on_overlapping_queries_without_compiling_them(two_processes):
    built, run = two_processes
    assert run["store_keys_before"] == built["store_keys"]  # the store as the first process left it
    first, second = run["sources"]
    assert set(first) == set(second) and len(first) == 2  # overlapping retrievals: the same two nodes
    for texts, keys in zip(run["sources"], run["source_keys"]):
        assert keys == [built["chunk_keys"][t] for t in texts]  # the keys the first process stored
    q1, q2 = run["requests"][:2]
    for stats in (q1, q2):
        assert stats["chunk_hits"] == 2 and stats["chunk_misses"] == 0 and stats["linked_tokens"] > 0
    assert sorted(q2["chunk_keys"]) == sorted(run["source_keys"][1])
    # Found in the store, never recompiled: nothing written, the same entries, the records read from disk.
    assert run["puts"] == 0 and run["store_keys_after"] == built["store_keys"]
    assert sum(t["hits"] for t in run["tiers"].values()) >= 2 and sum(t["misses"] for t in run["tiers"].values()) == 0


def test_fresh_process_request_that_links_nothing_says_so_in_stats_and_debug_log(two_processes):
    _, run = two_processes
    silent = [s for s in run["requests"] if s["linked_tokens"] == 0]
    assert len(silent) == 1  # the plain completion; both queries linked
    (plain,) = silent
    assert plain["chunk_hits"] == plain["chunk_misses"] == 0 and plain["recomputed_tokens"] == plain["prompt_tokens"]
    # Every request that linked nothing logged it: no request is a silent full prefill.
    assert len(run["linked_nothing_log"]) == len(silent)
    assert f"a full prefill of {plain['prompt_tokens']} tokens" in run["linked_nothing_log"][0]
