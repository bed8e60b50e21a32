"""The look-alike records task: generated deterministically, the asked value present once and in its home chunk,
a look-alike of its key with another value in another chunk, dev and test samples disjoint; accuracy rows record
the dtype they were made with (older rows count as fp32)."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from epic_rag.bench.accuracy import build_samples, load_rows, row_setup
from epic_rag.bench.lookalike import KINDS, lookalike_samples


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_sample_i_is_the_same_whatever_n_is(tok):
    few, many = lookalike_samples(tok, n=3), lookalike_samples(tok, n=9)
    assert [s.chunks for s in few] == [s.chunks for s in many[:3]]
    assert [s.answer for s in few] == [s.answer for s in many[:3]]


def test_the_asked_value_sits_once_in_its_home_chunk_and_its_lookalike_elsewhere(tok):
    samples = lookalike_samples(tok, n=16)
    assert {s.meta["kind"] for s in samples} == {k.name for k in KINDS}
    assert {s.meta["form"] for s in samples} == {"prose", "table"}
    for s in samples:
        home = s.meta["home_chunk"]
        assert sum(c.count(s.answer) for c in s.chunks) == 1 and s.answer in s.chunks[home], s.id
        for v in s.meta["lookalike_values"]:
            assert v != s.answer
            where = [i for i, c in enumerate(s.chunks) if v in c]
            assert where and home not in where, s.id
        assert len(s.chunks) == 5 and s.answer_prefix and s.question.endswith("?")


def test_dev_and_test_samples_are_disjoint(tok):
    test = build_samples(tok, {"lookalike": 12}, tasks=("lookalike",))
    dev = build_samples(tok, {"lookalike": 12}, tasks=("lookalike",), split="dev")
    assert not {s.question for s in test} & {s.question for s in dev}
    assert all(s.id.startswith("dev-look-") for s in dev) and all(s.id.startswith("look-") for s in test)


def test_rows_count_only_for_the_dtype_they_were_made_with_and_older_rows_as_fp32(tmp_path):
    setup = {"lookalike": {"model": "m", "max_tokens": 24, "version": 2, "dtype": "bfloat16"}}
    rows = tmp_path / "rows.jsonl"
    made_bf16 = row_setup(setup, "lookalike", "full", "x")
    old = {k: v for k, v in made_bf16.items() if k != "dtype"}  # written before the dtype was recorded
    rows.write_text(
        "\n".join(
            json.dumps({"id": i, "task": "lookalike", "policy": "full", "setup": s})
            for i, s in (("a", made_bf16), ("b", old))
        )
    )
    kept, other = load_rows(rows, setup, "x")
    assert [r["id"] for r in kept] == ["a"] and other == 1
    fp32 = {"lookalike": dict(setup["lookalike"], dtype="float32")}
    kept, other = load_rows(rows, fp32, "x")
    assert [r["id"] for r in kept] == ["b"] and other == 1
