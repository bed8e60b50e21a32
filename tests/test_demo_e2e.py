"""The chat page end to end in headless Debian Chromium (Python playwright, no browser download):
open the page, ask, watch the answer stream in with citations and stats; document text stays text.

Set DEMO_SCREENSHOT=docs/demo-screenshot.png to refresh the README's screenshot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from epic_rag.corpus import pydoc_documents
from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DemoConfig
from epic_rag_demo.server import create_app

pytestmark = pytest.mark.smollm

CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "e2e-key"


@pytest.fixture(scope="module")
def server(smol_engine, tmp_path_factory):
    if not Path(CHROMIUM).exists() or shutil.which("chromium") is None:
        pytest.skip("Debian chromium is not installed (scripts/setup.sh installs it)")
    pytest.importorskip("playwright.sync_api")
    root = tmp_path_factory.mktemp("demo-e2e")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "archive.txt").write_text(
        "The secret passcode for the archive room is 7314. Only the head librarian may share it."
    )
    (corpus / "bridge.txt").write_text(
        "The Larkspur Bridge opened in 1931. It crosses the Vell River and is 412 metres long."
    )
    for doc in pydoc_documents(["json"]):
        (corpus / doc.name).write_text(doc.text)
    app = create_app(
        engine=smol_engine, config=DemoConfig(corpus=str(corpus), data_dir=root / "data", api_key=KEY, top_k=3)
    )
    srv = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(300), app.state.demo.library.status()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def page(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        pg = browser.new_page(viewport={"width": 1360, "height": 900})
        errors: list[str] = []
        pg.on("pageerror", lambda e: errors.append(str(e)))
        pg.goto(server.url + "/")
        pg.fill("#api-key", KEY)
        pg.dispatch_event("#api-key", "change")
        pg.errors = errors
        yield pg
        browser.close()


def _ask(page, question: str, timeout_ms: int = 120_000):
    n = page.locator(".bubble.assistant").count()
    page.fill("#question", question)
    page.click("#ask")
    bubble = page.locator(".bubble.assistant").nth(n)
    bubble.locator(".stats .stat").first.wait_for(timeout=timeout_ms)
    return bubble


def test_page_loads_documents_and_progress(page):
    # Function form: the page's CSP forbids eval, which playwright uses for bare expressions.
    page.wait_for_function("() => document.querySelectorAll('#doc-list li').length >= 3", timeout=30_000)
    names = page.locator("#doc-list .doc-name").all_text_contents()
    assert {"archive.txt", "bridge.txt", "pydoc-json.txt"} <= set(names)
    page.wait_for_function(
        "() => document.getElementById('ingest-text').textContent.includes('chunks compiled')", timeout=30_000
    )
    assert page.locator("#policy option").count() >= 4


def test_ask_streams_an_answer_with_citations_and_stats(page):
    # Count DOM updates of the answer while it streams: a streamed answer arrives in several pieces.
    page.evaluate("""() => {
        window.__updates = 0;
        new MutationObserver(() => window.__updates++).observe(
            document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
    }""")
    page.select_option("#policy", "legolink-16")
    bubble = _ask(page, "What is the secret passcode for the archive room?")
    text = bubble.locator(".text").text_content()
    assert "7314" in text, text
    assert page.evaluate("window.__updates") > 5
    cites = bubble.locator(".source summary").all_text_contents()
    assert cites and any("archive.txt" in c for c in cites), cites
    stats = " ".join(bubble.locator(".stats .stat").all_text_contents())
    assert "TTFT" in stats and "linked" in stats and "recomputed" in stats and "legolink-16" in stats
    assert bubble.locator(".reask button").count() >= 3
    assert not page.errors


def test_policy_switch_shows_the_difference(page):
    bubble = page.locator(".bubble.assistant").last
    bubble.locator(".reask button", has_text="full").click()
    again = page.locator(".bubble.assistant").last
    again.locator(".stats .stat").first.wait_for(timeout=120_000)
    stats = " ".join(again.locator(".stats .stat").all_text_contents())
    assert "policy full" in stats and "linked 0 tok" in stats


def test_uploaded_markup_is_shown_as_text_never_run(page, server):
    page.set_input_files(
        "#upload-file",
        files=[
            {
                "name": "gate<i>notes<i>.txt",
                "mimeType": "text/plain",
                "buffer": b'<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script> '
                b"The gate code for the north gate is 4242.",
            }
        ],
    )
    page.click("#upload-btn")
    page.wait_for_function(
        "() => document.getElementById('upload-msg').textContent.includes('background')", timeout=30_000
    )
    page.wait_for_function(  # listed and indexed (searchable): the ingest thread may be refining the corpus
        "() => [...document.querySelectorAll('#doc-list li')].some(li => li.textContent.includes('gate<i>notes<')"
        " && !/queued|indexing/.test(li.querySelector('.doc-meta').textContent))",
        timeout=60_000,
    )
    assert page.locator("#doc-list i").count() == 0
    page.uncheck("#retrieval")
    page.check("#retrieval")
    bubble = _ask(page, "What is the gate code for the north gate?")
    pre = bubble.locator(".src-text").all_text_contents()
    assert any("<img src=x" in t for t in pre), pre  # shown literally
    assert page.locator("#messages img, #messages script").count() == 0
    assert page.evaluate("window.__pwned") is None
    # Delete it from the page (the confirm dialog is accepted).
    page.once("dialog", lambda d: d.accept())
    page.locator("#doc-list li", has_text="gate<i>notes").locator("button.del").click()
    page.wait_for_function(
        "() => ![...document.querySelectorAll('#doc-list .doc-name')].some(e => e.textContent.includes('gate<i>'))",
        timeout=30_000,
    )
    assert page.locator("#upload-msg").text_content().startswith("deleted gate<i>notes<i>.txt")


def test_screenshot(page, tmp_path):
    """The same question under legolink-16, then re-asked with full: the stats show the difference."""
    page.click("#clear")
    page.select_option("#policy", "legolink-16")
    bubble = _ask(page, "What is the secret passcode for the archive room?")
    bubble.locator(".source summary").first.click()
    bubble.locator(".reask button", has_text="full").click()
    page.locator(".bubble.assistant").nth(1).locator(".stats .stat").first.wait_for(timeout=120_000)
    page.wait_for_function(
        "() => document.getElementById('ingest-text').textContent.includes('chunks compiled')", timeout=30_000
    )
    page.evaluate("() => document.activeElement.blur()")
    out = Path(os.environ.get("DEMO_SCREENSHOT") or tmp_path / "demo.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(out))
    assert out.stat().st_size > 10_000
