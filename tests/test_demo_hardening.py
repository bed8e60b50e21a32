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


# ---------------------------------------------------------------------- 2. readiness
def test_healthz_is_503_with_the_reason_while_the_engine_loads(tmp_path):
    cfg = DemoConfig(corpus="builtin:pydoc:json", data_dir=tmp_path / "data", store="memory")
    app = create_app(engine=None, config=cfg, encoder=HashEncoder())
    server = BackgroundServer(app).start()
    try:
        r = httpx.get(server.url + "/healthz")
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["status"] == "loading" and "loading" in r.json()["reason"]
    finally:
        server.stop()


def test_healthz_and_chat_are_503_once_the_engine_thread_has_died(tmp_path):
    from test_runtime_faults import ScriptedLLM

    from epic_rag.engine.runtime import Runtime

    engine = FakeEngine()
    llm = ScriptedLLM()
    engine.runtime = Runtime(llm)
    engine.runtime.start()
    with serve(tmp_path, engine=engine) as (server, client, app):
        assert client.get("/healthz").status_code == 200
        llm.fail = RuntimeError("device lost")
        engine.runtime.submit("x", None, None, lambda d: None)  # the next step raises: the thread dies
        engine.runtime._thread.join(5)
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "failed", r.text
        assert "fatal error" in r.json()["reason"] and "device lost" not in r.text
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503
