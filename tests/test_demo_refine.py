"""The demo's refine pass (neighbour-aware compile) on SmolLM2: once the corpus is compiled, every chunk is
compiled again behind its nearest chunks by the library's own FAISS index, links of it use that record, and a
deleted document takes its chunks' refined forms, and those refined behind them, out of use."""

from __future__ import annotations

import pytest

from epic_rag import RagRequest
from epic_rag_demo.config import DemoConfig
from epic_rag_demo.library import Library

pytestmark = pytest.mark.smollm

DOCS = {
    "ledger-a.txt": "Account Amber Finch holds 412 credits and was opened in Lisbon in 2019.",
    "ledger-b.txt": "Account Amber Fitch holds 947 credits and was opened in Lyon in 2017.",
    "ledger-c.txt": "Account Amber Flint holds 305 credits and was opened in Leeds in 2021.",
    "garden.txt": "The greenhouse keeps orchids at 24 degrees and waters them every third morning.",
}


@pytest.fixture()
def library(smol_engine, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in DOCS.items():
        (corpus / name).write_text(text)
    lib = Library(DemoConfig(corpus=str(corpus), data_dir=tmp_path / "data", store="memory", refine_neighbours=2))
    lib.start(smol_engine)
    assert lib.wait_refined(240), lib.status()
    yield lib
    lib.stop()


def _form(engine, text: str) -> str:
    return engine.chunks.form_of(engine.chunks.chunk_tokens(text))


def _nearest(lib, cid: str, k: int) -> tuple[str, ...]:
    """The chunk's k nearest other chunks by the library's index, the nearest last."""
    (hits,) = [lib.search(lib.chunks[cid].text, k + 1)]
    return tuple(c.id for c, _ in hits if c.id != cid)[:k][::-1]


def test_every_chunk_is_refined_behind_its_nearest_chunks_and_links_use_that_record(library, smol_engine):
    chunks = list(library.chunks.values())
    assert library.status()["refined"] == len(chunks) == len(DOCS)
    for c in chunks:
        assert c.near == _nearest(library, c.id, 2)
        assert _form(smol_engine, c.text) != smol_engine.chunks.variant  # linked in its refined form
    a = library.chunks["ledger-a.txt#0"]
    assert set(a.near) == {"ledger-b.txt#0", "ledger-c.txt#0"}  # the look-alikes are each other's neighbours
    g = smol_engine.generate(
        RagRequest(question="How many credits does Amber Finch hold?", chunks=[a.text]), max_tokens=2
    )
    assert g.chunk_keys[0] != a.ref.key  # the refined record, not the plain one


def test_deleting_a_document_takes_its_refined_forms_out_of_use_and_refines_its_neighbours_again(library, smol_engine):
    gone = library.chunks["ledger-b.txt#0"]
    behind_it = [c for c in library.chunks.values() if gone.id in (c.near or ())]
    assert behind_it, "no chunk was refined behind the deleted one: the test proves nothing"
    library.delete("ledger-b.txt")
    assert _form(smol_engine, gone.text) == smol_engine.chunks.variant  # the deleted chunk links plain
    assert library.wait_refined(240), library.status()
    for c in library.chunks.values():
        assert gone.id not in c.near and c.near == _nearest(library, c.id, 2)
    assert library.status()["refined"] == len(library.chunks) == len(DOCS) - 1


def test_a_stopped_library_leaves_the_engine_linking_its_chunks_plain(library, smol_engine):
    texts = [c.text for c in library.chunks.values()]
    library.stop()
    assert all(_form(smol_engine, t) == smol_engine.chunks.variant for t in texts)


def test_refine_neighbours_zero_refines_nothing(smol_engine, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "one.txt").write_text(DOCS["garden.txt"])
    (corpus / "two.txt").write_text(DOCS["ledger-a.txt"])
    lib = Library(DemoConfig(corpus=str(corpus), data_dir=tmp_path / "data", store="memory", refine_neighbours=0))
    lib.start(smol_engine)
    try:
        assert lib.wait_refined(120)
        assert lib.status()["refined"] == 0 and all(c.near is None for c in lib.chunks.values())
        assert all(_form(smol_engine, c.text) == smol_engine.chunks.variant for c in lib.chunks.values())
    finally:
        lib.stop()


def test_refine_neighbours_must_be_a_non_negative_integer(tmp_path):
    with pytest.raises(ValueError, match="refine_neighbours"):
        DemoConfig(data_dir=tmp_path, refine_neighbours=-1)
