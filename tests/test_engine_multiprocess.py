"""EpicEngine with vLLM's engine core in its own process (EngineConfig.multiprocess, as `vllm serve` runs it):
nothing is shared by reference between the caller and the connector, which reads and writes the chunk store
from the core's process. On the one-layer tiny model a linked chunk's KV is exact when it is right, so
`legolink-0` (nothing recomputed) and `legolink-9999` must both answer like `full`, token for token, for
chunks compiled through the core and read back from its store, in shuffled order."""

from __future__ import annotations

import _engine_process
import pytest

pytestmark = pytest.mark.slow  # starts an engine whose vLLM core runs in its own process

SCRIPT = r"""
import dataclasses, json, sys
cfg = json.loads(sys.argv[1])
from epic_rag import EngineConfig, EpicEngine, RagRequest, parse_policy
from epic_rag.paths import cache_dir
from epic_rag.testing.tiny_model import build_tiny_model

model = build_tiny_model(cache_dir() / "test-models" / "tiny-llama-1layer", layers=1)
eng = EpicEngine(EngineConfig(model=str(model), store=cfg["store"], max_model_len=2048, max_num_seqs=4,
                              kv_cache_gib=1, dtype="float32", multiprocess=True))
out = {"core_client": type(eng._llm.engine_core).__name__}
refs = eng.compile(cfg["chunks"])
out["compiled"] = eng.chunks.compiled
for order in ("given", "shuffled"):
    chunks = cfg["chunks"] if order == "given" else cfg["chunks"][::-1]
    req = RagRequest(question=cfg["question"], chunks=chunks)
    for pol in ("legolink-9999", "legolink-0"):
        prep = eng.prepare(req, max_tokens=16, policy=pol)
        linked = eng.generate(prep)
        full = eng.generate(dataclasses.replace(prep, policy=parse_policy("full")))
        out[f"{order}/{pol}"] = {"same": linked.token_ids == full.token_ids, "hits": linked.chunk_hits,
                                 "misses": linked.chunk_misses, "linked": linked.linked_tokens,
                                 "recomputed": linked.recomputed_tokens, "prompt": linked.prompt_tokens}
out["compiled_after"] = eng.chunks.compiled
# the core process dies while nothing runs: the engine reports it (the demo's /healthz answers 503 with it)
import os, signal, time
out["healthy_before"] = eng.runtime.health()
for proc in eng._llm.engine_core.resources.engine_manager.processes:
    os.kill(proc.pid, signal.SIGKILL)
t0 = time.monotonic()
while eng.runtime.health() is None and time.monotonic() - t0 < 30:
    time.sleep(0.1)
out["dead_reason"], out["dead_after_s"] = eng.runtime.health(), time.monotonic() - t0
t0 = time.monotonic()
try:
    eng.generate("hello", max_tokens=2)
    out["generate"] = "answered"
except Exception as e:
    out["generate"] = type(e).__name__
out["generate_s"] = time.monotonic() - t0
out["reason_after_request"] = eng.runtime.health()
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)  # the core is gone: nothing left to shut down cleanly
"""

CHUNKS = [
    f"def scale_{i}(values, k={i}):\n    out = []\n    for v in values:\n        out.append(v * k + {i * i})\n"
    f"    return out\n"
    for i in range(4)
]


def test_an_engine_whose_vllm_core_runs_in_its_own_process_links_exactly_and_reports_the_cores_death(tmp_path):
    cfg = {"store": "memory", "chunks": CHUNKS, "question": "which function multiplies by 3?"}
    out = _engine_process.run(SCRIPT, cfg)
    assert out["core_client"] == "SyncMPClient", out  # vLLM's core (and the connector) ran in another process
    assert out["compiled"] == out["compiled_after"] - 1 == len(CHUNKS)  # + the glue before the first chunk
    for key, r in out.items():
        if "/" in key:
            assert r["same"], (key, r)  # linked == full, token for token
            assert r["hits"] == len(CHUNKS) and r["misses"] == 0, (key, r)
    assert out["given/legolink-0"]["linked"] > out["given/legolink-9999"]["linked"] > 0
    # a dead core is reported while idle (before: healthy until a request, then every request failed)
    assert out["healthy_before"] is None and out["dead_reason"] == "vLLM's engine core process has died", out
    assert out["generate"] != "answered" and out["generate_s"] < 10, out
    assert out["reason_after_request"], out
