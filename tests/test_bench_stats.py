"""The accuracy benchmark's statistics, scores and generated pydoc sets on hand-made data (no model)."""

from __future__ import annotations

import math
import random

import pytest

from epic_rag.bench.accuracy import accuracy_table, open_table, summarize
from epic_rag.bench.metrics import is_degenerate, name_match
from epic_rag.bench.report import accuracy_markdown, accuracy_section
from epic_rag.bench.stats import mcnemar_exact, mean_ci, paired_diff, proportion, wilson


def _binom_two_sided(k: int, n: int) -> float:
    """Exact two-sided binomial test at p = 1/2, written out: twice the smaller tail, at most 1."""
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2**n
    return min(1.0, 2 * tail)


# ---------------------------------------------------------------------- intervals and tests
def test_wilson_matches_the_textbook_values():
    lo, hi = wilson(69, 100)
    assert lo == pytest.approx(0.5937, abs=1e-4) and hi == pytest.approx(0.7722, abs=1e-4)
    lo, hi = wilson(0, 10)  # Wilson stays inside [0, 1] at the edges, unlike the normal interval
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(10, 10)
    assert hi == 1.0 and lo == pytest.approx(0.7225, abs=1e-4)
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_proportion_counts_outcomes():
    p = proportion([1, 0, 1, 1])
    assert (p.k, p.n, p.rate) == (3, 4, 0.75) and p.low < 0.75 < p.high


@pytest.mark.parametrize("better,worse", [(7, 4), (0, 5), (3, 3), (12, 1), (0, 0), (40, 25)])
def test_mcnemar_is_the_exact_binomial_test_on_discordant_pairs(better, worse):
    expected = 1.0 if better + worse == 0 else _binom_two_sided(better, better + worse)
    assert mcnemar_exact(better, worse) == pytest.approx(expected, rel=1e-9)


def test_mcnemar_known_values():
    assert mcnemar_exact(7, 4) == pytest.approx(0.548828125)  # 2 * 562 / 2048
    assert mcnemar_exact(0, 5) == pytest.approx(0.0625)


def test_paired_diff_counts_discordant_pairs_and_bounds_the_difference():
    # policy right on 7 samples where full is wrong, wrong on 4 where full is right, 89 agree
    x = [1] * 7 + [0] * 4 + [1] * 60 + [0] * 29
    y = [0] * 7 + [1] * 4 + [1] * 60 + [0] * 29
    d = paired_diff(x, y)
    assert (d.n, d.better, d.worse) == (100, 7, 4)
    assert d.diff == pytest.approx(0.03)
    assert d.low < 0.03 < d.high and d.low < 0 < d.high  # +3 points on 100 pairs is noise
    assert d.p_value == pytest.approx(0.548828125)
    # the paired interval is close to the normal one for the mean of the differences
    sd = math.sqrt((11 / 100) - 0.03**2)
    assert d.high - d.low == pytest.approx(2 * 1.96 * sd / 10, rel=0.15)
    assert paired_diff(x, y) == d  # fixed seed: the same interval every time


def test_paired_diff_edge_cases():
    same = paired_diff([1, 0, 1], [1, 0, 1])
    assert (same.diff, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
    all_better = paired_diff([1] * 20, [0] * 20)
    assert (all_better.diff, all_better.low, all_better.high) == (1.0, 1.0, 1.0)
    assert all_better.p_value == pytest.approx(2 / 2**20)
    scores = paired_diff([0.5, 0.25], [0.25, 0.25])  # non-binary: no McNemar
    assert scores.diff == pytest.approx(0.125) and math.isnan(scores.p_value)
    with pytest.raises(ValueError):
        paired_diff([1], [1, 0])


def test_mean_ci():
    m = mean_ci([0.0, 1.0] * 50)
    assert m.mean == 0.5 and m.low < 0.5 < m.high and m.high - m.low == pytest.approx(0.196, abs=0.03)
    assert math.isnan(mean_ci([]).mean)


# ---------------------------------------------------------------------- scores
LOOP = "The above code is a bit verbose and can be achieved with a simple and efficient way. "


def test_is_degenerate_finds_loops():
    assert is_degenerate(LOOP * 3)
    assert is_degenerate(LOOP * 2)  # a long sentence said twice is already a loop
    assert is_degenerate("Use json. " + "the the the the " * 3)
    assert is_degenerate("Call it with a list of values, then a list of values, then a list of values, then")


def test_is_degenerate_passes_normal_answers():
    assert not is_degenerate(LOOP)
    assert not is_degenerate(
        "Use json.dumps to serialize an object to a JSON formatted string. Pass indent=4 for pretty output, "
        "and sort_keys=True to sort the keys. For example, json.dumps({'a': 1}, indent=4) returns a string."
    )
    assert not is_degenerate("| a | b |\n|---|---|\n| 1 | 2 |\n|---|---|\n| 3 | 4 |")  # table rules are not words
    assert not is_degenerate("```python\nimport os\nos.path.join(a, b)\n```\nThis joins two paths.")
    assert not is_degenerate("")


def test_name_match_is_a_whole_identifier():
    assert name_match(" `json.dumps()`.", "dumps") == 1.0
    assert name_match("dumps(obj)", "dumps") == 1.0
    assert name_match("loads", "load") == 0.0
    assert name_match("the load function", "load") == 1.0
    assert name_match("getmtime", "getatime") == 0.0


# ---------------------------------------------------------------------- pydoc sets (a whitespace tokenizer)
class WordTokenizer:
    def encode(self, text, add_special_tokens=False):
        return text.split()


def test_docsqa_samples_are_deterministic_unambiguous_and_stable_in_n():
    from epic_rag.bench.pydocqa import docsqa_samples

    tok = WordTokenizer()
    few, more = docsqa_samples(tok, 5), docsqa_samples(tok, 12)
    assert [s.id for s in few] == [s.id for s in more[:5]]  # sample i does not depend on n
    assert [s.chunks for s in few] == [s.chunks for s in more[:5]]
    assert len({s.id for s in more}) == 12
    for s in more:
        assert s.task == "docsqa" and len(s.chunks) == 4
        answer_chunk = s.chunks[s.meta["answer_chunk"]]
        assert f"    {s.answer}(" in answer_chunk and answer_chunk.split("\n")[0].endswith(f" {s.meta['module']}")
        others = [c for i, c in enumerate(s.chunks) if i != s.meta["answer_chunk"]]
        assert not any(name_match(c, s.answer) and f"    {s.answer}(" in c for c in others)
        assert not name_match(s.question.split(" described as ")[1], s.answer)  # the question does not tell


def test_open_questions_read_like_a_user_asks():
    from epic_rag.bench.pydocqa import DocFunction, open_question

    rng = random.Random(0)
    f = DocFunction("os.path", "getmtime", "", "Return the last modification time of a file, reported by os.stat()")
    assert (
        open_question(f, rng)
        == "How do I get the last modification time of a file, reported by os.stat() with os.path?"
    )
    g = DocFunction("dataclasses", "is_dataclass", "", "Returns True if obj is a dataclass")
    assert open_question(g, rng) == "How do I check if obj is a dataclass with dataclasses?"
    h = DocFunction("functools", "wraps", "", "Decorator factory to apply update_wrapper() to a wrapper function")
    assert open_question(h, rng) in ("What does functools.wraps do?", "How do I use functools.wraps?")


# ---------------------------------------------------------------------- summaries and report
def _rows() -> list[dict]:
    rows = []
    for i in range(20):
        for p, right in (("full", i < 15), ("naive", i < 6), ("legolink-16", 1 <= i < 16)):
            rows.append(
                {
                    "id": f"niah-{i}",
                    "task": "niah",
                    "policy": p,
                    "substring": float(right),
                    "f1": 0.0,
                    "rouge_l": 0.0,
                    "degenerate": False,
                    "ttft_s": 0.1,
                    "recomputed_tokens": 5,
                }
            )
    for i in range(4):
        for p, text in (
            ("full", "Use json.dumps to write JSON."),
            ("naive", LOOP * 3),
            ("legolink-16", "Use json.dumps."),
        ):
            rows.append(
                {
                    "id": f"open-{i}",
                    "task": "open",
                    "policy": p,
                    "prediction": text,
                    "substring": None,
                    "f1": None,
                    "rouge_l": None,
                    "degenerate": is_degenerate(text),
                    "ttft_s": 0.1,
                    "recomputed_tokens": 5,
                }
            )
    return rows


def test_accuracy_and_open_tables():
    rows = _rows()
    acc = {
        r["policy"]: r
        for r in accuracy_table([r for r in rows if r["task"] == "niah"], ["full", "naive", "legolink-16"])
    }
    assert acc["full"]["acc"] == 75.0 and "diff" not in acc["full"]
    assert acc["naive"]["diff"] == pytest.approx(-45.0) and (acc["naive"]["better"], acc["naive"]["worse"]) == (0, 9)
    assert acc["naive"]["p_value"] == pytest.approx(2 / 2**9) and acc["naive"]["diff_high"] < 0
    assert (acc["legolink-16"]["better"], acc["legolink-16"]["worse"]) == (1, 1)
    opened = {
        r["policy"]: r for r in open_table([r for r in rows if r["task"] == "open"], ["full", "naive", "legolink-16"])
    }
    assert opened["naive"]["degenerate"] == 100.0 and opened["full"]["degenerate"] == 0.0
    assert opened["legolink-16"]["f1"] > opened["naive"]["f1"]


def test_summary_and_markdown():
    rows = _rows()
    pols = ["full", "naive", "legolink-16"]
    s = summarize(rows, pols)
    assert [r["policy"] for r in s["summary"]] == pols and all(r["n"] == 24 for r in s["summary"])
    assert s["summary"][0]["substring_acc"] == 75.0 and list(s["tasks"]) == ["niah"]
    acc = {
        "model": "m",
        "machine": {},
        "commands": ["epic-rag bench accuracy"],
        "samples_per_task": {"niah": 20, "open": 4},
        "policies": pols,
        "max_tokens": 24,
        "open_max_tokens": 64,
        "reference": "full",
        "stats": {"ci": "95%"},
        "gen_seconds_median": {"niah/full": 0.1},
        **s,
    }
    md = accuracy_markdown(acc, "accuracy.png")
    assert "`epic-rag bench accuracy`" in md and "| naive | 20 | 30.0 [14.5, 51.9] | -45.0 [" in md
    assert "| 0/9 | 0.004 |" in md and "![accuracy per policy](accuracy.png)" in md
    assert "## open" in md and "| naive | 4 |" in md
    assert accuracy_section(acc)[0].startswith("## Accuracy")


def test_bench_samples_take_one_count_or_a_count_per_task():
    from epic_rag.bench.cli import parse_args, samples_per_task

    assert samples_per_task(parse_args(["accuracy"]).samples) is None
    assert samples_per_task(parse_args(["accuracy", "--samples", "30"]).samples) == 30
    per = samples_per_task(parse_args(["accuracy", "--samples", "30", "open=12", "niah=15"]).samples)
    assert per == {"niah": 15, "multidoc": 30, "docsqa": 30, "lookalike": 30, "open": 12}
    with pytest.raises(SystemExit):
        parse_args(["accuracy", "--samples", "weather=3"])
