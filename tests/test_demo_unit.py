"""Demo server without a model: a scripted fake engine and a bag-of-words encoder stand in, so the HTTP
contract (validation, limits, auth, uploads, SSE framing, cancellation, metrics) is checked in seconds."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from epic_rag import EngineConfig
from epic_rag.engine import guard
from epic_rag.store import MemoryStore
from epic_rag.types import ChunkRef, Delta, Generation, RagRequest
from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DemoConfig, open_demo_store
from epic_rag_demo.library import safe_upload_name
from epic_rag_demo.server import create_app

FACTS = {
    "bridge.txt": "The Larkspur Bridge opened in 1931. It crosses the Vell River and is 412 metres long.",
    "archive.md": "# Archive\n\nThe secret passcode for the archive room is 7314. "
    "Only the head librarian may share it.",
}


class WordTokenizer:
    """Whitespace tokens with a growing vocabulary (enough for chunking and budgets)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: list[str] = []
        self.lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        with self.lock:
            for w in re.findall(r"\S+", text):
                if w not in self.vocab:
                    self.vocab[w] = len(self.words)
                    self.words.append(w)
                out.append(self.vocab[w])
        return out

    def decode(self, ids) -> str:
        return " ".join(self.words[i] for i in ids)

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True) -> str:
        return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


class HashEncoder:
    """Bag-of-words embeddings, L2-normalised (stands in for MiniLM)."""

    def encode(self, texts, normalize_embeddings=True, batch_size=32, show_progress_bar=False):
        out = np.zeros((len(texts), 384), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"[a-z0-9]+", t.lower()):
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % 384] += 1.0
            out[i] /= max(np.linalg.norm(out[i]), 1e-6)
        return out


class FakeEngine:
    """The slice of EpicEngine the demo uses. Streams the words 'answer 0 .. n-1', one per `delay`."""

    def __init__(self, delay: float = 0.0) -> None:
        self.config = EngineConfig(model="smollm2-135m-instruct")
        self.tokenizer = WordTokenizer()
        self.store = MemoryStore()
        self.chunks = SimpleNamespace(glue=MemoryStore())  # the engine's leading-glue cache (metrics read it)
        self.max_model_len = 8192
        self.delay = delay
        self.compiled: list[str] = []
        self.requests: list[dict] = []
        self.active = 0
        self.aborted = 0

    def compile(self, texts, policy=None):
        self.compiled += list(texts)
        return [
            ChunkRef("plain-" + hashlib.sha256(t.encode()).hexdigest()[:40], len(self.tokenizer.encode(t)), t)
            for t in texts
        ]

    def render_messages(self, messages):
        return [self.tokenizer.apply_chat_template(messages)]

    def prepare(self, request, max_tokens=64, temperature=0.0, policy=None, stop=None, **options):
        return {"request": request, "max_tokens": max_tokens, "policy": policy, "stop": stop, "options": options}

    async def astream_events(self, prepared):
        request, max_tokens, policy = prepared["request"], prepared["max_tokens"], prepared["policy"]
        if isinstance(request, RagRequest) and "FAIL" in request.question:  # an error while generating
            raise ValueError("prompt of 99999 tokens does not fit the context window")
        self.requests.append(prepared)
        self.active += 1
        t0 = time.perf_counter()
        ids, t_first = [], None
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.delay)
                t_first = t_first or time.perf_counter()
                ids.append(i)
                yield Delta(
                    text=("" if i == 0 else " ") + f"w{i}",
                    token_ids=[i],
                    finished=i == max_tokens - 1,
                    finish_reason="length" if i == max_tokens - 1 else None,
                    t=time.perf_counter(),
                )
        except BaseException:
            self.aborted += 1
            raise
        finally:
            self.active -= 1
        n_chunks = len(request.chunks) if isinstance(request, RagRequest) else 0
        escalated = None
        if policy == "auto" and isinstance(request, RagRequest):  # auto's own guard over the retrieved texts
            texts = [(c.text or "") if isinstance(c, ChunkRef) else c for c in request.chunks]
            escalated = guard.check(request.question, texts).reason
        yield Generation(
            text=" ".join(f"w{i}" for i in ids),
            token_ids=ids,
            ttft_s=(t_first or t0) - t0,
            total_s=time.perf_counter() - t0,
            prompt_tokens=100,
            linked_tokens=80,
            recomputed_tokens=20,
            chunk_hits=n_chunks,
            chunk_misses=0,
            policy="prefix" if escalated else policy or "legolink-16",
            finish_reason="length",
            escalated=escalated,
        )


@pytest.fixture()
def demo(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, text in FACTS.items():
        (corpus / name).write_text(text)
    (corpus / "bad.txt").write_bytes(b"\xff\xfe not utf-8")
    engine = FakeEngine(delay=0.002)
    cfg = DemoConfig(
        corpus=str(corpus),
        data_dir=tmp_path / "data",
        store="memory",
        api_key="sekret",
        max_upload_bytes=4096,
        max_body_bytes=64 << 10,
        max_tokens_limit=256,
        max_prompt_chars=2000,
    )
    app = create_app(engine=engine, config=cfg, encoder=HashEncoder())
    server = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(30)
    client = httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sekret"}, timeout=30)
    yield server, client, engine, app, corpus
    client.close()
    server.stop()


def _chat(client, **kw):
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": "What is the passcode?"}],
        "max_tokens": 4,
    }
    body.update(kw)
    return client.post("/v1/chat/completions", json=body)


def test_upload_names_that_could_escape_the_folder_are_refused():
    assert safe_upload_name("notes.txt") == "notes.txt"
    assert safe_upload_name("sub/dir/notes.md") == "notes.md"
    assert safe_upload_name("C_notes.pdf") == "C_notes.pdf"
    for bad in [
        "../x.txt",
        "a/../../x.txt",
        "/etc/passwd.txt",
        "\\\\server\\x.txt",
        "C:\\x.txt",
        "x\x00.txt",
        "",
        "   ",
        ".hidden.txt",
        "x.exe",
        "noext",
        "a\nb.txt",
        "..",
        "x" * 300 + ".txt",
    ]:
        with pytest.raises(ValueError):
            safe_upload_name(bad)


def test_store_spec_the_store_layer_rejects_falls_back_to_memory(caplog):
    with caplog.at_level("WARNING"):
        store = open_demo_store("nosuchtier:/x")
    assert isinstance(store, MemoryStore)
    assert "not available" in caplog.text


def test_default_config_is_local_and_uses_a_disk_store_under_the_data_dir(tmp_path):
    cfg = DemoConfig(data_dir=tmp_path)
    assert cfg.store_spec.endswith(f"+disk:{tmp_path / 'kv'}?max_bytes={20 << 30}")  # with a byte budget
    store = open_demo_store(cfg.store_spec)
    assert list(store.tier_stats()) == ["memory", "disk"]  # a restart finds compiled chunks on disk
    assert cfg.corpus == "builtin:pydoc" and cfg.uploads_dir == tmp_path / "uploads"
    with pytest.raises(ValueError):
        DemoConfig(policy="bogus")


def test_corpus_is_chunked_indexed_and_compiled_in_the_background(demo):
    server, client, engine, app, _ = demo
    assert client.get("/healthz").json()["status"] == "ok"
    docs = {d["name"]: d for d in client.get("/api/documents").json()["documents"]}
    assert set(docs) == {"bridge.txt", "archive.md"}  # bad.txt (not UTF-8) skipped
    assert all(d["state"] == "ready" and d["compiled"] == d["chunks"] >= 1 for d in docs.values())
    st = client.get("/api/status").json()
    assert st["state"] == "ready" and st["compiled"] == st["chunks"] and any("UTF-8" in e for e in st["errors"])
    hits = app.state.demo.library.search("secret passcode archive", 1)
    assert hits[0][0].doc == "archive.md"


def test_chat_completion_non_stream_carries_usage_sources_and_epic_stats(demo):
    _, client, engine, _, _ = demo
    r = _chat(client, policy="naive", top_k=1)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "chat.completion" and j["choices"][0]["message"]["role"] == "assistant"
    assert j["choices"][0]["message"]["content"] == "w0 w1 w2 w3"
    assert j["choices"][0]["finish_reason"] == "length"
    assert j["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 4,
        "total_tokens": 104,
        "prompt_tokens_details": {"cached_tokens": 80},  # the linked tokens
    }
    e = j["epic"]
    assert e["policy"] == "naive" and e["linked_tokens"] == 80 and e["recomputed_tokens"] == 20
    assert [s["doc"] for s in e["sources"]] == ["archive.md"] and e["sources"][0]["compiled"]
    req = engine.requests[-1]["request"]
    assert isinstance(req, RagRequest) and isinstance(req.chunks[0], ChunkRef)  # compiled refs are linked


def test_stream_framing_role_first_finish_last_then_done(demo):
    _, client, _, _, _ = demo
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "How long is the bridge?"}],
            "stream": True,
            "max_tokens": 3,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["epic"]["sources"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "w0 w1 w2"
    fin = chunks[-2]
    assert fin["choices"][0]["finish_reason"] == "length" and fin["epic"]["ttft_s"] >= 0
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 80}


def test_extra_fields_chunk_ids_and_no_retrieval(demo):
    _, client, engine, _, _ = demo
    r = _chat(client, chunk_ids=["bridge.txt#0"])
    assert r.status_code == 200 and [s["id"] for s in r.json()["epic"]["sources"]] == ["bridge.txt#0"]
    r = _chat(
        client,
        use_retrieval=False,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
        ],
    )
    assert r.status_code == 200 and r.json()["epic"]["sources"] == []
    prompt = engine.requests[-1]["request"]
    assert prompt == ["<system>Be brief.\n<user>hi\n<assistant>hello\n<user>bye\n<assistant>"]
    r = _chat(client, chunk_ids=["nope.txt#9"])
    assert r.status_code == 400 and "nope.txt#9" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"[1, 2]", 400, ""),
        (json.dumps({"messages": "hi"}).encode(), 400, "messages"),
        (json.dumps({"messages": []}).encode(), 400, "messages"),
        (json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400, "content"),
        (json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "role"),
        (json.dumps({"messages": [{"role": "user", "content": "  "}]}).encode(), 400, "non-empty user message"),
        (json.dumps({"messages": [{"role": "assistant", "content": "x"}]}).encode(), 400, "user message"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -3}).encode(), 400, "max_tokens"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}).encode(),
            400,
            "at most 256",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}).encode(), 400, "stream"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}], "policy": "warp-9"}).encode(),
            400,
            "unknown policy",
        ),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_k": 999}).encode(), 400, "top_k"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 9}).encode(), 400, "temperature"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * 2001}]}).encode(), 400, "prompt too long"),
        (json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}).encode(), 404, "gpt-9"),
        (json.dumps({"messages": [{"role": "user", "content": "x" * (70 << 10)}]}).encode(), 413, "limit"),
    ],
)
def test_malformed_chat_requests_get_4xx_with_a_message_and_serving_goes_on(demo, body, status, needle):
    _, client, _, _, _ = demo
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    assert needle in msg and msg
    assert _chat(client).status_code == 200


def test_engine_value_error_is_a_400_and_an_sse_error_event(demo):
    _, client, _, _, _ = demo
    r = _chat(client, messages=[{"role": "user", "content": "FAIL please"}])
    assert r.status_code == 400 and "context window" in r.json()["error"]["message"]
    with client.stream(
        "POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "FAIL please"}], "stream": True}
    ) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert "context window" in json.loads(lines[-2][6:])["error"]["message"] and lines[-1] == "data: [DONE]"
    assert _chat(client).status_code == 200


def test_api_key_guards_every_working_route_but_not_healthz(demo):
    server, client, _, _, _ = demo
    anon = httpx.Client(base_url=server.url, timeout=10)
    assert anon.get("/healthz").status_code == 200
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/api/documents"),
        ("GET", "/api/status"),
        ("POST", "/v1/chat/completions"),
        ("DELETE", "/api/documents/x.txt"),
    ]:
        r = anon.request(method, path, json={})
        assert r.status_code == 401, (path, r.status_code)
        assert "API key" in r.json()["error"]["message"]
    assert anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert anon.get("/v1/models", headers={"X-API-Key": "sekret"}).status_code == 200
    assert client.get("/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"
    page = anon.get("/")
    assert page.status_code == 200 and "script-src 'self'" in page.headers["content-security-policy"]


def test_upload_list_and_delete_documents(demo):
    _, client, engine, app, corpus = demo
    r = client.post(
        "/api/documents", files={"file": ("tovin.txt", b"Tovin is a small town. Its market is on Thursday.")}
    )
    assert r.status_code == 202, r.text
    assert app.state.demo.library.wait_ready(30)
    assert (corpus / "tovin.txt").exists()
    docs = {d["name"]: d for d in client.get("/api/documents").json()["documents"]}
    assert docs["tovin.txt"]["state"] == "ready" and docs["tovin.txt"]["source"] == "upload"
    j = _chat(client, messages=[{"role": "user", "content": "Which day is the Tovin market?"}], top_k=1).json()
    assert j["epic"]["sources"][0]["doc"] == "tovin.txt"
    assert client.delete("/api/documents/tovin.txt").status_code == 200
    assert not (corpus / "tovin.txt").exists()
    assert "tovin.txt" not in {d["name"] for d in client.get("/api/documents").json()["documents"]}
    j = _chat(client, messages=[{"role": "user", "content": "Which day is the Tovin market?"}], top_k=3).json()
    assert all(s["doc"] != "tovin.txt" for s in j["epic"]["sources"])
    assert client.delete("/api/documents/tovin.txt").status_code == 404


def test_an_escalated_auto_request_reports_why_in_its_figures_and_metrics(demo):
    _, client, _, app, _ = demo
    for name, text in (
        ("gland.txt", "Part HT-8957-B (cable gland) costs $923.88."),
        ("bolt.txt", "Part HT-8975-B (hex bolt) costs $547.37."),
    ):
        assert client.post("/api/documents", files={"file": (name, text.encode())}).status_code == 202
    assert app.state.demo.library.wait_ready(30)
    ask = [{"role": "user", "content": "What does part HT-8957-B cost?"}]
    e = _chat(client, messages=ask, top_k=4, policy="auto").json()["epic"]
    assert {"gland.txt", "bolt.txt"} <= {s["doc"] for s in e["sources"]}
    assert e["escalated"] == "lookalike-keys" and e["policy"] == "prefix" and e["policy_asked"] == "auto"
    assert "escalated" not in _chat(client, top_k=1, policy="auto").json()["epic"]  # linked: nothing to say
    assert 'epic_rag_escalated_requests_total{reason="lookalike-keys"} 1.0' in client.get("/metrics").text


@pytest.mark.parametrize(
    "name,data,status,needle",
    [
        ("../../evil.txt", b"hello", 400, ".."),
        ("/etc/cron.d/evil.txt", b"hello", 400, "absolute"),
        ("ev\x00il.txt", b"hello", 400, "NUL"),
        ("bad.txt", b"\xff\xfe\xfa broken", 400, "UTF-8"),
        ("nul.txt", b"abc\x00def", 400, "NUL"),
        ("empty.txt", b"   ", 400, "no text"),
        ("tool.exe", b"MZ", 400, "unsupported"),
        ("big.txt", b"x" * 5000, 413, "limit"),
        ("huge.txt", b"x" * (200 << 10), 413, "limit"),
    ],
)
def test_bad_uploads_are_refused_and_nothing_escapes_the_folder(demo, tmp_path, name, data, status, needle):
    _, client, _, _, corpus = demo
    before = sorted(p.name for p in tmp_path.rglob("*"))
    # Raw multipart: httpx would percent-encode a NUL or quote in the file name.
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="'
        + name.encode()
        + b'"\r\nContent-Type: text/plain\r\n\r\n'
        + data
        + b"\r\n--XyZ--\r\n"
    )
    r = client.post("/api/documents", content=body, headers={"Content-Type": "multipart/form-data; boundary=XyZ"})
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert _chat(client).status_code == 200


def test_disconnecting_client_cancels_its_generation(demo):
    server, client, engine, _, _ = demo
    engine.delay = 0.05
    aborted = engine.aborted
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "stream a while"}], "stream": True, "max_tokens": 200},
    ) as r:
        for line in r.iter_lines():
            if '"content":"w1"' in line or '"content":" w1"' in line:
                break
    deadline = time.time() + 5
    while engine.active and time.time() < deadline:
        time.sleep(0.05)
    assert engine.active == 0 and engine.aborted == aborted + 1
    assert len(engine.requests[-1]) and engine.delay == 0.05
    engine.delay = 0.0
    assert _chat(client).status_code == 200


def test_concurrent_chats_overlap_in_the_engine(demo):
    server, client, engine, _, _ = demo
    engine.delay = 0.02
    peak = []

    def one():
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sekret"}, timeout=30) as c:
            assert _chat(c, max_tokens=20).status_code == 200
            peak.append(engine.active)

    watcher_stop = threading.Event()
    seen = []

    def watch():
        while not watcher_stop.is_set():
            seen.append(engine.active)
            time.sleep(0.005)

    w = threading.Thread(target=watch)
    w.start()
    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    watcher_stop.set()
    w.join()
    assert max(seen) >= 2  # no global lock: several generations were in flight at once


def test_metrics_expose_requests_ttft_store_tiers_and_errors(demo):
    _, client, _, _, _ = demo
    assert _chat(client).status_code == 200
    client.post("/v1/chat/completions", content=b"{bad")
    text = client.get("/metrics").text
    assert 'epic_rag_http_requests_total{method="POST",route="/v1/chat/completions",status="200"}' in text
    assert "epic_rag_time_to_first_token_seconds_bucket" in text
    assert 'epic_rag_store_hits_total{tier="memory"}' in text
    assert 'epic_rag_errors_total{kind="http_400"}' in text
    assert "epic_rag_recomputed_tokens_total" in text and 'epic_rag_corpus{what="compiled"}' in text


def test_ingestion_waits_while_chats_are_answered(demo):
    server, client, engine, app, _ = demo
    lib = app.state.demo.library
    engine.delay = 0.02
    done = threading.Event()

    def chat():
        with httpx.Client(base_url=server.url, headers={"Authorization": "Bearer sekret"}, timeout=30) as c:
            assert _chat(c, max_tokens=60).status_code == 200
        done.set()

    t = threading.Thread(target=chat)
    t.start()
    deadline = time.time() + 5
    while not engine.active and time.time() < deadline:
        time.sleep(0.01)
    n = len(engine.compiled)
    assert (
        client.post("/api/documents", files={"file": ("later.txt", b"Some later text about ferries.")}).status_code
        == 202
    )
    time.sleep(0.5)
    assert not done.is_set() and len(engine.compiled) == n  # indexed, but not compiled during the chat
    t.join()
    engine.delay = 0.0
    assert lib.wait_ready(10) and len(engine.compiled) == n + 1


def test_non_stream_request_is_cancelled_when_the_client_gives_up(demo):
    server, client, engine, app, _ = demo
    engine.delay = 0.05
    aborted = engine.aborted
    with httpx.Client(
        base_url=server.url, headers={"Authorization": "Bearer sekret"}, timeout=httpx.Timeout(30, read=0.5)
    ) as c:
        with pytest.raises(httpx.ReadTimeout):
            _chat(c, max_tokens=200)  # 200 x 50 ms: the client leaves after 0.5 s
    deadline = time.time() + 5
    while engine.active and time.time() < deadline:
        time.sleep(0.05)
    assert engine.active == 0 and engine.aborted == aborted + 1
    engine.delay = 0.0
    assert app.state.demo.active_chats == 0 and _chat(client).status_code == 200


def test_models_report_the_context_window(demo):
    _, client, engine, _, _ = demo
    (m,) = client.get("/v1/models").json()["data"]
    assert m["id"] == "smollm2-135m-instruct" and m["max_model_len"] == engine.max_model_len


def test_chat_sampling_fields_reach_the_engine(demo):
    _, client, engine, _, _ = demo
    r = _chat(
        client,
        top_p=0.9,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_p=0.05,
        repetition_penalty=1.1,
        sampling_top_k=20,
        logprobs=True,
        top_logprobs=3,
        stop=["\n"],
        user="someone",  # does not change an answer: accepted
        tools=[],  # unsupported but off: accepted
        n=1,
    )
    assert r.status_code == 200, r.text
    got = engine.requests[-1]
    assert got["options"] == {
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "logprobs": 3,
    }
    assert got["stop"] == ["\n"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
        ("tool_choice", "required"),
        ("logit_bias", {"50256": -100}),
        ("best_of", 3),
        ("temprature", 0.2),  # a misspelt field is not silently ignored either
    ],
)
def test_unsupported_chat_fields_are_a_400_naming_them(demo, field, value):
    _, client, engine, _, _ = demo
    before = len(engine.requests)
    r = _chat(client, **{field: value})
    assert r.status_code == 400 and repr(field) in r.json()["error"]["message"], r.text
    assert len(engine.requests) == before


def test_response_format_json_schema_and_json_object_reach_the_engine_and_text_means_unconstrained(demo):
    _, client, engine, _, _ = demo
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema}}
    assert _chat(client, response_format=fmt).status_code == 200
    assert engine.requests[-1]["options"]["response_format"] == fmt
    assert _chat(client, response_format={"type": "json_object"}).status_code == 200
    assert engine.requests[-1]["options"]["response_format"] == {"type": "json_object"}
    assert _chat(client, response_format={"type": "text"}).status_code == 200
    assert "response_format" not in engine.requests[-1]["options"]


@pytest.mark.parametrize(
    "fmt", [{"type": "json_schema", "json_schema": {"name": "A"}}, {"type": "regex"}, "json"], ids=str
)
def test_response_format_without_a_schema_or_of_an_unknown_type_is_a_400(demo, fmt):
    _, client, engine, _, _ = demo
    before = len(engine.requests)
    r = _chat(client, response_format=fmt)
    assert r.status_code == 400 and "response_format" in r.json()["error"]["message"], r.text
    assert len(engine.requests) == before


@pytest.mark.parametrize(
    "extra, needle",
    [({"n": 2}, "n"), ({"top_logprobs": 2}, "top_logprobs needs logprobs"), ({"top_p": 0}, "top_p")],
)
def test_bad_sampling_values_are_a_400(demo, extra, needle):
    _, client, _, _, _ = demo
    r = _chat(client, **extra)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_completions_endpoint_takes_a_prompt_and_returns_text_with_usage(demo):
    _, client, engine, _, _ = demo
    r = client.post(
        "/v1/completions",
        json={"model": "smollm2-135m-instruct", "prompt": "Once upon a time", "max_tokens": 3, "top_p": 0.5},
    )
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["object"] == "text_completion" and j["id"].startswith("cmpl-")
    assert j["choices"][0]["text"] == "w0 w1 w2" and j["choices"][0]["finish_reason"] == "length"
    assert j["usage"]["prompt_tokens_details"] == {"cached_tokens": 80}
    got = engine.requests[-1]
    assert got["request"] == "Once upon a time" and got["options"] == {"top_p": 0.5}  # no chat template
    with client.stream(
        "POST",
        "/v1/completions",
        json={"prompt": ["Once"], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "w0 w1"
    assert chunks[-1]["usage"]["total_tokens"] == 102
    for body, needle in [
        ({"prompt": ["a", "b"]}, "exactly one prompt"),
        ({"prompt": "a", "echo": True}, "'echo'"),
        ({"prompt": "a", "suffix": "z"}, "'suffix'"),
        ({"prompt": "  "}, "empty"),
    ]:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
