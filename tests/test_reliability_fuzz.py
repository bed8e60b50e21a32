"""Fuzzing: schemathesis (its `st run` command line, started through epic_rag/bench/soak.py with its steering
hook) against the demo server's OpenAPI schema (FastAPI's /openapi.json) on loopback, served here on the
tiny engine. The check is `not_a_server_error`: any 5xx or transport failure is a bug. A small run (20
examples per operation) keeps this under a minute; the recorded, larger runs on SmolLM2 are in
docs/bench/fuzz.md (`python -m epic_rag.bench.soak fuzz`).
"""

from __future__ import annotations

import json
import subprocess

import pytest
from test_demo_unit import HashEncoder

from epic_rag.bench.soak import fuzz_command, summarize_fuzz_report
from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DemoConfig
from epic_rag_demo.server import create_app

pytestmark = pytest.mark.slow  # starts schemathesis against the demo server

KEY = "fuzz-key"

pytest.importorskip("schemathesis")


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "fuzz.txt").write_text("Fuzz fixture: the Tarnby mill grinds barley on Tuesdays and oats on Fridays.")
    cfg = DemoConfig(
        corpus=str(corpus),
        data_dir=root / "data",
        store="memory",
        api_key=KEY,
        top_k=2,
        default_max_tokens=8,
        max_tokens_limit=16,
        max_upload_bytes=64 << 10,
        max_body_bytes=64 << 10,
    )
    app = create_app(engine=tiny_engine, config=cfg, encoder=HashEncoder())
    srv = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(60)
    srv.app, srv.corpus, srv.root = app, corpus, root
    yield srv
    srv.stop()


def test_schemathesis_finds_no_server_error(server, tmp_path):
    report = tmp_path / "report.json"
    cmd = fuzz_command(server.url, KEY, max_examples=20, seed=7, report=report)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    summary = summarize_fuzz_report(json.loads(report.read_text()))
    print(
        f"\nschemathesis: {summary['cases']} cases over {summary['operations']} operations, "
        f"{len(summary['failures'])} failures, {summary['running_time_s']} s"
    )
    assert summary["cases"] >= 100 and summary["operations"] >= 7, (summary, r.stdout[-3000:])
    assert summary["failures"] == [], (summary["failures"], r.stdout[-5000:])
    assert r.returncode == 0, r.stdout[-5000:]
    # Fuzzed uploads stay inside the corpus folder (and the server still answers afterwards).
    outside = [
        p
        for p in server.root.rglob("*")
        if p.is_file() and server.corpus not in p.parents and (server.root / "data") not in p.parents
    ]
    assert outside == []
    assert server.app.state.demo.active_chats == 0
