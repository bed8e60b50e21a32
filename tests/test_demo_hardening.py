"""Hardening of the demo server (issue 13), without a model: the scripted FakeEngine of test_demo_unit.
Each test names the attack or fault it tries and what the server must do instead of freezing, leaking,
or serving a drive-by request."""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import pytest
from test_demo_unit import FACTS, FakeEngine, HashEncoder

from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DemoConfig
from epic_rag_demo.server import create_app


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
    headers = {"Authorization": f"Bearer {cfg.api_key}".encode()} if cfg.api_key else {}
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


# ---------------------------------------------------------------------- 3. no drive-by access
EVIL = "https://evil.example"


def test_another_site_cannot_upload_delete_or_chat_without_a_key(tmp_path):
    with serve(tmp_path, allowed_origins=("https://app.example",)) as (server, client, app):
        corpus = tmp_path / "corpus"
        bad = {"Origin": EVIL}
        # multipart needs no CORS preflight: a page could fetch(..., {mode: "no-cors"}) this
        r = client.post("/api/documents", files={"file": ("planted.py", b"x = 1\n")}, headers=bad)
        assert r.status_code == 403 and not (corpus / "planted.py").exists()
        assert client.delete("/api/documents/bridge.txt", headers=bad).status_code == 403
        assert (corpus / "bridge.txt").exists()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=chat, headers=bad).status_code == 403
        assert client.post("/v1/chat/completions", json=chat, headers={"Origin": "null"}).status_code == 403
        assert (
            client.post("/v1/chat/completions", json=chat, headers={"Sec-Fetch-Site": "cross-site"}).status_code == 403
        )
        # the page itself, an allowed origin, and clients that send no Origin (curl, SDKs) are served
        assert client.post("/v1/chat/completions", json=chat, headers={"Origin": server.url}).status_code == 200
        assert (
            client.post("/v1/chat/completions", json=chat, headers={"Origin": "https://app.example"}).status_code == 200
        )
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
        assert client.get("/api/documents", headers=bad).status_code == 200  # reads are not state changes


def test_dns_rebinding_host_names_are_refused_without_a_key(tmp_path):
    with serve(tmp_path, allowed_hosts=("demo.lan",)) as (server, client, app):
        assert client.get("/api/documents", headers={"Host": "evil.example"}).status_code == 400
        assert client.get("/api/documents", headers={"Host": f"evil.example:{server.port}"}).status_code == 400
        for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}", "demo.lan:80"):
            assert client.get("/api/documents", headers={"Host": host}).status_code == 200, host


def test_with_a_key_any_host_name_is_served(tmp_path):
    with serve(tmp_path, api_key="k") as (server, client, app):
        assert client.get("/api/documents", headers={"Host": "demo.example.com"}).status_code == 200


def test_non_loopback_bind_without_a_key_refuses_to_start(tmp_path, monkeypatch):
    import argparse

    from epic_rag_demo.cli import register

    monkeypatch.delenv("EPIC_RAG_API_KEY", raising=False)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["demo", "--host", "0.0.0.0", "--data-dir", str(tmp_path), "--no-browser-needed"])
    assert args.func(args) == 2  # before the engine loads or a socket is bound

    from epic_rag_demo.access import check_bind

    check_bind("0.0.0.0", "key", False)
    check_bind("0.0.0.0", None, True)
    for local in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        check_bind(local, None, False)


def test_api_key_is_checked_before_the_body_is_read(tmp_path):
    import socket

    with serve(tmp_path, api_key="k") as (server, client, app):
        with socket.create_connection((server.host, server.port), timeout=5) as s:
            # declares 5 MB and sends none of it: a 401 now, not after waiting for (and parsing) the body
            s.sendall(
                b"POST /api/documents HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
                b"Content-Length: 5000000\r\n\r\n"
            )
            assert s.recv(64).startswith(b"HTTP/1.1 401")


def test_a_non_ascii_api_key_works_and_is_compared_in_constant_time(tmp_path, monkeypatch):
    import hmac

    from epic_rag_demo import access

    calls, real = [], hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", spy)
    key = "schlüssel-ключ"
    with serve(tmp_path, api_key=key) as (server, client, app):
        anon = httpx.Client(base_url=server.url, timeout=10)
        ok = anon.get("/api/documents", headers={"Authorization": b"Bearer " + key.encode("utf-8")})
        assert ok.status_code == 200
        assert anon.get("/api/documents", headers={"X-API-Key": key.encode("utf-8")}).status_code == 200
        assert anon.get("/api/documents", headers={"X-API-Key": b"schl"}).status_code == 401
        anon.close()
    assert calls and all(b == key.encode("utf-8") for _, b in calls)


# ---------------------------------------------------------------------- 6. errors never leak internals
SECRET_PATH = "/home/operator/models/secret-model/model.safetensors"


class BrokenEngine(FakeEngine):
    """Fails generation and compilation with messages full of internals."""

    def compile(self, texts, policy=None):
        raise RuntimeError(f"{SECRET_PATH}: cannot map the weights")

    async def astream_events(self, prepared):
        raise RuntimeError(f"CUDA error at {SECRET_PATH}")
        yield  # an async generator


def test_engine_failures_return_a_request_id_not_internals_and_status_shows_no_paths(tmp_path, caplog):
    with serve(tmp_path, engine=BrokenEngine()) as (server, client, app):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = client.post("/v1/chat/completions", json=body)
        msg = r.json()["error"]["message"]
        assert r.status_code == 500 and "request id chatcmpl-" in msg and "/home" not in msg and "CUDA" not in msg
        rid = msg.split("request id ")[1].split(";")[0]
        assert rid in caplog.text and SECRET_PATH in caplog.text  # the details are in the server log
        sse = client.post("/v1/chat/completions", json={**body, "stream": True}).text
        assert "request id chatcmpl-" in sse and "/home" not in sse and "CUDA" not in sse
        for path in ("/api/status", "/api/documents"):
            text = client.get(path).text
            assert "/home" not in text and str(tmp_path) not in text, text


def test_a_redis_password_in_the_store_spec_never_reaches_the_log(caplog):
    from epic_rag_demo.config import open_demo_store

    open_demo_store("memory+redis://:hunter2@127.0.0.1:1/0?timeout=0.1&bogus=1")
    assert "hunter2" not in caplog.text and ":***@" in caplog.text


# ---------------------------------------------------------------------- 4. admission control and bounds
def test_beyond_the_inflight_and_queue_bounds_chats_get_429_with_retry_after(tmp_path):
    import concurrent.futures

    with serve(tmp_path, engine=FakeEngine(delay=0.02), max_inflight=1, max_queued=1) as (server, client, app):
        body = {"messages": [{"role": "user", "content": "passcode?"}], "max_tokens": 40}  # ~0.8 s each
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            first = [pool.submit(client.post, "/v1/chat/completions", json=body) for _ in range(2)]
            time.sleep(0.3)  # one running, one queued
            over = client.post("/v1/chat/completions", json=body)
            assert over.status_code == 429 and over.headers["retry-after"] == "1", over.text
            assert [f.result().status_code for f in first] == [200, 200]  # the queued one ran after
        # streamed and refused requests give their slot back
        assert client.post("/v1/chat/completions", json={**body, "stream": True}).status_code == 200
        assert client.post("/v1/chat/completions", json={**body, "max_tokens": 10**6}).status_code == 400
        adm = app.state.demo.admission
        assert (adm.running, adm.waiting) == (0, 0)
        assert client.post("/v1/chat/completions", json=body).status_code == 200


@pytest.mark.parametrize(
    "stop, needle",
    [(["a"] * 5, "at most 4 stop sequences"), ("x" * 65, "at most 64 characters"), (["ok", "y" * 65], "64 characters")],
)
def test_stop_sequences_are_bounded_in_count_and_length(tmp_path, stop, needle):
    with serve(tmp_path) as (server, client, app):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "stop": stop})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_prometheus_policy_labels_come_from_a_fixed_set_not_the_clients_string(tmp_path):
    with serve(tmp_path) as (server, client, app):
        for k in (123457, 123458, 123459):
            body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 2, "policy": f"LegoLink-{k}"}
            assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert client.post("/v1/chat/completions", json={**body, "policy": "full"}).status_code == 200
        text = client.get("/metrics").text
        assert "12345" not in text
        assert 'policy="legolink"' in text and 'policy="full"' in text


def test_v1_completions_take_the_same_admission_slots_as_chats(tmp_path):
    import concurrent.futures

    with serve(tmp_path, engine=FakeEngine(delay=0.02), max_inflight=1, max_queued=1) as (server, client, app):
        body = {"messages": [{"role": "user", "content": "passcode?"}], "max_tokens": 40}  # ~0.8 s each
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = [pool.submit(client.post, "/v1/chat/completions", json=body) for _ in range(2)]
            time.sleep(0.3)  # one running, one queued
            over = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert over.status_code == 429 and over.headers["retry-after"] == "1", over.text
            assert [f.result().status_code for f in first] == [200, 200]
        assert client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True}).status_code == 200
        adm = app.state.demo.admission
        # a stream's slot is released by the server after its last write, which the client may see first
        deadline = time.monotonic() + 5
        while (adm.running, adm.waiting) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (adm.running, adm.waiting) == (0, 0)


# ---------------------------------------------------------------------- 4. disk budget, stalled and idle streams
def test_the_demos_default_disk_tier_has_a_byte_budget_and_evicts_least_recently_used(tmp_path):
    from test_store import make_kv

    from epic_rag.store import DiskStore, codec
    from epic_rag_demo.config import open_demo_store

    assert "disk:" in DemoConfig(data_dir=tmp_path).store_spec
    disk = next(t for t in open_demo_store(DemoConfig(data_dir=tmp_path).store_spec).tiers if isinstance(t, DiskStore))
    assert disk.max_bytes == 20 << 30  # the default budget
    one = len(codec.encode(make_kv()))
    store = open_demo_store(DemoConfig(data_dir=tmp_path / "small", disk_max_bytes=int(one * 3.2)).store_spec)
    disk = next(t for t in store.tiers if isinstance(t, DiskStore))
    for i in range(3):
        disk.put(make_kv(f"plain-{i}", seed=i))
        time.sleep(0.02)
    assert disk.get("plain-0") is not None  # now the most recently used
    time.sleep(0.02)
    disk.put(make_kv("plain-3", seed=3))
    assert sorted(disk.keys()) == ["plain-0", "plain-3"]
    assert sum(p.stat().st_size for p in disk.root.iterdir()) <= disk.max_bytes
    with pytest.raises(ValueError, match="disk_max_bytes"):
        DemoConfig(data_dir=tmp_path, disk_max_bytes=0)


class LoudEngine(FakeEngine):
    """Streams 64 KiB per token, so a client that stops reading fills the socket buffers at once."""

    async def astream_events(self, prepared):
        from epic_rag.types import Delta

        async with contextlib.aclosing(super().astream_events(prepared)) as events:
            async for ev in events:
                if isinstance(ev, Delta):
                    ev.text += "x" * 65536
                yield ev


def _wait_for(cond, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_client_that_stops_reading_a_stream_is_dropped_and_frees_its_slot_and_the_engine(tmp_path):
    import json
    import socket

    engine = LoudEngine(delay=0.02)  # still generating (~20 s) when the client is dropped
    with serve(tmp_path, engine=engine, stream_write_timeout_s=1.0) as (server, client, app):
        state = app.state.demo
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"messages": [{"role": "user", "content": "q"}], "max_tokens": 1000, "stream": True}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        try:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert b"200 OK" in s.recv(512)  # then the client stops reading, connection open
            assert _wait_for(lambda: engine.active == 1 and state.active_chats == 1, 10)
            # before: the write waited for ever, holding the slot, the engine request and the busy flag
            assert _wait_for(lambda: state.admission.running == 0, 10), "slot still held by a stalled reader"
            assert _wait_for(lambda: engine.active == 0 and state.active_chats == 0, 5)
            assert engine.aborted == 1 and not state.library.busy()
            assert 'epic_rag_errors_total{kind="stalled_reader"} 1.0' in client.get("/metrics").text
        finally:
            s.close()
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "q"}], "max_tokens": 3})
        assert r.status_code == 200


def test_an_engine_that_says_nothing_gets_keepalives_then_the_stream_ends_with_an_error(tmp_path):
    engine = FakeEngine(delay=60)  # the first token would take a minute
    with serve(tmp_path, engine=engine, stream_keepalive_s=0.2, stream_idle_s=1.0) as (server, client, app):
        body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "stream": True}
        t0 = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
        assert time.monotonic() - t0 < 10
        assert lines.count(": keep-alive") >= 3, lines
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "no output from the engine for 1 s" in err["message"] and err["code"] == 504
        state = app.state.demo
        assert _wait_for(lambda: engine.active == 0 and state.admission.running == 0, 5)
        assert engine.aborted == 1 and state.active_chats == 0


# ---------------------------------------------------------------------- 9. tests that can fail
def test_the_soak_memory_check_fails_on_growth_the_memory_tier_does_not_explain():
    from epic_rag.bench import soak

    mib = 1 << 20

    def load(rss_growth_mib: float, tier_growth_mib: float) -> dict:
        rss = [(t, int((1000 + (rss_growth_mib if t >= 10 else 0) * t / 20) * mib)) for t in range(21)]
        probes = [(t, {'epic_rag_store_bytes{tier="memory"}': (t >= 10) * tier_growth_mib * mib}) for t in (0, 5, 20)]
        return {"records": [], "rss": rss, "probes": probes, "wall_s": 20.0}

    leak = soak.summarize(load(300, 0), warmup_s=5)
    assert "bound 192 MiB" in soak.memory_problem(leak, 192)
    explained = soak.summarize(load(300, 250), warmup_s=5)  # chunk KV the tier took on, within its budget
    assert soak.memory_problem(explained, 192) is None
    assert "not checked" in soak.memory_problem({}, 192)


def test_a_stream_the_engine_has_finished_no_longer_pauses_background_compilation(tmp_path):
    import socket

    engine = LoudEngine(delay=0)
    with serve(tmp_path, engine=engine) as (server, client, app):  # default 30 s write timeout
        state = app.state.demo
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps({"messages": [{"role": "user", "content": "q"}], "max_tokens": 200, "stream": True}).encode()
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((host, int(port)))
        try:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            assert b"200 OK" in s.recv(512)  # then the client stops reading
            assert _wait_for(lambda: engine.requests and engine.active == 0, 10)  # the engine's part is done
            time.sleep(0.3)
            # before: active_chats stayed 1 (library.busy) until the client had read the last byte
            assert state.admission.running == 1 and state.active_chats == 0 and not state.library.busy()
        finally:
            s.close()
        assert _wait_for(lambda: state.admission.running == 0, 10)


# ---------------------------------------------------------------------- 5. issue 26: the demo's rest
def test_a_dead_engine_core_makes_healthz_503_with_its_reason(tmp_path):
    """vLLM's core process died (--multiprocess): add_request raises EngineDeadError. Before, the runtime took
    it for that request's own fault and /healthz stayed 200 while every chat failed. (A real core killed:
    tests/test_engine_multiprocess.py.)"""
    from test_runtime_faults import ScriptedLLM
    from vllm.v1.engine.exceptions import EngineDeadError

    from epic_rag.engine.runtime import Runtime

    class DeadCoreLLM(ScriptedLLM):
        def add_request(self, rid, prompt, params):
            raise EngineDeadError()

    engine = FakeEngine()
    engine.runtime = Runtime(DeadCoreLLM())
    engine.runtime.start()
    with serve(tmp_path, engine=engine) as (server, client, app):
        assert client.get("/healthz").status_code == 200
        got = []
        engine.runtime.submit("x", None, None, got.append)
        engine.runtime._thread.join(5)
        assert isinstance(got[0], EngineDeadError)  # the request that found the core dead is told
        r = client.get("/healthz")
        assert r.status_code == 503 and r.json()["status"] == "failed", r.text
        assert "EngineDeadError" in r.json()["reason"]


def test_prometheus_method_labels_come_from_a_fixed_set_not_the_clients_method(tmp_path):
    # Before: 300 unauthenticated requests with invented methods minted 300 series (labels up to 4 KB). Over
    # the socket, uvicorn's httptools parser passes only the methods it knows (WebDAV's among them); h11 passes
    # any token, as the ASGI app is driven here.
    from starlette.testclient import TestClient

    with serve(tmp_path, api_key="k") as (server, client, app):
        for method in ("PROPFIND", "MKCOL", "PURGE"):
            assert client.request(method, "/api/status").status_code in (401, 405)
        asgi = TestClient(app)
        for i in range(300):
            assert asgi.request(f"X{i:03d}" + "M" * 40, "/api/status").status_code in (401, 405)
        text = client.get("/metrics").text
        methods = {line.split('method="')[1].split('"')[0] for line in text.splitlines() if 'method="' in line}
        assert methods <= {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "other"}, methods
        assert "other" in methods and "X000" not in text


def _part_head(name: str) -> bytes:
    """The opening of a multipart body's one file part, up to its content."""
    return (
        b'--b0undary\r\nContent-Disposition: form-data; name="file"; filename="'
        + name.encode()
        + b'"\r\nContent-Type: text/plain\r\n\r\n'
    )


def _multipart(name: str, data: bytes, hold: threading.Event | None = None):
    """A multipart upload body, as a generator that (with `hold`) stops after its first part until set."""
    head = _part_head(name)

    def body():
        yield head
        if hold is not None:
            hold.wait(30)
        yield data + b"\r\n--b0undary--\r\n"

    return {"content": body(), "headers": {"content-type": "multipart/form-data; boundary=b0undary"}}


def _headers_only_upload(url: str, authorization: str | None) -> tuple[int, bytes]:
    """POST an upload announcing 10 kB, send only the headers and the multipart head, and read the answer while
    the rest is withheld (a client would block sending it: httpx sends a whole body before reading).
    # -> (status, the response's head)"""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(url)
    auth = f"Authorization: {authorization}\r\n" if authorization else ""
    request = (
        f"POST /api/documents HTTP/1.1\r\nHost: {u.netloc}\r\n{auth}Content-Length: 10000\r\n"
        "Content-Type: multipart/form-data; boundary=b0undary\r\n\r\n"
    ).encode() + _part_head("over.txt")
    with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            data = sock.recv(4096)  # times out (the test fails) if the server waits for the body
            if not data:
                break
            answer += data
    return int(answer.split(b" ", 2)[1]), answer.split(b"\r\n\r\n", 1)[0]


def test_uploads_beyond_the_admission_bound_get_429_before_their_body_is_read(tmp_path):
    import concurrent.futures

    with serve(tmp_path, max_upload_inflight=1, max_upload_queued=1) as (server, client, app):
        hold = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = [
                pool.submit(client.post, "/api/documents", **_multipart(f"slow{i}.txt", b"slow words " * 20, hold))
                for i in range(2)
            ]
            deadline = time.monotonic() + 5
            while app.state.demo.uploads < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            # a third upload sends its headers and first part, then waits: the 429 must come without the rest
            status, head = _headers_only_upload(server.url, client.headers.get("authorization"))
            assert status == 429 and b"retry-after:" in head.lower(), head
            hold.set()
            assert [f.result().status_code for f in slow] == [202, 202]
        assert app.state.demo.uploads == 0
        ok = client.post("/api/documents", files={"file": ("after.txt", b"after the burst " * 20)})
        assert ok.status_code == 202, ok.text


def test_uploads_past_their_quotas_are_refused_and_nothing_is_written(tmp_path):
    with serve(tmp_path, max_documents=2, max_upload_total_bytes=3000) as (server, client, app):
        folder = app.state.demo.cfg.uploads_dir
        before = sorted(p.name for p in folder.iterdir())
        for name in ("one.txt", "two.txt"):
            assert client.post("/api/documents", files={"file": (name, b"words " * 100)}).status_code == 202
        r = client.post("/api/documents", files={"file": ("three.txt", b"words " * 10)})
        assert r.status_code == 507 and "2 documents" in r.json()["error"]["message"], r.text
        # replacing a document counts once; growing past the byte quota is refused
        assert client.post("/api/documents", files={"file": ("two.txt", b"other " * 100)}).status_code == 202
        r = client.post("/api/documents", files={"file": ("two.txt", b"x" * 2500)})
        assert r.status_code == 507 and "3000 bytes" in r.json()["error"]["message"], r.text
        assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == sorted(
            [*before, "one.txt", "two.txt"]
        )
        assert client.delete("/api/documents/one.txt").status_code == 200  # deleting frees the quota
        assert client.post("/api/documents", files={"file": ("three.txt", b"words " * 10)}).status_code == 202


def test_an_upload_name_too_long_in_bytes_is_a_clear_400_not_a_500(tmp_path):
    # 130 accented letters + ".txt": 134 characters, 264 bytes. Before: OSError "File name too long" -> 500.
    with serve(tmp_path) as (server, client, app):
        r = client.post("/api/documents", files={"file": ("é" * 130 + ".txt", b"some words")})
        assert r.status_code == 400 and "255 bytes" in r.json()["error"]["message"], r.text
        ok = client.post("/api/documents", files={"file": ("é" * 125 + ".txt", b"some words")})  # 254 bytes
        assert ok.status_code == 202, ok.text


def test_the_demos_data_folders_and_embedding_cache_are_owner_only_and_the_cache_is_bounded(tmp_path):
    import os

    from epic_rag_demo.library import Library

    cfg = DemoConfig(corpus="builtin:pydoc:json", data_dir=tmp_path / "data", max_embedding_cache_bytes=4096)
    os.umask(0o022)
    lib = Library(cfg, HashEncoder())
    lib._embed([f"text number {i}" for i in range(20)], progress=True)
    emb = cfg.data_dir / "embeddings"
    assert (cfg.data_dir.stat().st_mode & 0o777, emb.stat().st_mode & 0o777) == (0o700, 0o700)
    files = list(emb.glob("*.npy"))
    assert files and all(p.stat().st_mode & 0o777 == 0o600 for p in files)
    assert 0 < sum(p.stat().st_size for p in files) <= 4096 + 1024  # stops at its budget (one file past it)
    assert len(lib._embed([f"text number {i}" for i in range(20)], progress=True)) == 20  # still answers


def test_secrets_in_a_store_spec_never_reach_a_log_or_an_error(caplog):
    import logging

    from epic_rag.engine.connector.worker import _internal_error
    from epic_rag.store import open_store
    from epic_rag_demo.config import open_demo_store

    spec = "memory+disk:/tmp/x?secret=KVSECRET-1&bogus=1+redis://:hunter2@127.0.0.1:1/0?secret=KVSECRET-2"
    with caplog.at_level(logging.DEBUG):
        open_demo_store(spec)
        with pytest.raises(ValueError) as e:
            open_store(spec)
        said = _internal_error("this server cannot link or compile", e.value)
    for text in (caplog.text, str(e.value), said):
        assert "KVSECRET" not in text and "hunter2" not in text, text
    assert "secret=***" in caplog.text and "bogus" in caplog.text  # the reason is still there


# ------------------------------------------------- 7. a corpus folder the uploads share (security review 3, E)
def _docs(client) -> dict[str, str]:
    return {d["name"]: d["source"] for d in client.get("/api/documents").json()["documents"]}


def test_in_corpus_mode_the_upload_quota_survives_a_restart(tmp_path):
    with serve(tmp_path, max_documents=2) as (server, client, app):
        for name in ("one.txt", "two.txt"):
            assert client.post("/api/documents", files={"file": (name, b"words " * 10)}).status_code == 202
    # before: after a restart the two uploads counted as the user's corpus files and the quota began again
    with serve(tmp_path, max_documents=2) as (server, client, app):
        assert _docs(client)["one.txt"] == "upload" and _docs(client)["bridge.txt"] == "corpus"
        r = client.post("/api/documents", files={"file": ("three.txt", b"words " * 10)})
        assert r.status_code == 507 and "2 documents" in r.json()["error"]["message"], r.text
        assert not (app.state.demo.cfg.uploads_dir / "three.txt").exists()
        assert client.delete("/api/documents/one.txt").status_code == 200  # deleting still frees the quota
    with serve(tmp_path, max_documents=2) as (server, client, app):
        assert "one.txt" not in _docs(client)
        assert client.post("/api/documents", files={"file": ("three.txt", b"words " * 10)}).status_code == 202
        manifest = [p for p in app.state.demo.cfg.data_dir.iterdir() if p.name.startswith("uploads-")]
        assert len(manifest) == 1 and manifest[0].stat().st_mode & 0o077 == 0  # one, owner-only, no temp left
        assert json.loads(manifest[0].read_text())["uploads"].keys() == {"two.txt", "three.txt"}


def test_an_upload_never_overwrites_a_corpus_file_of_the_same_name(tmp_path):
    with serve(tmp_path) as (server, client, app):
        corpus = app.state.demo.cfg.uploads_dir
        r = client.post("/api/documents", files={"file": ("bridge.txt", b"The bridge is closed forever.")})
        assert r.status_code == 409 and "never replace" in r.json()["error"]["message"], r.text
        assert (corpus / "bridge.txt").read_text() == FACTS["bridge.txt"]  # the user's file, as it was
        assert _docs(client)["bridge.txt"] == "corpus"
        assert not [p for p in corpus.iterdir() if p.name.startswith(".")]  # no temp file left behind
        # an earlier upload of a name is still replaced by the next one
        assert client.post("/api/documents", files={"file": ("new.txt", b"first words")}).status_code == 202
        assert client.post("/api/documents", files={"file": ("new.txt", b"second words")}).status_code == 202
        assert (corpus / "new.txt").read_bytes() == b"second words"
    with serve(tmp_path) as (server, client, app):  # after a restart too: the manifest says it is an upload
        assert client.post("/api/documents", files={"file": ("new.txt", b"third words")}).status_code == 202
        r = client.post("/api/documents", files={"file": ("archive.md", b"# gone")})
        assert r.status_code == 409, r.text


@pytest.mark.parametrize(
    "name",
    [
        "invoice\u202etxt.exe.md",  # RIGHT-TO-LEFT OVERRIDE: shows as "invoicedm.exe.txt"
        "a\u2066b\u2069.txt",  # isolates
        "\u200fnotes.txt",  # RIGHT-TO-LEFT MARK
        "a\u061cb.txt",  # ARABIC LETTER MARK
        "a\u0085b.txt",  # C1 NEXT LINE
        "a\u009bb.txt",  # C1 CONTROL SEQUENCE INTRODUCER (terminal escapes)
        "a\u2028b.txt",  # LINE SEPARATOR
    ],
)
def test_upload_names_with_c1_control_or_bidi_characters_are_refused_and_nothing_is_written(tmp_path, name):
    with serve(tmp_path) as (server, client, app):
        folder = app.state.demo.cfg.uploads_dir
        before = sorted(p.name for p in folder.iterdir())
        r = client.post("/api/documents", files={"file": (name, b"some words")})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
        assert sorted(p.name for p in folder.iterdir()) == before


def test_an_upload_name_with_a_zero_width_non_joiner_is_an_ordinary_persian_name_and_kept(tmp_path):
    with serve(tmp_path) as (server, client, app):
        name = "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645.txt"  # "I want", with its ZWNJ
        r = client.post("/api/documents", files={"file": (name, b"x y")})
        assert r.status_code == 202, r.text
