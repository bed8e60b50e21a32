"""Two replicas on one Redis, end to end: two processes, each with its own engine (one vLLM engine per process)
on the one-layer tiny model, compile the same chunk texts at the same moment. Each chunk must be compiled
exactly once across the two (the other replica waits for it and loads it), and both then link every chunk
from the shared store with the answer `full` gives, token for token: `legolink-9999` (the requested check) and
`legolink-0`, which in a one-layer model is exact only if the KV loaded from the other process is right."""

from __future__ import annotations

import shutil
import subprocess

import _engine_process
import pytest

from epic_rag.testing.localredis import LocalRedis

pytestmark = pytest.mark.slow  # starts two engine processes on one Redis

SCRIPT = r"""
import dataclasses, json, sys, time
from pathlib import Path
cfg = json.loads(sys.argv[1])
from epic_rag import EngineConfig, EpicEngine, RagRequest, parse_policy
from epic_rag.paths import cache_dir
from epic_rag.testing.tiny_model import build_tiny_model

model = build_tiny_model(cache_dir() / "test-models" / "tiny-llama-1layer", layers=1)
eng = EpicEngine(EngineConfig(model=str(model), store=cfg["store"], max_model_len=2048, max_num_seqs=4,
                              kv_cache_gib=1, dtype="float32"))
# Every compile takes 1 s more here, so the two replicas' compiles overlap however the OS schedules them.
compile_batch = eng.chunks._compile_batch
def slow_compile_batch(todo):
    time.sleep(1.0)
    return compile_batch(todo)
eng.chunks._compile_batch = slow_compile_batch

def barrier(name):
    sync = Path(cfg["sync"])
    (sync / f"{name}-{cfg['me']}").touch()
    deadline = time.monotonic() + 600
    while len(list(sync.glob(f"{name}-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.002)

barrier("ready")  # both engines loaded: compile the same texts at once
t0 = time.time()
refs = eng.compile(cfg["chunks"], batch_size=len(cfg["chunks"]))
t1 = time.time()
out = {"compiled": eng.chunks.compiled, "window": [t0, t1], "keys": [r.key for r in refs],
       "after_compile": eng.store.tier_stats()["redis"]}
barrier("compiled")  # both done: every chunk is in Redis
req = RagRequest(question=cfg["question"], chunks=cfg["chunks"])
for pol in ("legolink-9999", "legolink-0"):
    prep = eng.prepare(req, max_tokens=16, policy=pol)
    linked = eng.generate(prep)
    full = eng.generate(dataclasses.replace(prep, policy=parse_policy("full")))
    out[pol] = {"same": linked.token_ids == full.token_ids, "tokens": linked.token_ids, "hits": linked.chunk_hits,
                "misses": linked.chunk_misses, "linked": linked.linked_tokens}
out["stats"] = eng.store.tier_stats()
print("RESULT " + json.dumps(out), flush=True)
eng.shutdown()
"""

CHUNKS = [
    f"def scale_{i}(values, k={i}):\n    out = []\n    for v in values:\n        out.append(v * k + {i * i})\n"
    f"    return out\n\n\nclass Box{i}:\n    def __init__(self):\n        self.items = [{i}, {i + 1}]\n"
    for i in range(6)
]
QUESTION = "which function multiplies by 3?"


@pytest.fixture
def redis_url(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (apt-get install redis-server)")
    with LocalRedis(tmp_path / "redis") as r:
        yield r.url


def test_two_replicas_on_one_redis_compile_each_chunk_once_and_both_link_it_like_full(redis_url, tmp_path):
    sync = tmp_path / "sync"
    sync.mkdir()
    # Small parts, so the chunks also travel as parts behind manifests between the replicas.
    store = f"memory+{redis_url}?max_part_bytes=16K"
    procs = []
    for me in range(2):
        cfg = {"store": store, "sync": str(sync), "me": me, "chunks": CHUNKS, "question": QUESTION}
        procs.append(
            subprocess.Popen(
                _engine_process.command(SCRIPT, cfg),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=_engine_process.ROOT,
                env=_engine_process.environment(),
            )
        )
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=900)
            outs.append(_engine_process.result(p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    a, b = outs
    n = len(CHUNKS)
    assert a["window"][0] < b["window"][1] and b["window"][0] < a["window"][1]  # they compiled at the same time
    # Each chunk compiled once across the fleet; every one the other replica compiled was waited for and loaded.
    assert a["compiled"] + b["compiled"] == n, (a["compiled"], b["compiled"])
    ca, cb = a["after_compile"], b["after_compile"]
    assert ca["puts"] + cb["puts"] == n
    assert ca["fleet_waits"] == b["compiled"] and cb["fleet_waits"] == a["compiled"]
    assert ca["fleet_takeovers"] == cb["fleet_takeovers"] == 0
    assert a["keys"] == b["keys"] and len(set(a["keys"])) == n
    for out in outs:
        assert out["stats"]["redis"]["corrupt"] == 0
        for policy in ("legolink-9999", "legolink-0"):
            r = out[policy]
            assert r["same"], (policy, r)  # linked == full, token for token
            assert r["hits"] == n and r["misses"] == 0 and r["linked"] > 0, (policy, r)
    assert a["legolink-0"]["tokens"] == b["legolink-0"]["tokens"]
