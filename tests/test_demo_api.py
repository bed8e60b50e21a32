"""The demo server on SmolLM2, driven by the official `openai` client (stream and non-stream), plus
concurrency, disconnect-cancels-in-the-engine, malformed requests and uploads against the real engine."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import httpx
import openai
import pydantic
import pytest

from epic_rag.policy import SINK_LEN
from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DemoConfig
from epic_rag_demo.server import create_app

pytestmark = pytest.mark.smollm

KEY = "demo-test-key"
PASSAGES = {
    "bridge.txt": "The Larkspur Bridge opened in 1931. It crosses the Vell River and is 412 metres long. "
    "It was designed by the engineer Maria Ostrand.",
    "tovin.md": "Tovin is a small town in the northern hills. Its main industry is wool, and its market is held "
    "every Thursday in the old square.",
    "archive.txt": "The secret passcode for the archive room is 7314. Only the head librarian may share it.",
}
QUESTION = "What is the secret passcode for the archive room?"


@pytest.fixture(scope="module")
def server(smol_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-api")
    corpus = root / "corpus"
    corpus.mkdir()
    for name, text in PASSAGES.items():
        (corpus / name).write_text(text)
    cfg = DemoConfig(corpus=str(corpus), data_dir=root / "data", api_key=KEY, top_k=2, max_tokens_limit=512)
    app = create_app(engine=smol_engine, config=cfg)
    srv = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(180), app.state.demo.library.status()
    srv.app = app
    srv.corpus = corpus
    yield srv
    srv.stop()


@pytest.fixture()
def client(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    yield c
    c.close()


def _engine_idle(engine, timeout: float) -> bool:
    """True once the engine has no request left (none registered in the runtime, none in vLLM)."""
    end = time.time() + timeout
    while time.time() < end:
        if engine.runtime.idle():
            return True
        time.sleep(0.05)
    return False


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m-instruct"]


def test_openai_client_non_stream_answers_from_linked_chunks(client):
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=16,
        messages=[{"role": "user", "content": QUESTION}],
        extra_body={"policy": "legolink-16", "top_k": 2},
    )
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert "7314" in r.choices[0].message.content, r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    e = r.model_extra["epic"]
    assert e["policy"] == "legolink-16" and e["ttft_s"] > 0
    assert e["chunk_hits"] == 2 and e["chunk_misses"] == 0  # compiled at ingestion, linked here
    assert 0 < e["recomputed_tokens"] < e["prompt_tokens"] == r.usage.prompt_tokens
    assert e["linked_tokens"] + e["recomputed_tokens"] == e["prompt_tokens"]
    assert "archive.txt" in [s["doc"] for s in e["sources"]]


def test_openai_client_stream_role_first_finish_last(client):
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=16,
        stream=True,
        messages=[{"role": "user", "content": QUESTION}],
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].model_extra["epic"]["sources"]  # citations come before the answer
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "7314" in text, text
    with_choices = [c for c in chunks if c.choices]
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    last = with_choices[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.model_extra["epic"]["chunk_hits"] == 2
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_policy_switch_changes_what_is_linked(client):
    def run(policy):
        r = client.chat.completions.create(
            model="smollm2-135m-instruct",
            max_tokens=4,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body={"policy": policy, "cache_salt": uuid.uuid4().hex},  # linked anew, not found cached
        )
        return r.model_extra["epic"]

    full, naive, lego = run("full"), run("naive"), run("legolink-16")
    assert full["linked_tokens"] == 0 and full["recomputed_tokens"] == full["prompt_tokens"]
    assert naive["linked_tokens"] > lego["linked_tokens"] > 0
    # legolink-16 (sink form) links the same prompt as full; naive keeps each chunk's sink token in it.
    assert lego["prompt_tokens"] == full["prompt_tokens"]
    assert naive["prompt_tokens"] == full["prompt_tokens"] + SINK_LEN * len(full["sources"])


def test_extra_body_chunk_ids_and_plain_chat(client):
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=12,
        messages=[{"role": "user", "content": "How long is the Larkspur Bridge?"}],
        extra_body={"chunk_ids": ["bridge.txt#0"]},
    )
    assert [s["id"] for s in r.model_extra["epic"]["sources"]] == ["bridge.txt#0"]
    assert "412" in r.choices[0].message.content, r.choices[0].message.content
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=4,
        messages=[{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Say hello."}],
        extra_body={"use_retrieval": False},
    )
    assert r.model_extra["epic"]["sources"] == [] and r.choices[0].message.content


async def test_concurrent_streams_are_batched_not_serialised(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    questions = [QUESTION, "How long is the Larkspur Bridge?", "When is the market held in Tovin?"]

    async def one(q):
        first = last = None
        stream = await client.chat.completions.create(
            model="smollm2-135m-instruct",
            max_tokens=12,
            stream=True,
            messages=[{"role": "user", "content": q}],
            extra_body={"policy": "legolink-16"},
        )
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                now = time.perf_counter()
                first = first or now
                last = now
        return first, last

    spans = await asyncio.gather(*(one(q) for q in questions))
    await client.close()
    # With a lock around generation each answer would finish before the next started.
    assert max(f for f, _ in spans) < min(la for _, la in spans), spans


def test_disconnect_mid_stream_aborts_the_request_in_the_engine(server, smol_engine):
    assert _engine_idle(smol_engine, 30)
    before = server.app.state.demo.metrics.chat.labels("legolink-16", "true", "cancelled")._value.get()
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Write a long story about the Larkspur Bridge."}],
                "stream": True,
                "max_tokens": 400,
                "policy": "legolink-16",
            },
        ) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
                    got += 1
                    if got == 3:
                        break
            assert got == 3
            assert smol_engine.runtime.in_flight()  # still generating when the client goes away
    t0 = time.time()
    assert _engine_idle(smol_engine, 5), "request still running in the engine after the client left"
    assert time.time() - t0 < 5  # 400 tokens at ~20 tok/s would take ~20 s
    after = server.app.state.demo.metrics.chat.labels("legolink-16", "true", "cancelled")._value.get()
    assert after == before + 1


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b'{"messages": [', 400, "JSON"),
        (json.dumps({"messages": [{"role": "user", "content": ["not", "parts"]}]}).encode(), 400, "content"),
        (json.dumps({"messages": []}).encode(), 400, "messages"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}).encode(), 400, "512"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "policy": "fastest"}).encode(), 400, "policy"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}], "top_k": "3"}).encode(), 400, "top_k"),
        (b'{"messages": [{"role": "user", "content": "' + b"a" * (2 << 20) + b'"}]}', 413, "limit"),
    ],
)
def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server, client, body, status, needle):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=body,
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    ok = client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=2, messages=[{"role": "user", "content": QUESTION}]
    )
    assert ok.choices[0].message.content


def test_openai_client_sees_errors_as_exceptions(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=0, messages=[{"role": "user", "content": QUESTION}]
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    bad = openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_uploaded_document_is_compiled_and_answers_questions(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    text = b"The door code for the Orsa Point lighthouse is 5521. The keeper changes it every spring."
    r = httpx.post(server.url + "/api/documents", files={"file": ("orsa.txt", text)}, headers=h, timeout=30)
    assert r.status_code == 202, r.text
    assert server.app.state.demo.library.wait_ready(60)
    assert (server.corpus / "orsa.txt").exists()
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=24,
        messages=[{"role": "user", "content": "What is the door code for the Orsa Point lighthouse?"}],
    )
    e = r.model_extra["epic"]
    assert e["sources"][0]["doc"] == "orsa.txt" and e["chunk_misses"] == 0
    assert "5521" in r.choices[0].message.content, r.choices[0].message.content
    assert httpx.delete(server.url + "/api/documents/orsa.txt", headers=h).status_code == 200
    assert not (server.corpus / "orsa.txt").exists()


def test_metrics_after_real_requests(server, client):
    client.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=2, messages=[{"role": "user", "content": QUESTION}]
    )
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    # a request naming no policy runs the server's default, auto, and is counted under the policy auto ran
    assert DemoConfig().policy == "auto"
    ran = re.search(r'epic_rag_auto_policy_total\{ran="([\w-]+)"\} [1-9]', text)
    assert ran and ran[1] in ("legolink-16", "query-20"), text
    ok = 'epic_rag_chat_completions_total{{outcome="ok",policy="{}",stream="false"}}'
    assert any(ok.format(p) in text for p in ("legolink-16", "query-20")), text
    assert "epic_rag_time_to_first_token_seconds_count" in text
    assert "epic_rag_store_hits_total{tier=" in text and "epic_rag_linked_tokens_total" in text


def _compiled_text(server, doc: str) -> str:
    """The exact text the library compiled for a document's first chunk (what a client would paste)."""
    (c,) = [c for c in server.app.state.demo.library.chunks.values() if c.doc == doc and c.index == 0]
    assert c.ref is not None and c.ref.key
    return c.text


def test_openai_client_models_report_max_model_len(client, smol_engine):
    (m,) = client.models.list().data
    assert m.model_extra["max_model_len"] == smol_engine.max_model_len == 8192


def test_openai_client_completions_link_compiled_chunks_in_the_prompt(server, client):
    prompt = f"{_compiled_text(server, 'archive.txt')}\n\nQuestion: {QUESTION}\nAnswer: The passcode is"
    r = client.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=8)
    assert r.object == "text_completion" and "7314" in r.choices[0].text, r.choices[0].text
    e = r.model_extra["epic"]
    assert e["chunk_hits"] == 1 and e["linked_tokens"] > 0
    assert r.usage.prompt_tokens_details.cached_tokens == e["linked_tokens"]
    stream = client.completions.create(
        model="smollm2-135m-instruct",
        prompt=prompt,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text  # greedy: same text
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == e["linked_tokens"]


def test_openai_client_chat_without_server_retrieval_links_chunks_in_its_own_messages(server, client):
    context = _compiled_text(server, "archive.txt")
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=12,
        messages=[{"role": "user", "content": f"{context}\n\n{QUESTION}"}],
        extra_body={"use_retrieval": False},
    )
    e = r.model_extra["epic"]
    assert e["sources"] == [] and e["chunk_hits"] == 1 and e["linked_tokens"] > 0
    assert r.usage.prompt_tokens_details.cached_tokens == e["linked_tokens"]


def test_openai_client_usage_counts_linked_tokens_as_cached_in_the_stream(client):
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=4,
        stream=True,
        messages=[{"role": "user", "content": QUESTION}],
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    linked = [c for c in chunks if c.choices][-1].model_extra["epic"]["linked_tokens"]
    assert linked > 0 and chunks[-1].usage.prompt_tokens_details.cached_tokens == linked


def test_openai_client_sampling_seed_repeats_and_logprobs_come_back(client):
    def ask(seed):
        return client.chat.completions.create(
            model="smollm2-135m-instruct",
            max_tokens=12,
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            logprobs=True,
            top_logprobs=2,
            messages=[{"role": "user", "content": "Write a word."}],
            extra_body={"use_retrieval": False, "sampling_top_k": 50, "min_p": 0.01, "repetition_penalty": 1.05},
        )

    a, b = ask(3), ask(3)
    assert a.choices[0].message.content == b.choices[0].message.content
    content = a.choices[0].logprobs.content
    assert content and len(content) == a.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)


def test_openai_client_unsupported_fields_are_bad_requests_naming_them(client):
    with pytest.raises(openai.BadRequestError, match="'tools'"):
        client.chat.completions.create(
            model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        )
    with pytest.raises(openai.BadRequestError, match="n"):
        client.chat.completions.create(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "hi"}], n=2)


def test_openai_client_response_format_json_schema_answer_parses_and_still_links(client):
    schema = {
        "type": "object",
        "properties": {"passcode": {"type": "integer"}},
        "required": ["passcode"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        max_tokens=32,
        messages=[{"role": "user", "content": QUESTION}],
        response_format={"type": "json_schema", "json_schema": {"name": "Passcode", "schema": schema}},
    )
    got = json.loads(r.choices[0].message.content)
    assert set(got) == {"passcode"} and isinstance(got["passcode"], int)
    assert r.model_extra["epic"]["chunk_hits"] > 0  # retrieved chunks linked under the grammar too
    parsed = client.chat.completions.parse(  # the client's own pydantic path
        model="smollm2-135m-instruct",
        max_tokens=32,
        messages=[{"role": "user", "content": QUESTION}],
        response_format=_Passcode,
    )
    assert isinstance(parsed.choices[0].message.parsed, _Passcode)


class _Passcode(pydantic.BaseModel):
    passcode: int
