"""Hardening of the demo server (issue 13), without a model: the scripted FakeEngine of test_demo_unit.
Each test names the attack or fault it tries and what the server must do instead of freezing, leaking,
or serving a drive-by request."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
from test_demo_unit import FACTS, FakeEngine, HashEncoder

from apps.demo.config import DemoConfig
from apps.demo.server import BackgroundServer, create_app


@contextlib.contextmanager
def serve(tmp_path, engine=None, **cfg_kw):
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for name, text in FACTS.items():
        (corpus / name).write_text(text)
    cfg = DemoConfig(corpus=str(corpus), data_dir=tmp_path / "data", store="memory", **cfg_kw)
    app = create_app(
        engine=engine if engine is not None else FakeEngine(delay=0.002), config=cfg, encoder=HashEncoder()
    )
    server = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(30)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    client = httpx.Client(base_url=server.url, headers=headers, timeout=60)
    try:
        yield server, client, app
    finally:
        client.close()
        server.stop()


# ---------------------------------------------------------------------- 1. parsing cannot freeze the server
def test_healthz_answers_within_a_second_while_the_worst_uploads_are_parsed(tmp_path):
    limit = 10 << 20  # the default upload limit
    with serve(tmp_path, parse_cpu_s=2, max_upload_bytes=limit) as (server, client, app):
        worst = [
            ("spaces.txt", b"a" + b" " * (limit - 2) + b"b", 202),  # hours of the old quadratic regex
            ("tags.html", b"<a" * (limit // 2), 400),  # quadratic in html.parser: stopped by the CPU limit
            ("assert.html", b"<![" * (limit // 3), 400),  # AssertionError inside html.parser
        ]
        slowest, stop = [0.0], threading.Event()

        def probe():
            with httpx.Client(base_url=server.url, timeout=5) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    c.get("/healthz")
                    slowest[0] = max(slowest[0], time.perf_counter() - t0)
                    time.sleep(0.05)

        t = threading.Thread(target=probe, daemon=True)
        t.start()
        try:
            for name, data, status in worst:
                r = client.post("/api/documents", files={"file": (name, data)})
                assert r.status_code == status, (name, r.text[:300])
        finally:
            stop.set()
            t.join(10)
        assert slowest[0] < 1.0, f"/healthz took {slowest[0]:.2f} s while uploads were parsed"
        assert app.state.demo.library.wait_ready(60)
