"""The accuracy bench's refined policies (`nbr<K>/<policy>`), without a model: their names parse, their rows
count only for the refined compile form, and each sample runs its plain policies over plain records first, then
refines (timed) and links plain again afterwards, so no other row ever links a refined record."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from epic_rag.bench.accuracy import _linked_in_form, load_rows, row_setup
from epic_rag.bench.common import refined_policy
from epic_rag.bench.datasets import Sample


def test_refined_policy_names_parse_and_bad_ones_are_refused():
    assert refined_policy("nbr2/legolink-16") == (2, "legolink-16")
    assert refined_policy("query-20") == (0, "query-20")
    for bad in ("nbr0/naive", "nbr2/full", "nbr2/prefix"):
        with pytest.raises(ValueError, match="nbr<K>/"):
            refined_policy(bad)


def test_a_refined_row_counts_only_for_the_refined_form(tmp_path):
    setup = {"lookalike": {"model": "m", "max_tokens": 24, "version": 2, "dtype": "float32"}}
    assert row_setup(setup, "lookalike", "nbr2/naive", "v")["compile"] == "v+nbr2"
    assert row_setup(setup, "lookalike", "naive", "v")["compile"] == "v"
    rows = tmp_path / "rows.jsonl"
    made = [("nbr2/naive", row_setup(setup, "lookalike", "nbr2/naive", "v"))]
    made += [("nbr2/naive", row_setup(setup, "lookalike", "naive", "v"))]  # linked plain: not a refined row
    rows.write_text(
        "".join(json.dumps({"id": "a", "task": "lookalike", "policy": p, "setup": s}) + "\n" for p, s in made)
    )
    kept, other = load_rows(rows, setup, "v")
    assert len(kept) == 1 and other == 1 and kept[0]["setup"]["compile"] == "v+nbr2"


class RefineRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def refine_nearest(self, chunks, k=2, embeddings=None, batch_size=8):
        self.calls.append(("refine", tuple(chunks), k))

    def unrefine(self, chunks):
        self.calls.append(("unrefine", tuple(chunks)))

    def prepare(self, segs, policy=None):  # auto's guard escalates the prompts marked "twin"
        return SimpleNamespace(escalated="lookalike-keys" if "twin" in segs else None)


def test_plain_policies_run_first_then_each_k_refined_and_unrefined_after():
    eng = RefineRecorder()
    s = Sample("x", "lookalike", ["c0", "c1", "c2"], "q?", "a")
    order = []
    for p, took in _linked_in_form(eng, s, ["nbr5/naive", "full", "nbr1/legolink-16", "naive", "nbr5/query-20"], []):
        order.append((p, took is not None, [c[0] for c in eng.calls]))
    assert [o[0] for o in order] == ["full", "naive", "nbr1/legolink-16", "nbr5/naive", "nbr5/query-20"]
    assert [o[2] for o in order[:2]] == [[], []]  # nothing refined while the plain policies run
    assert order[2][1] and order[2][2] == ["refine"]
    assert eng.calls == [
        ("refine", ("c0", "c1", "c2"), 1),
        ("unrefine", ("c0", "c1", "c2")),
        ("refine", ("c0", "c1", "c2"), 2),  # k capped at the other chunks
        ("unrefine", ("c0", "c1", "c2")),
    ]


def test_a_one_chunk_sample_is_not_refined_and_a_failed_generation_still_unrefines():
    eng = RefineRecorder()
    one = Sample("y", "docsqa", ["only"], "q?", "a")
    assert [p for p, _ in _linked_in_form(eng, one, ["nbr2/naive"], [])] == ["nbr2/naive"]
    assert eng.calls == [("unrefine", ("only",))]
    eng.calls.clear()
    gen = _linked_in_form(eng, Sample("z", "docsqa", ["a", "b"], "q?", "a"), ["nbr2/naive"], [])
    next(gen)
    gen.close()  # the generation raised: the loop ends, the chunks are linked plain again
    assert eng.calls[-1] == ("unrefine", ("a", "b"))


def test_an_auto_group_its_guard_escalates_runs_without_the_refine_it_would_not_use():
    eng = RefineRecorder()
    s = Sample("w", "lookalike", ["c0", "c1"], "q?", "a")
    assert [(p, t) for p, t in _linked_in_form(eng, s, ["nbr2/auto"], ["twin"])] == [("nbr2/auto", None)]
    assert eng.calls == []
    assert [p for p, t in _linked_in_form(eng, s, ["nbr2/auto", "nbr2/naive"], ["twin"])] == ["nbr2/auto", "nbr2/naive"]
    assert [c[0] for c in eng.calls] == ["refine", "unrefine"]  # another policy of the group links refined
    eng.calls.clear()
    assert [p for p, t in _linked_in_form(eng, s, ["nbr2/auto"], ["plain"])] == ["nbr2/auto"]
    assert [c[0] for c in eng.calls] == ["refine", "unrefine"]  # not escalated: links the refined records
