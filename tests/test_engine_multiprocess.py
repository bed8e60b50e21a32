"""EpicEngine with vLLM's engine core in its own process (EngineConfig.multiprocess, as `vllm serve` runs it):
nothing is shared by reference between the caller and the connector, which reads and writes the chunk store
from the core's process. On the one-layer tiny model a linked chunk's KV is exact when it is right, so
`legolink-0` (nothing recomputed) and `legolink-9999` must both answer like `full`, token for token, for
chunks compiled through the core and read back from its store, in shuffled order."""

from __future__ import annotations

import _engine_process

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
print("RESULT " + json.dumps(out), flush=True)
eng.shutdown()
"""

CHUNKS = [
    f"def scale_{i}(values, k={i}):\n    out = []\n    for v in values:\n        out.append(v * k + {i * i})\n"
    f"    return out\n"
    for i in range(4)
]


def test_an_engine_whose_vllm_core_runs_in_its_own_process_compiles_and_links_chunks_exactly(tmp_path):
    cfg = {"store": "memory", "chunks": CHUNKS, "question": "which function multiplies by 3?"}
    out = _engine_process.run(SCRIPT, cfg)
    assert out["core_client"] == "SyncMPClient", out  # vLLM's core (and the connector) ran in another process
    assert out["compiled"] == out["compiled_after"] - 1 == len(CHUNKS)  # + the glue before the first chunk
    for key, r in out.items():
        if "/" in key:
            assert r["same"], (key, r)  # linked == full, token for token
            assert r["hits"] == len(CHUNKS) and r["misses"] == 0, (key, r)
    assert out["given/legolink-0"]["linked"] > out["given/legolink-9999"]["linked"] > 0
