"""Load: the soak harness (epic_rag/bench/soak.py) for ~20 s in a tiny configuration against the demo app on
SmolLM2 (the session's `smol_engine`, served in-process on loopback): every request is answered or refused
with a clear status, streams finish with [DONE], nothing is left in flight, and RSS after the 5 s warm-up grows
by at most RSS_BOUND_MIB beyond what chunk KV added to the memory tier explains (measured here: +33 MiB; a
leak of each request's prompt KV, ~26 MiB for 600 tokens on SmolLM2 fp32, would exceed it within 8 requests).
The full 5-minute, 16-client run is `python -m epic_rag.bench.soak soak` (results in docs/bench/soak.md); it does
not run in CI.
"""

from __future__ import annotations

import time

import psutil
import pytest

from epic_rag.bench import soak
from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DemoConfig
from epic_rag_demo.server import create_app

pytestmark = pytest.mark.smollm
RSS_BOUND_MIB = 192.0


@pytest.fixture(scope="module")
def server(smol_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("soak")
    docs = dict(list(soak.corpus_docs().items())[:3])
    corpus = root / "corpus"
    corpus.mkdir()
    for name, (text, _, _) in docs.items():
        (corpus / name).write_text(text)
    # the soak measures answering under load: no refine pass compiling between its requests
    cfg = DemoConfig(
        corpus=str(corpus),
        data_dir=root / "data",
        store="memory?max_bytes=1G",
        api_key=soak.KEY,
        top_k=2,
        refine_neighbours=0,
    )
    app = create_app(engine=smol_engine, config=cfg)
    srv = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(300), app.state.demo.library.status()
    srv.app, srv.docs = app, docs
    yield srv
    srv.stop()


async def test_soak_harness_short_run_every_request_answered_or_refused(server, tmp_path):
    questions = [(n, q, a) for n, (_, q, a) in server.docs.items()]
    rss = psutil.Process().memory_info
    load = await soak.run_load(
        server.url,
        soak.KEY,
        questions,
        duration_s=20,
        concurrency=4,
        max_tokens=12,
        rss=lambda: rss().rss,
        seed=3,
        probe=soak.store_probe(server.url, soak.KEY),
        probe_every_s=1.0,
    )
    s = soak.summarize(load, warmup_s=5)
    assert s["requests"] >= 8 and s["answered_ok"] >= 4, s
    assert s["errors"] == 0, s["error_examples"]
    assert set(s["outcomes"]) <= {"ok", "rejected", "cancelled"}
    assert all(r["status"] in (200, 400) for r in load["records"] if "status" in r)
    assert s["ttft_client_stream_s"]["n"] >= 1 and s["ttft_client_stream_s"]["p50"] > 0
    assert "memory_tier_mib" in s, load["probes"][:2]  # the tier's growth was measured, not assumed zero
    assert soak.memory_problem(s, RSS_BOUND_MIB) is None, s["rss_mib"]
    end = time.monotonic() + 30
    while server.app.state.demo.active_chats and time.monotonic() < end:
        time.sleep(0.1)
    assert server.app.state.demo.active_chats == 0
    data = {
        "command": "test",
        "server_cmd": ["epic-rag", "demo"],
        "machine": {},
        "summary": s,
        "config": {
            "concurrency": 4,
            "duration_s": 20,
            "max_tokens": 12,
            "warmup_s": 5,
            "max_rss_growth_mib": RSS_BOUND_MIB,
            "documents": 3,
            "chunks": 0,
            "ingest_s": 0.0,
            "kinds": dict(soak.KINDS),
            "policies": dict(soak.POLICIES),
        },
        "rss_timeline": load["rss"],
    }
    md = soak.soak_markdown(data)
    assert "| requests |" in md and "TTFT" in md and "within the bound" in md
