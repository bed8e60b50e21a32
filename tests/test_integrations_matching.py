"""Finding compiled chunk texts inside framework-rendered prompts (text index; tiny engine for str prompts)."""

from __future__ import annotations

import pytest

from epic_rag import ChunkRef, RagRequest
from epic_rag.matching import ChunkTextIndex
from epic_rag.prompt import to_segments

A = "The Larkspur Bridge opened in 1931 and crosses the Vell River."
B = "Tovin is a small town in the northern hills; its industry is wool."


def _index(*texts: str) -> ChunkTextIndex:
    idx = ChunkTextIndex()
    for i, t in enumerate(texts):
        idx.add(ChunkRef(f"plain-{i}", 10, t))
    return idx


def _join(segments) -> str:
    return "".join(s if isinstance(s, str) else s.text for s in segments)


def test_split_finds_registered_texts_in_any_order_and_keeps_the_glue():
    idx = _index(A, B)
    prompt = f"Context:\n{B}\n\n{A}\nQuery: where?"
    segs = idx.split(prompt)
    assert [s.key for s in segs if isinstance(s, ChunkRef)] == ["plain-1", "plain-0"]
    assert _join(segs) == prompt
    assert segs[0] == "Context:\n" and segs[-1] == "\nQuery: where?"


def test_split_without_matches_returns_the_prompt_as_one_glue_piece():
    assert _index(A).split("nothing known here, just a question") == ["nothing known here, just a question"]
    assert ChunkTextIndex().split("") == []


def test_matches_respect_word_boundaries_and_short_texts_are_ignored():
    idx = _index(A, "short text")
    assert idx.split("x" + A) == ["x" + A]  # inside a longer word: not a chunk
    assert len(idx) == 1  # under min_chars: never registered
    assert [type(s) for s in idx.split("(" + A + ")")] == [str, ChunkRef, str]


def test_longest_registered_text_wins_at_one_position():
    longer = A + " It is 412 metres long."
    idx = _index(A, longer)
    segs = idx.split("Doc: " + longer + "\n")
    assert [s.text for s in segs if isinstance(s, ChunkRef)] == [longer]


def test_chunks_full_of_boilerplate_that_starts_other_chunks_are_all_found():
    # pydoc-like chunks: the boilerplate that begins some chunks repeats inside every other one. Positions
    # inside a found chunk used to be scanned too; their candidate comparisons spent the prompt's budget,
    # and the trace benchmark's prompts of 4-8 such chunks lost their later chunks to glue.
    gutter = " |  " + "-" * 70 + "\n |  Data descriptors defined here:\n |  \n |  __dict__\n"
    starts = [f"{gutter} |  __weakref__ of C{i}\n" for i in range(8)]  # chunks cut inside a class body
    texts = [f"class C{i}:\n{gutter * 30} |  method_{i}(self)\n{gutter * 30}end of class C{i}." for i in range(40)]
    idx = _index(*texts, *starts)
    prompt = "".join(f"Document {j}:\n{texts[i]}\n\n" for j, i in enumerate(range(0, 40, 5))) + "Question?"
    found = [s.key for s in idx.split(prompt) if isinstance(s, ChunkRef)]
    assert found == [f"plain-{i}" for i in range(0, 40, 5)]


def test_split_rejects_non_strings():
    with pytest.raises(ValueError):
        _index(A).split(b"bytes")  # type: ignore[arg-type]


# ---------------------------------------------------------------- tiny engine (str prompts, chat messages)
# Texts no other test compiles: the session's engine (and its text index) is shared across test files.
TINY_CHUNKS = [
    "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b",
    "class Queue:\n    def __init__(self):\n        self.items = []",
]


def test_engine_links_compiled_chunks_found_in_a_rendered_string_prompt(tiny_engine):
    tiny_engine.compile(TINY_CHUNKS)
    prompt = f"Context:\n{TINY_CHUNKS[1]}\n\n{TINY_CHUNKS[0]}\nQuestion: which function subtracts?\nAnswer:"
    g = tiny_engine.generate(prompt, max_tokens=4, policy="legolink-4")
    assert g.chunk_hits == 2 and g.chunk_misses == 0 and g.linked_tokens > 0
    # The same pieces given as explicit segments build the same prompt tokens.
    segs = to_segments(tiny_engine.tokenizer, tiny_engine.text_index, prompt)
    assert [s.text for s in segs if isinstance(s, ChunkRef)] == TINY_CHUNKS[::-1]
    explicit = tiny_engine.generate(segs, max_tokens=4, policy="legolink-4")
    assert explicit.token_ids == g.token_ids and explicit.prompt_tokens == g.prompt_tokens


def test_engine_string_prompt_without_known_chunks_is_plain_text(tiny_engine):
    g = tiny_engine.generate("An unrelated prompt with nothing compiled in it:", max_tokens=2)
    assert g.chunk_hits == g.chunk_misses == 0 and g.linked_tokens == 0


def test_render_messages_matches_chunks_inside_chat_templated_messages(tiny_engine):
    tiny_engine.compile(TINY_CHUNKS)
    segs = tiny_engine.render_messages(
        [
            {"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{TINY_CHUNKS[0]}\n\nWhat does sub do?"},
        ]
    )
    refs = [s for s in segs if isinstance(s, ChunkRef)]
    assert [r.text for r in refs] == [TINY_CHUNKS[0]]
    text = tiny_engine.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Answer from the context."},
            {"role": "user", "content": f"Context:\n{TINY_CHUNKS[0]}\n\nWhat does sub do?"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert _join(segs) == text
    g = tiny_engine.generate(segs, max_tokens=2, policy="legolink-4")
    assert g.chunk_hits == 1 and g.chunk_misses == 0


def test_engine_still_rejects_bytes_prompts(tiny_engine):
    with pytest.raises(ValueError):
        tiny_engine.generate(b"bytes", max_tokens=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tiny_engine.generate(RagRequest(question=""), max_tokens=2)
