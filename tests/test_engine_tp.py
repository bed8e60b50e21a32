"""EpicEngine with vLLM's tensor parallelism on CPU (tensor_parallel_size=2: two worker processes, one KV head
each of the tiny model's two): each rank compiles and stores its own KV heads under its own keys and links
them, the ranks agreeing on what they recompute. `legolink-9999` must answer exactly like `full` in shuffled
order, and CacheBlend (whose picks are summed over both ranks' heads before choosing) must run and repeat.
vLLM's CPU build starts two workers on these 2-core machines only with manual thread binding."""

from __future__ import annotations

import _engine_process
import pytest

pytestmark = pytest.mark.slow  # starts an engine with two tensor-parallel worker processes

SCRIPT = r"""
import dataclasses, json, sys
cfg = json.loads(sys.argv[1])
from epic_rag import EngineConfig, EpicEngine, RagRequest, parse_policy
from epic_rag.paths import cache_dir
from epic_rag.testing.tiny_model import build_tiny_model

model = build_tiny_model(cache_dir() / "test-models" / "tiny-llama-v1")
eng = EpicEngine(EngineConfig(model=str(model), store=cfg["store"], max_model_len=2048, max_num_seqs=4,
                              kv_cache_gib=1, dtype="float32", tensor_parallel_size=2))
out = {"tp": eng.kv_info["tp"], "heads": eng.kv_info["num_kv_heads"]}
refs = eng.compile(cfg["chunks"])
for order in ("given", "shuffled"):
    chunks = cfg["chunks"] if order == "given" else cfg["chunks"][::-1]
    prep = eng.prepare(RagRequest(question=cfg["question"], chunks=chunks), max_tokens=12, policy="legolink-9999")
    linked = eng.generate(prep)
    full = eng.generate(dataclasses.replace(prep, policy=parse_policy("full")))
    out[order] = {"same": linked.token_ids == full.token_ids, "hits": linked.chunk_hits, "linked": linked.linked_tokens}
req = RagRequest(question=cfg["question"], chunks=cfg["chunks"])
blend = [eng.generate(req, max_tokens=12, policy="cacheblend-15") for _ in range(2)]
out["blend"] = {"repeat": blend[0].token_ids == blend[1].token_ids, "recomputed": blend[0].recomputed_tokens,
                "prompt": blend[0].prompt_tokens}
eng.chunks.forget([r.key for r in refs])  # as after a failed link: read back from every rank's records
out["rechecked_misses"] = eng.generate(req, max_tokens=12, policy="legolink-16").chunk_misses
print("RESULT " + json.dumps(out), flush=True)
eng.shutdown()
"""

CHUNKS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "import os\nimport sys\nprint(os.path.join(sys.prefix, 'lib'))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n",
]


def test_two_tensor_parallel_ranks_store_their_own_heads_and_link_exactly(tmp_path):
    cfg = {"store": f"disk:{tmp_path / 'kv'}", "chunks": CHUNKS, "question": "which function subtracts?"}
    out = _engine_process.run(SCRIPT, cfg, VLLM_CPU_OMP_THREADS_BIND="0|1")
    assert out["tp"] == [0, 2] and out["heads"] == 1  # rank 0 of 2, one of the two KV heads
    for order in ("given", "shuffled"):
        assert out[order]["same"] and out[order]["hits"] == len(CHUNKS), out[order]
    assert out["blend"]["repeat"] and 0 < out["blend"]["recomputed"] < out["blend"]["prompt"], out["blend"]
    assert out["rechecked_misses"] == 0  # the engine finds both ranks' records in the store: nothing recompiled
    names = sorted(f.name for f in (tmp_path / "kv").glob("*.safetensors"))
    for rank in (0, 1):  # each rank's records under its own keys: every chunk once per rank
        assert sum(n.endswith(f".tp2r{rank}.safetensors") and not n.startswith("plain") for n in names) == len(CHUNKS)
