"""Qwen2.5-Coder-0.5B-Instruct end to end (fp32): QKV biases, RoPE theta 1e6 and 7:1 grouped KV heads are
covered by the exactness guarantee, and the demo's model answers from linked chunks. One engine, in its own
pytest session (`make test` runs `-m qwen` apart: vLLM allows one engine per process)."""

from __future__ import annotations

import pytest

from epic_rag import EngineConfig, RagRequest

pytestmark = pytest.mark.qwen

DOCS = [
    "json.dumps(obj, *, skipkeys=False, ensure_ascii=True, check_circular=True, allow_nan=True, cls=None, "
    "indent=None, separators=None, default=None, sort_keys=False, **kw)\n    Serialize obj to a JSON formatted "
    "str. If indent is a non-negative integer or string, then JSON array elements and object members will be "
    "pretty-printed with that indent level.",
    "os.path.join(path, *paths)\n    Join one or more path segments intelligently. The return value is the "
    "concatenation of path and all members of *paths, with exactly one directory separator following each "
    "non-empty part except the last.",
    "shutil.copyfile(src, dst, *, follow_symlinks=True)\n    Copy the contents (no metadata) of the file named "
    "src to a file named dst and return dst in the most efficient way possible.",
]
QUESTION = "How do I pretty-print JSON with indentation in Python?"


@pytest.fixture(scope="module")
def qwen_engine():
    from epic_rag import EpicEngine

    eng = EpicEngine(
        EngineConfig(
            model="qwen2.5-coder-0.5b-instruct",
            policy="legolink-16",
            dtype="float32",
            max_model_len=4096,
            max_num_seqs=4,
            kv_cache_gib=2,
        )
    )
    yield eng
    eng.shutdown()


def test_qwen_legolink_recomputing_every_chunk_token_equals_full_token_for_token(qwen_engine):
    req = RagRequest(question=QUESTION, chunks=DOCS[::-1])
    full = qwen_engine.generate(req, max_tokens=24, policy="full")
    linked = qwen_engine.generate(req, max_tokens=24, policy="legolink-9999")
    assert linked.chunk_hits + linked.chunk_misses == len(DOCS) and linked.linked_tokens > 0
    assert linked.token_ids == full.token_ids


def test_qwen_answers_from_linked_chunks_in_shuffled_order(qwen_engine):
    qwen_engine.compile(DOCS)
    for order in (DOCS, [DOCS[1], DOCS[0], DOCS[2]]):
        g = qwen_engine.generate(RagRequest(question=QUESTION, chunks=order), max_tokens=48)
        assert g.chunk_misses == 0 and g.chunk_hits == len(DOCS)
        assert "dumps" in g.text and "indent" in g.text, g.text
