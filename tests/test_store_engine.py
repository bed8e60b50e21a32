"""The store under real engines on the tiny model. vLLM allows one engine per process, so every engine
here runs in its own subprocess (this pytest process never builds one) and reports JSON."""

from __future__ import annotations

import shutil

import _engine_process
import pytest

from epic_rag.testing.localredis import LocalRedis

pytestmark = pytest.mark.slow  # starts engine processes sharing a store

# Runs one engine: generate once, optionally damage disk entries and generate again; prints RESULT <json>.
SCRIPT = r"""
import itertools, json, sys
from pathlib import Path
cfg = json.loads(sys.argv[1])
from epic_rag import EngineConfig, EpicEngine, RagRequest
from epic_rag.paths import cache_dir
from epic_rag.testing.tiny_model import build_tiny_model

model = build_tiny_model(cache_dir() / "test-models" / cfg["model_name"], seed=cfg["seed"])
eng = EpicEngine(EngineConfig(model=str(model), policy="legolink-16", store=cfg["store"], max_model_len=2048,
                              max_num_seqs=4, kv_cache_gib=1, dtype=cfg["dtype"]))
req = RagRequest(question=cfg["question"], chunks=cfg["chunks"])
runs = itertools.count()

def run():
    # a salt of its own: a run must read the store, not the prefix cache's copy of the previous run's link
    g = eng.generate(req, max_tokens=12, cache_salt=f"run{next(runs)}")
    return {"misses": g.chunk_misses, "hits": g.chunk_hits, "tokens": g.token_ids, "keys": g.chunk_keys}

out = {"first": run(), "stored": sorted(eng.store.keys())}  # chunks, and the leading glue if the engine stores it
if cfg.get("damage"):
    folder = Path(cfg["damage"])
    k0, k1 = out["first"]["keys"][:2]
    p0, p1 = folder / f"{k0}.safetensors", folder / f"{k1}.safetensors"
    data = bytearray(p0.read_bytes()); data[len(data) - 5] ^= 0x01; p0.write_bytes(bytes(data))  # flipped bit
    p1.write_bytes(p1.read_bytes()[: p1.stat().st_size // 3])                                      # truncated
    out["second"] = run()
    out["third"] = run()
out["stats"] = eng.store.tier_stats()
print("RESULT " + json.dumps(out), flush=True)
eng.shutdown()
"""

CHUNKS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "import os\nimport sys\nprint(os.path.join(sys.prefix, 'lib'))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n",
]
QUESTION = "which function subtracts?"


def run_engine(store: str, dtype: str = "float32", seed: int = 0, damage: str | None = None) -> dict:
    cfg = {
        "store": store,
        "dtype": dtype,
        "seed": seed,
        "damage": damage,
        "question": QUESTION,
        "chunks": CHUNKS,
        "model_name": "tiny-llama-v1" if seed == 0 else f"tiny-llama-v1-seed{seed}",
    }
    return _engine_process.run(SCRIPT, cfg)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server binary not installed (apt-get install redis-server)")
    with LocalRedis(tmp_path_factory.mktemp("redis")) as r:
        yield r.url


@pytest.fixture(scope="module")
def first_engine(redis_url):
    """An engine that compiled the chunks into the shared Redis."""
    return run_engine(f"memory+{redis_url}")


def test_first_engine_compiles_every_chunk_into_redis(first_engine):
    first = first_engine["first"]
    assert first["misses"] == len(CHUNKS) and first["hits"] == 0
    assert set(first["keys"]) <= set(first_engine["stored"])
    assert first_engine["stats"]["redis"]["puts"] == len(first_engine["stored"])


def test_second_engine_sharing_redis_links_chunks_compiled_by_the_first_without_compiling(first_engine, redis_url):
    second = run_engine(f"memory+{redis_url}")
    assert second["first"]["misses"] == 0 and second["first"]["hits"] == len(CHUNKS)
    assert second["first"]["tokens"] == first_engine["first"]["tokens"]
    assert second["first"]["keys"] == first_engine["first"]["keys"]
    st = second["stats"]
    n = len(first_engine["stored"])
    assert second["stored"] == first_engine["stored"]
    assert st["redis"]["hits"] == n and st["redis"]["puts"] == 0 and st["redis"]["corrupt"] == 0
    assert st["memory"]["puts"] == n  # promoted on the way up


def test_a_model_change_misses_every_chunk(first_engine, redis_url):
    other = run_engine(f"memory+{redis_url}", seed=1)  # same architecture and tokenizer, other weights
    assert other["first"]["misses"] == len(CHUNKS) and other["first"]["hits"] == 0
    assert not set(other["first"]["keys"]) & set(first_engine["first"]["keys"])
    assert other["stats"]["redis"]["corrupt"] == 0


def test_a_kv_dtype_change_misses_every_chunk(first_engine, redis_url):
    other = run_engine(f"memory+{redis_url}", dtype="bfloat16")
    assert other["first"]["misses"] == len(CHUNKS) and other["first"]["hits"] == 0
    assert not set(other["first"]["keys"]) & set(first_engine["first"]["keys"])


def test_corrupted_disk_entries_are_refused_rewritten_and_the_answer_equals_the_clean_one(tmp_path):
    out = run_engine(f"disk:{tmp_path}", damage=str(tmp_path))
    clean, damaged, again = out["first"], out["second"], out["third"]
    assert clean["misses"] == len(CHUNKS)
    # one flipped, one truncated: refused by the worker, which links them from this process's recent compiles
    # (no recompile) and writes them back over the damaged files
    assert damaged["misses"] == 0 and damaged["tokens"] == clean["tokens"]
    assert again["misses"] == 0 and again["tokens"] == clean["tokens"]
    assert out["stats"]["disk"]["corrupt"] == 2
    assert sorted(p.name.removesuffix(".safetensors") for p in tmp_path.glob("*.safetensors")) == out["stored"]
