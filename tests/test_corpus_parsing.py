"""Document parsing cannot hang or crash its caller: linear-time normalisation, HTML/PDF in a worker
process under CPU, memory, wall-time, page and output limits, every parser failure a ValueError.
No model; each isolated parse starts a small worker process (forkserver)."""

from __future__ import annotations

import logging
import time

import pytest

from epic_rag.corpus import ParseLimits, load_documents, normalise_text, read_document


def test_normalising_a_long_run_of_spaces_is_linear_time():
    # The old re.sub(r"[ \t]+\n") took ~4 s on 40k spaces and hours on 10 MiB; this is 1M spaces.
    text = "a" + " " * 1_000_000 + "b\n" + " \t" * 100_000 + "\nend"
    t0 = time.perf_counter()
    doc = read_document("spaces.txt", text.encode())
    assert time.perf_counter() - t0 < 1.0
    assert doc.text.endswith("b\n\nend")


def test_normalise_strips_trailing_blanks_of_each_line_only():
    assert normalise_text("  a \t\n b  \n\n c\t") == "a\n b\n\n c"


@pytest.mark.parametrize(
    "name, data, needle",
    [
        ("bomb.html", b"<![" * 2000, "HTML"),  # html.parser raises AssertionError here
        ("bad.pdf", b"%PDF-1.4 this is not a pdf", "PDF"),
        ("nopdf.pdf", b"hello", "PDF"),
        ("bad.txt", b"\xff\xfe", "UTF-8"),
        ("nul.md", b"a\x00b", "NUL"),
    ],
)
def test_every_parser_failure_is_a_value_error(name, data, needle):
    with pytest.raises(ValueError, match=needle):
        read_document(name, data)


def test_html_that_would_take_quadratic_time_is_stopped_by_the_cpu_limit():
    # The CPU limit, not the (generous) wall-clock one, must be what stops it: no timing asserted, so a
    # loaded machine cannot fail this test.
    limits = ParseLimits(cpu_s=1, wall_s=600)
    with pytest.raises(ValueError, match="exceeded its CPU or memory limit"):
        read_document("slow.html", b"<a" * 2_000_000, limits)  # minutes of stdlib HTMLParser


def test_extracted_text_over_the_character_cap_is_refused():
    with pytest.raises(ValueError, match="more than 1000 characters"):
        read_document("big.html", b"<p>" + b"x" * 5000 + b"</p>", ParseLimits(max_chars=1000))
    with pytest.raises(ValueError, match="more than 1000 characters"):
        read_document("big.txt", b"x" * 5000, ParseLimits(max_chars=1000))


def test_html_is_parsed_to_text_in_the_worker():
    doc = read_document("p.html", b"<html><script>x()</script><p>tides &amp; moons</p></html>")
    assert doc.text == "tides & moons"


def _pdf(pages: int, text: str = "hello") -> bytes:
    import io

    from pypdf import PdfWriter

    w = PdfWriter()
    for _ in range(pages):
        w.add_blank_page(72, 72)
    buf = io.BytesIO()
    w.write(buf)
    return buf.getvalue()


def test_pdf_with_more_pages_than_the_cap_is_refused():
    with pytest.raises(ValueError, match="3 pages; the limit is 2"):
        read_document("many.pdf", _pdf(3), ParseLimits(max_pages=2))


def test_a_bad_file_in_a_corpus_folder_is_skipped_and_logged_not_fatal(tmp_path, caplog):
    (tmp_path / "good.txt").write_text("good text")
    (tmp_path / "bomb.html").write_bytes(b"<![" * 100)
    with caplog.at_level(logging.WARNING, logger="epic_rag.corpus"):
        docs = load_documents(tmp_path)
    assert [d.name for d in docs] == ["good.txt"]
    assert "bomb.html" in caplog.text
