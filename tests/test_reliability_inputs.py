"""Bad input: a catalogue run against the engine API and the HTTP server, both on the real vLLM
engine with the tiny model (the demo app is served on loopback with `tiny_engine` and a bag-of-words
encoder). Every bad input must get a clear error (ValueError / 4xx with a message); none may crash the
process or poison later requests: after each one a fixed good request must give the same token ids as a
reference generation at temperature 0, with no request, link job or KV capture left behind.

Cases already covered elsewhere are not repeated here (docs/reliability.md lists them with their tests):
empty/whitespace chunks, unknown chunk keys without text, bad policies/max_tokens/temperature in
tests/test_engine_tiny.py; malformed chat bodies, limits and bad uploads against a scripted engine in
tests/test_demo_unit.py; the same on SmolLM2 in tests/test_demo_api.py.
"""

from __future__ import annotations

import argparse
import inspect
import re
import socket
import time
from pathlib import Path

import httpx
import pytest
from test_demo_unit import HashEncoder

from epic_rag import Chunk, ChunkRef, RagRequest
from epic_rag.engine.connector.epic import pending
from epic_rag.prompt import encode_text
from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DemoConfig
from epic_rag_demo.server import create_app

ROOT = Path(__file__).resolve().parents[1]
KEY = "reliability-key"

# Texts no other test compiles (the engine's text index is shared by the whole session).
DOCS = {
    "ferry.txt": "The Quillmoor ferry leaves the north pier at 06:40 every weekday. Its captain is Odile Varga.",
    "vault.md": "# Vault\n\nThe combination of the Hestra vault is 4482. It is changed on the first of each month.",
}
GOOD_CHUNKS = [DOCS["ferry.txt"], "Reliability fixture: the Orvel lighthouse is painted red and white."]
GOOD_QUESTION = "When does the Quillmoor ferry leave?"
NEW_TOKENS = 8


def good_request() -> RagRequest:
    return RagRequest(question=GOOD_QUESTION, chunks=list(GOOD_CHUNKS))


def engine_idle(engine, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if engine.runtime.idle():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def reference(tiny_engine) -> list[int]:
    g = tiny_engine.generate(good_request(), max_tokens=NEW_TOKENS, temperature=0.0, policy="legolink-4")
    assert len(g.token_ids) == NEW_TOKENS
    return g.token_ids


def assert_unpoisoned(engine, reference: list[int]) -> None:
    """No leftovers from the bad request, and the good request still gives the reference tokens."""
    assert engine_idle(engine), "a request was left running in the engine"
    assert pending() == 0, "a link job or KV capture was left on the board"
    assert engine.runtime.fatal is None
    g = engine.generate(good_request(), max_tokens=NEW_TOKENS, temperature=0.0, policy="legolink-4")
    assert g.token_ids == reference


# ---------------------------------------------------------------------- engine API: refused
C0 = GOOD_CHUNKS[0]
LONG = "Reliability long chunk: " + "the quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens
PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + bytes(range(256))

ENGINE_REFUSED = [
    # invalid UTF-8 / binary
    ("bytes-chunk", lambda e: e.compile([b"\xff\xfe binary"]), "got bytes"),
    ("bytes-request", lambda e: e.generate(PNG, max_tokens=4), "RagRequest"),
    (
        "invalid-utf8-as-surrogates",
        lambda e: e.compile([b"ok \xff\xfe".decode("utf-8", "surrogateescape")]),
        "not valid Unicode",
    ),
    # unicode edge cases that are not text
    (
        "lone-surrogate-in-chunk",
        lambda e: e.generate(RagRequest("q?", ["abc \ud800 def"]), max_tokens=4),
        "not valid Unicode",
    ),
    (
        "lone-surrogate-in-question",
        lambda e: e.generate(RagRequest("q \udcff?", [C0]), max_tokens=4),
        "not valid Unicode",
    ),
    (
        "lone-surrogate-in-glue",
        lambda e: e.generate(["Context \udfff:\n", Chunk(C0), "\nQ?"], max_tokens=4),
        "not valid Unicode",
    ),
    # over the context window (2048 tokens)
    ("question-over-context", lambda e: e.generate(RagRequest("word " * 3000, [C0]), max_tokens=4), "context window"),
    (
        "chunks-together-over-context",
        lambda e: e.generate(RagRequest("q?", [LONG] * 8), max_tokens=4),
        "context window",
    ),
    ("prompt-string-over-context", lambda e: e.generate("word " * 3000, max_tokens=4), "context window"),
    # wrong types and values of generation arguments
    ("max_tokens-float", lambda e: e.generate(good_request(), max_tokens=4.0), "max_tokens"),
    ("max_tokens-bool", lambda e: e.generate(good_request(), max_tokens=True), "max_tokens"),
    ("max_tokens-None", lambda e: e.generate(good_request(), max_tokens=None), "max_tokens"),
    ("max_tokens-str", lambda e: e.generate(good_request(), max_tokens="8"), "max_tokens"),
    ("max_tokens-huge-negative", lambda e: e.generate(good_request(), max_tokens=-(10**12)), "max_tokens"),
    ("temperature-nan", lambda e: e.generate(good_request(), temperature=float("nan")), "temperature"),
    ("temperature-inf", lambda e: e.generate(good_request(), temperature=float("inf")), "temperature"),
    ("temperature-str", lambda e: e.generate(good_request(), temperature="0"), "temperature"),
    ("temperature-too-high", lambda e: e.generate(good_request(), temperature=6.0), "temperature"),
    ("policy-int", lambda e: e.generate(good_request(), policy=5), "policy must be a string"),
    ("policy-empty", lambda e: e.generate(good_request(), policy=""), "unknown policy"),
    ("policy-negative-k", lambda e: e.generate(good_request(), policy="legolink--1"), "unknown policy"),
    ("policy-unknown", lambda e: e.generate(good_request(), policy="turbo-link"), "unknown policy"),
    ("stop-ints", lambda e: e.generate(good_request(), stop=[1, 2]), "stop must be"),
    ("stop-dict", lambda e: e.generate(good_request(), stop={"a": 1}), "stop must be"),
    # chunk ids / keys that do not exist or could address files
    (
        "chunk-key-path-traversal",
        lambda e: e.generate(RagRequest("q?", [ChunkRef("../../etc/passwd", 3)])),
        "invalid chunk key",
    ),
    (
        "chunk-key-absolute-path",
        lambda e: e.generate(RagRequest("q?", [ChunkRef("/etc/passwd", 3)])),
        "invalid chunk key",
    ),
    ("chunk-key-None", lambda e: e.generate(RagRequest("q?", [ChunkRef(None, 3)])), "invalid chunk key"),
    ("chunk-key-nul", lambda e: e.generate(RagRequest("q?", [ChunkRef("plain-\x00", 3)])), "invalid chunk key"),
    # wrong shapes
    ("segment-int", lambda e: e.generate(["a", 5], max_tokens=4), "segment must be"),
    ("segment-None", lambda e: e.generate([None], max_tokens=4), "segment must be"),
    ("request-dict", lambda e: e.generate({"question": "q"}, max_tokens=4), "RagRequest"),
    ("request-None", lambda e: e.generate(None, max_tokens=4), "RagRequest"),
    ("compile-int", lambda e: e.compile(5), "list of chunk texts"),
    ("compile-None", lambda e: e.compile(None), "list of chunk texts"),
    ("compile-list-with-None", lambda e: e.compile([C0, None]), "got NoneType"),
    ("chunk-over-context", lambda e: e.compile(["word " * 2100]), "context window"),
]


@pytest.mark.parametrize("call,needle", [c[1:] for c in ENGINE_REFUSED], ids=[c[0] for c in ENGINE_REFUSED])
def test_engine_refuses_bad_input_with_a_clear_error_and_keeps_serving(tiny_engine, reference, call, needle):
    before = set(tiny_engine.store.keys())
    with pytest.raises(ValueError, match=re.escape(needle)):
        call(tiny_engine)
    assert set(tiny_engine.store.keys()) == before  # nothing half-compiled was stored
    assert_unpoisoned(tiny_engine, reference)


# ---------------------------------------------------------------------- engine API: odd but valid input
ZALGO = "Z\u0351\u0352\u0353\u0354a\u0300\u0301\u0302\u0303l\u0334\u0335g\u0336o\u0337 " * 20
ENGINE_ACCEPTED = [
    (
        "nul-bytes-in-chunk",
        lambda e: e.generate(RagRequest("q?", ["before\x00after, a chunk with NULs"]), max_tokens=4),
    ),
    ("only-nul-bytes-chunk", lambda e: e.generate(RagRequest("q?", ["\x00\x00\x00"]), max_tokens=4)),
    ("zero-width-only-chunk", lambda e: e.generate(RagRequest("q?", ["\u200b\u200c\u200d"]), max_tokens=4)),
    ("bom-only-chunk", lambda e: e.generate(RagRequest("q?", ["\ufeff"]), max_tokens=4)),
    ("combining-marks", lambda e: e.generate(RagRequest("e\u0301t\u0301e\u0301?", [ZALGO]), max_tokens=4)),
    (
        "rtl-and-bidi-overrides",
        lambda e: e.generate(
            RagRequest("\u202eما هو؟\u202c", ["مرحبا بالعالم. \u202eשלום עולם\u202c \u2067isolate\u2069"]), max_tokens=4
        ),
    ),
    ("emoji-zwj-and-flags", lambda e: e.generate(RagRequest("👍🏽?", ["👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 " * 20]), max_tokens=4)),
    ("binary-file-decoded-as-latin1", lambda e: e.generate(RagRequest("q?", [PNG.decode("latin-1")]), max_tokens=4)),
    (
        "unknown-key-with-text-recompiles",
        lambda e: e.generate(
            RagRequest("q?", [ChunkRef("plain-" + "0" * 40, 3, "Reliability: a ref whose key is stale.")]), max_tokens=4
        ),
    ),
    ("stop-as-string", lambda e: e.generate(good_request(), max_tokens=4, stop="zzzz")),
    ("compile-empty-list", lambda e: e.compile([])),
    ("compile-generator", lambda e: e.compile(t for t in ["Reliability: compiled from a generator."])),
]


@pytest.mark.parametrize("call", [c[1] for c in ENGINE_ACCEPTED], ids=[c[0] for c in ENGINE_ACCEPTED])
def test_engine_answers_odd_but_valid_input_and_keeps_serving(tiny_engine, reference, call):
    out = call(tiny_engine)
    if not isinstance(out, list):
        assert out.token_ids and out.finish_reason in ("length", "stop")
    assert_unpoisoned(tiny_engine, reference)


def _prompt_of(engine, n_tokens: int) -> str:
    text = "self" + " self" * (n_tokens - 1)
    assert len(encode_text(engine.tokenizer, text)) == n_tokens
    return text


def test_huge_max_tokens_is_clamped_to_the_context_window(tiny_engine, reference):
    n = tiny_engine.max_model_len - 20
    g = tiny_engine.generate(_prompt_of(tiny_engine, n), max_tokens=10**9, policy="full")
    assert 1 <= len(g.token_ids) <= tiny_engine.max_model_len - n
    assert g.prompt_tokens == n
    assert_unpoisoned(tiny_engine, reference)


def test_prompt_one_token_below_the_window_still_answers_one_token(tiny_engine, reference):
    n = tiny_engine.max_model_len - 1
    g = tiny_engine.generate(_prompt_of(tiny_engine, n), max_tokens=64, policy="full")
    assert len(g.token_ids) == 1 and g.finish_reason == "length"
    with pytest.raises(ValueError, match="context window"):
        tiny_engine.generate(_prompt_of(tiny_engine, n + 1), max_tokens=64)
    assert_unpoisoned(tiny_engine, reference)


def test_chunk_at_the_compile_limit_compiles_and_one_over_is_refused(tiny_engine, reference):
    limit = tiny_engine.max_model_len - len(tiny_engine.chunks.lead) - 2  # the compile lead + one answer token
    (ref,) = tiny_engine.compile([_prompt_of(tiny_engine, limit)])
    assert ref.num_tokens == limit
    with pytest.raises(ValueError, match="context window"):
        tiny_engine.compile([_prompt_of(tiny_engine, limit + 1)])
    assert_unpoisoned(tiny_engine, reference)


async def test_cancelling_many_async_streams_leaves_nothing_behind(tiny_engine, reference):
    import asyncio

    async def consume(started: asyncio.Event):
        async for _piece in tiny_engine.astream(
            RagRequest("Tell me more about the ferry.", GOOD_CHUNKS), max_tokens=1500, policy="legolink-4"
        ):
            started.set()

    for _ in range(3):
        runs = [(asyncio.Event(),) for _ in range(6)]
        tasks = [asyncio.ensure_future(consume(ev)) for (ev,) in runs]
        for (ev,), t in zip(runs, tasks):
            await asyncio.wait({asyncio.ensure_future(ev.wait()), t}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()  # the caller goes away mid-stream
        await asyncio.gather(*tasks, return_exceptions=True)
    assert_unpoisoned(tiny_engine, reference)


# ---------------------------------------------------------------------- HTTP server on the tiny engine
@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("reliability-http")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in DOCS.items():
        (corpus / name).write_text(text)
    (root / "outside.txt").write_text("a file next to the corpus folder that nothing may touch")
    cfg = DemoConfig(
        corpus=str(corpus),
        data_dir=root / "data",
        store="memory",
        api_key=KEY,
        top_k=2,
        default_max_tokens=16,
        max_tokens_limit=64,
        max_prompt_chars=20000,
        max_body_bytes=64 << 10,
        max_upload_bytes=128 << 10,
        refine_neighbours=0,  # answers are compared with references: no refine pass may change what links
    )
    app = create_app(engine=tiny_engine, config=cfg, encoder=HashEncoder())
    srv = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(60), app.state.demo.library.status()
    srv.app, srv.root, srv.corpus = app, root, corpus
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


GOOD_BODY = {
    "messages": [{"role": "user", "content": GOOD_QUESTION}],
    "max_tokens": NEW_TOKENS,
    "chunk_ids": ["ferry.txt#0"],
    "policy": "legolink-4",
}


@pytest.fixture(scope="module")
def http_reference(client, tiny_engine, reference):
    r = client.post("/v1/chat/completions", json=GOOD_BODY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], r.json()["usage"]


def assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference) -> None:
    r = client.post("/v1/chat/completions", json=GOOD_BODY)  # same keep-alive client as the bad request
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["message"]["content"], r.json()["usage"]) == http_reference
    assert server.app.state.demo.active_chats == 0
    assert_unpoisoned(tiny_engine, reference)


def _json(obj) -> bytes:
    import json

    return json.dumps(obj).encode()


def _msg(content, **kw) -> bytes:
    return _json({"messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw})


HTTP_REFUSED = [
    # (id, body bytes, content type, status, needle in the error message)
    (
        "lone-surrogate-in-content",
        b'{"messages":[{"role":"user","content":"abc \\ud800 def"}]}',
        None,
        400,
        "not valid Unicode",
    ),
    (
        "lone-surrogate-in-text-part",
        b'{"messages":[{"role":"user","content":[{"type":"text","text":"\\udfff"}]}]}',
        None,
        400,
        "not valid Unicode",
    ),
    (
        "lone-surrogate-in-stop",
        b'{"messages":[{"role":"user","content":"x"}],"stop":["\\ud800"]}',
        None,
        400,
        "not valid Unicode",
    ),
    ("invalid-utf8-body", b'{"messages":[{"role":"user","content":"\xff\xfe"}]}', None, 400, "parsing the body"),
    ("binary-body", PNG, None, 400, "parsing the body"),
    ("json-null", b"null", None, 400, "Field required"),
    ("json-string", b'"hello"', None, 400, "JSON object"),
    ("json-number", b"42", None, 400, "JSON object"),
    ("deeply-nested-json", b"[" * 30000 + b"]" * 30000, None, 400, "parsing the body"),
    (
        "huge-integer-literal",
        b'{"messages":[{"role":"user","content":"x"}],"top_k":' + b"9" * 5000 + b"}",
        None,
        400,
        "parsing the body",
    ),
    ("text-plain-content-type", _msg("x"), "text/plain", 400, "JSON object"),
    ("messages-null", _json({"messages": None}), None, 400, "messages"),
    ("message-not-object", _json({"messages": ["hi"]}), None, 400, "messages.0"),
    ("role-null", _json({"messages": [{"role": None, "content": "x"}]}), None, 400, "role"),
    (
        "image-content-part",
        _json({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}),
        None,
        400,
        "content",
    ),
    ("max_tokens-float", _msg("x", max_tokens=4.5), None, 400, "max_tokens"),
    ("max_tokens-huge", _msg("x", max_tokens=10**30), None, 400, "at most 64"),
    ("max_tokens-negative", _msg("x", max_tokens=-1), None, 400, "max_tokens"),
    ("temperature-nan", b'{"messages":[{"role":"user","content":"x"}],"temperature":NaN}', None, 400, "temperature"),
    (
        "temperature-infinity",
        b'{"messages":[{"role":"user","content":"x"}],"temperature":1e999}',
        None,
        400,
        "temperature",
    ),
    ("top_k-negative", _msg("x", top_k=-1), None, 400, "top_k"),
    ("n-2", _msg("x", n=2), None, 400, "n"),
    ("stream-string", _msg("x", stream="true"), None, 400, "stream"),
    ("unknown-model", _msg("x", model="../../etc/passwd"), None, 404, "not found"),
    ("unknown-policy", _msg("x", policy="legolink-ultra"), None, 400, "unknown policy"),
    (
        "chunk-ids-traversal-and-missing",
        _msg("x", chunk_ids=["../../etc/passwd", "ferry.txt#99"]),
        None,
        400,
        "unknown chunk ids",
    ),
    ("chunk-ids-wrong-type", _msg("x", chunk_ids="ferry.txt#0"), None, 400, "chunk_ids"),
    ("prompt-over-context-no-retrieval", _msg("word " * 3000, use_retrieval=False), None, 400, "prompt too long"),
    ("prompt-over-max-chars", _msg("x" * 20001), None, 400, "prompt too long"),
    ("body-over-limit", _msg("x" * (70 << 10)), None, 413, "limit"),
]


@pytest.mark.parametrize("body,ctype,status,needle", [c[1:] for c in HTTP_REFUSED], ids=[c[0] for c in HTTP_REFUSED])
def test_http_refuses_bad_input_with_a_clear_status_and_keeps_serving(
    server, client, tiny_engine, http_reference, reference, body, ctype, status, needle
):
    r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": ctype or "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["code"] == status
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


HTTP_ACCEPTED = [
    ("nul-bytes-in-content", "before\x00after: when does the ferry leave?"),
    ("combining-marks", "Whe\u0301n do\u0308es the ferry le\u0300ave? " + ZALGO[:200]),
    ("rtl-and-bidi-overrides", "\u202eمتى تغادر العبارة؟\u202c שלום"),
    ("emoji", "🚢👨‍👩‍👧‍👦🏳️‍🌈 when does the ferry leave? 🇫🇷"),
]


@pytest.mark.parametrize("content", [c[1] for c in HTTP_ACCEPTED], ids=[c[0] for c in HTTP_ACCEPTED])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_http_answers_unicode_edge_cases(server, client, tiny_engine, http_reference, reference, content, stream):
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 4, "stream": stream},
    )
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    else:
        assert r.json()["usage"]["completion_tokens"] >= 1
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


def test_http_stream_chunked_body_over_the_limit_is_413(server, client, tiny_engine, http_reference, reference):
    def body():  # no Content-Length: the limit is enforced while reading
        yield b'{"messages":[{"role":"user","content":"'
        for _ in range(100):
            yield b"a" * 1024
        yield b'"}]}'

    r = client.post("/v1/chat/completions", content=body(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


@pytest.mark.parametrize(
    "raw,status",
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n", 400),
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
        (b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n", 400),
    ],
    ids=[
        "garbage-request-line",
        "non-numeric-content-length",
        "negative-content-length",
        "bad-chunk-size",
        "unknown-http-version",
    ],
)
def test_malformed_http_is_refused_by_the_server(server, client, tiny_engine, http_reference, reference, raw, status):
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(raw)
        head = s.recv(4096)  # a connection reset raises here: it is not an answer, and fails the test
    assert head.startswith(b"HTTP/1.1 %d " % status), head[:200]
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


def test_oversized_header_is_read_and_serving_goes_on(server, client, tiny_engine, http_reference, reference):
    # uvicorn's httptools parser sets no header size limit (h11 would stop at 16 KiB): a 4 MiB header is
    # buffered and the request answered. Recorded in docs/reliability.md; serving is not disturbed.
    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 << 20) + b"\r\n\r\n")
        head = s.recv(64)
    assert head.startswith((b"HTTP/1.1 200", b"HTTP/1.1 4")), head
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


def test_an_internal_error_is_a_json_500_and_the_connection_stays_usable(
    server, client, tiny_engine, http_reference, reference, monkeypatch
):
    def broken(*a, **k):
        raise RuntimeError("simulated retrieval fault")

    monkeypatch.setattr(server.app.state.demo.library, "search", broken)
    for _ in range(5):  # each 500 is followed by a good request on the same keep-alive connection
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
        msg = r.json()["error"]["message"]
        assert r.status_code == 500 and msg.startswith("internal error (request id err-") and "simulated" not in msg
        assert client.post("/v1/chat/completions", json=GOOD_BODY).status_code == 200
    monkeypatch.undo()
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


# ---------------------------------------------------------------------- uploads on the tiny engine
UPLOADS_REFUSED = [
    ("binary-png", "image.txt", PNG, 400, "NUL"),
    ("invalid-utf8", "latin.txt", "café".encode("latin-1") + b" \xff\xfe", 400, "UTF-8"),
    ("utf16-with-bom", "wide.txt", "hello".encode("utf-16"), 400, "NUL"),
    ("empty-file", "empty.md", b"", 400, "no text"),
    ("whitespace-only", "blank.txt", b" \n\t \r\n ", 400, "no text"),
    ("garbage-pdf", "paper.pdf", b"%PDF-1.4 this is not a pdf", 400, "PDF"),
    # over max_upload_bytes (128 KiB) but under the streaming cap (+64 KiB for the multipart framing): the
    # route's own check; the streaming cap is test_upload_over_the_streaming_cap_is_413_while_reading
    ("over-the-document-limit", "huge.txt", b"word " * (30 << 10), 413, "upload limit"),
    ("dotdot-traversal", "../../outside.txt", b"overwrite", 400, ".."),
    ("backslash-traversal", "..\\..\\outside.txt", b"overwrite", 400, ".."),
    ("absolute-path", "/tmp/evil.txt", b"x", 400, "absolute"),
    ("windows-drive", "C:evil.txt", b"x", 400, "absolute"),
    ("nul-in-name", "ok.txt\x00.exe", b"x", 400, "NUL"),
    ("tab-in-name", "a\tb.txt", b"x", 400, "control"),
    ("hidden-name", ".bashrc.txt", b"x", 400, "hidden"),
    ("executable-type", "run.sh", b"#!/bin/sh\nrm -rf /", 400, "unsupported"),
]


def _multipart(name: str, data: bytes) -> tuple[bytes, dict]:
    # Raw multipart: httpx would percent-encode a NUL or quote in the file name.
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="'
        + name.encode()
        + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
        + data
        + b"\r\n--XyZ--\r\n"
    )
    return body, {"Content-Type": "multipart/form-data; boundary=XyZ"}


def _tree(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_mtime_ns
        for p in root.rglob("*")
        if p.is_file() and "data" not in p.relative_to(root).parts
    }


@pytest.mark.parametrize(
    "name,data,status,needle", [c[1:] for c in UPLOADS_REFUSED], ids=[c[0] for c in UPLOADS_REFUSED]
)
def test_bad_uploads_get_a_clear_status_and_nothing_is_written(
    server, client, tiny_engine, http_reference, reference, name, data, status, needle
):
    before = _tree(server.root)
    body, headers = _multipart(name, data)
    r = client.post("/api/documents", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert _tree(server.root) == before
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


@pytest.mark.parametrize("declared", [False, True], ids=["chunked", "content-length"])
def test_upload_over_the_streaming_cap_is_413_while_reading(
    server, client, tiny_engine, http_reference, reference, declared
):
    cap = server.app.state.demo.cfg.max_upload_bytes + (64 << 10)
    body, headers = _multipart("huge.txt", b"word " * (cap // 5 + 1024))
    assert len(body) > cap
    before = _tree(server.root)
    if declared:  # refused from the header, before the body is read
        r = client.post("/api/documents", content=body, headers=headers)
    else:  # no Content-Length: the cap is enforced while the body streams in
        r = client.post(
            "/api/documents", content=(body[i : i + 16384] for i in range(0, len(body), 16384)), headers=headers
        )
        assert "content-length" not in r.request.headers
    assert r.status_code == 413, r.text
    assert f"request body exceeds the limit of {cap} bytes" in r.json()["error"]["message"]
    assert _tree(server.root) == before
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


def test_large_unicode_upload_is_indexed_compiled_and_answerable(
    server, client, tiny_engine, http_reference, reference
):
    name = "naïve-מסמך-👍.md"
    text = (
        "# Большой документ\n\n"
        + "Reliability filler paragraph about harbours and tides. " * 1500
        + "\n\nThe Quillmoor harbour master is called Ines Arrowby. 👍\n"
    )
    data = text.encode()
    assert 80 << 10 < len(data) < 128 << 10
    body, headers = _multipart(name, data)
    r = client.post("/api/documents", content=body, headers=headers)
    assert r.status_code == 202, r.text
    lib = server.app.state.demo.library
    assert lib.wait_ready(120), lib.status()
    assert (server.corpus / name).read_bytes() == data
    info = {d["name"]: d for d in client.get("/api/documents").json()["documents"]}[name]
    assert info["state"] == "ready" and info["chunks"] > 10 and info["compiled"] == info["chunks"]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Who is the harbour master?"}], "max_tokens": 4, "top_k": 2},
    )
    assert r.status_code == 200 and any(s["doc"] == name for s in r.json()["epic"]["sources"])
    assert client.delete(f"/api/documents/{name}").status_code == 200
    assert not (server.corpus / name).exists()
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


def test_html_upload_is_stored_as_text_without_markup(server, client, tiny_engine, http_reference, reference):
    body, headers = _multipart("page.html", b"<html><script>alert('x')</script><p>Reliability: tides &amp; moons</p>")
    r = client.post("/api/documents", content=body, headers=headers)
    assert r.status_code == 202, r.text
    assert server.app.state.demo.library.wait_ready(60)
    texts = [c.text for c in server.app.state.demo.library.chunks.values() if c.doc == "page.html"]
    assert texts and all("<" not in t and "alert" not in t for t in texts) and "tides & moons" in texts[0]
    assert client.delete("/api/documents/page.html").status_code == 200
    assert_http_unpoisoned(server, client, tiny_engine, http_reference, reference)


# ---------------------------------------------------------------------- security review, as tests
OPEN_ROUTES = {"/healthz", "/", "/static", "/openapi.json"}  # no work done, nothing private


def _working_routes(app) -> list[tuple[str, str]]:
    out = []
    for r in app.routes:
        path = getattr(r, "path", "")
        if path in OPEN_ROUTES:
            continue
        for m in sorted(getattr(r, "methods", None) or {"GET"}):
            if m != "HEAD":
                out.append((m, path.replace("{name:path}", "x.txt").replace("{name}", "x.txt")))
    return out


def test_every_route_that_does_work_needs_the_api_key(server):
    routes = _working_routes(server.app)
    assert {
        ("POST", "/v1/chat/completions"),
        ("POST", "/api/documents"),
        ("DELETE", "/api/documents/x.txt"),
        ("GET", "/metrics"),
        ("GET", "/v1/models"),
        ("GET", "/api/status"),
        ("GET", "/api/documents"),
    } <= set(routes)
    wrong = [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": f"Basic {KEY}"},
        {"X-API-Key": "wrong"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {KEY.upper()}"},
    ]
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        for method, path in routes:
            for h in wrong:
                r = anon.request(method, path, headers=h, json={})
                assert r.status_code == 401, (method, path, h, r.status_code)
                assert r.headers["www-authenticate"] == "Bearer" and "API key" in r.json()["error"]["message"]
            ok = anon.request(method, path, headers={"X-API-Key": KEY}, json={})
            assert ok.status_code != 401, (method, path)
        for path in ("/healthz", "/", "/openapi.json", "/static/app.js"):
            assert anon.get(path).status_code == 200


# The key check's use of hmac.compare_digest, and that it runs before a body is read, are checked by
# behaviour in tests/test_demo_hardening.py (it used to be a grep of the source here).


def test_defaults_bind_loopback_only():
    from epic_rag_demo.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    assert parser.parse_args(["demo"]).host == "127.0.0.1"
    assert inspect.signature(BackgroundServer).parameters["host"].default == "127.0.0.1"


FORBIDDEN = re.compile(
    r"\bpickle\b|\bcPickle\b|torch\.load\(|(?<![\w.])eval\(|(?<![\w.])exec\(|allow_pickle\s*=\s*True|"
    r"yaml\.load\(|yaml\.unsafe_load|marshal\.loads?\(|\bshelve\b|\bdill\b|joblib\.load|"
    r"trust_remote_code\s*=\s*True|shell\s*=\s*True|os\.system\("
)


def test_no_pickle_eval_or_shell_on_stored_or_uploaded_data():
    hits = []
    for folder in ("epic_rag", "apps"):
        for p in sorted((ROOT / folder).rglob("*.py")):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if FORBIDDEN.search(line.split("#", 1)[0]):
                    hits.append(f"{p.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
    js = (ROOT / "apps/demo/static/app.js").read_text()
    assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|(?<![\w.])eval\(|new Function", js)


def test_delete_cannot_reach_outside_the_corpus_folder(server, client):
    victim = server.root / "outside.txt"
    for path in (
        "/api/documents/..%2Foutside.txt",
        "/api/documents/%2E%2E%2F%2E%2E%2Foutside.txt",
        f"/api/documents/{victim}",
        "/api/documents/..%5Coutside.txt",
    ):
        r = client.delete(path)
        assert r.status_code == 404, (path, r.text)
    assert victim.exists()


def test_upload_over_a_symlink_pointing_outside_is_refused(server, client):
    victim = server.root / "outside.txt"
    before = victim.read_bytes()
    link = server.corpus / "planted.txt"
    link.symlink_to(victim)
    try:
        body, headers = _multipart("planted.txt", b"overwritten through a symlink")
        r = client.post("/api/documents", content=body, headers=headers)
        assert r.status_code == 400 and "outside" in r.json()["error"]["message"]
        assert victim.read_bytes() == before
    finally:
        link.unlink()
