"""auto's look-alike guard (engine/guard.py) on text alone: which question words are keys, what counts as a
look-alike of one, and that a request escalates only where a key and its twin sit in two different chunks."""

from __future__ import annotations

import pytest

from epic_rag.engine.guard import REASON, check, is_lookalike, question_keys, question_text
from epic_rag.types import Chunk, ChunkRef, RagRequest

PRICE = "Part HT-8957-B (cable gland) is listed at $923.88 per unit."
TWIN = "Part HT-8975-B (hex bolt set) is listed at $547.37 per unit."
OTHER = "The fire drill is scheduled for Thursday. Questions can go to your line manager."


def test_keys_are_codes_versions_identifiers_and_names_not_sentence_starts():
    q = 'Which port does service payroll-gateway version 1.13.0 of Daniel Lindqvist use? "Return" it.'
    assert question_keys(q) == {"payroll-gateway", "1.13.0", "Daniel", "Lindqvist"}
    assert question_keys("What is the default timeout of sync_report_v2() in seconds?") == {"sync_report_v2"}
    assert question_keys("<|im_start|>user\nWhich shelf holds the binders?<|im_end|>") == set()


@pytest.mark.parametrize(
    "key, word, twin",
    [
        ("HT-8957-B", "HT-8975-B", True),  # one part of a code changed
        ("1.13.0", "1.14.0", True),  # the next minor version
        ("sync_report_v2", "fetch_report_v2", True),  # the same call under another verb
        ("Lindqvist", "Linddvist", True),  # a one-letter change of a name
        ("Rasmussen", "Rusmussen", True),
        ("AX-4521", "AX-4512", True),  # a two-part code, its number's digits swapped
        ("os.path", "os.stat", False),  # a sibling: another name in the same module
        ("HT-8957-B", "HT-8957-B", False),  # the key itself
        ("HT-8957-B", "NF-5958-C", False),  # every part differs: another record, not a twin
        ("sync_report_v2", "sync_report", False),  # another shape
        ("Novak", "Novaks", False),  # an inflection
        ("Albright", "Wainwright", False),  # too far
        ("Ana", "Ann", False),  # too short to tell
        ("None", "one", False),
        ("Novak", "novak", False),  # case only
        ("option_string", "option_strings", False),  # an inflection of one part
        ("archive_ledger", "validate_ledger", True),  # the same name on another owner
        ("D.items", "D.keys", False),  # a sibling
    ],
)
def test_lookalike_is_one_part_changed_or_a_short_edit(key, word, twin):
    assert is_lookalike(key, word) is twin


def test_a_key_with_a_twin_in_another_chunk_escalates_and_names_it():
    v = check("What is the unit price of part HT-8957-B?", [OTHER, PRICE, TWIN])
    assert v.escalate and v.reason == REASON
    assert [(t.key, t.lookalike, t.chunk) for t in v.twins] == [("HT-8957-B", "HT-8975-B", 2)]


def test_no_escalation_without_a_twin_or_with_both_twins_in_one_chunk():
    q = "What is the unit price of part HT-8957-B?"
    assert not check(q, [OTHER, PRICE]).escalate  # the key, no twin
    assert not check(q, [OTHER, PRICE + " " + TWIN]).escalate  # compiled together: the chunk saw both
    assert not check(q, [PRICE, PRICE]).escalate  # the same record twice is no look-alike
    assert not check("When is the fire drill?", [OTHER, PRICE, TWIN]).escalate  # no key in the question
    assert not check(q, [PRICE + " " + TWIN]).escalate  # one chunk: nothing is linked apart


def test_question_text_is_a_rag_questions_or_the_plain_text_after_the_last_chunk():
    assert question_text(RagRequest(question="Price of HT-8957-B?", chunks=[PRICE]), []) == "Price of HT-8957-B?"
    segs = [
        "<|im_start|>user\nDocument 1:\n",
        Chunk(PRICE),
        "\n",
        ChunkRef(key="k", num_tokens=3),
        "\nPrice of HT-8957-B?",
    ]
    assert question_text(segs, segs) == "\nPrice of HT-8957-B?"
    assert question_text("no chunks here", ["no chunks here"]) == "no chunks here"
