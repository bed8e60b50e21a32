"""EpicConnector inside stock `vllm serve` (vLLM's own OpenAI server, its engine core in its own process),
driven with the `openai` client: chunks are compiled through the server with the documented request form,
then linked in shuffled order by naming their spans in `kv_transfer_params`, and found by the server in a
prompt that names nothing. On the one-layer tiny model a linked chunk's KV is exact when it is right, so
`legolink-0` (nothing recomputed) and `legolink-9999` must answer exactly like the plain prompt, and the
response must report every span linked; with one worker and with two tensor-parallel workers (one KV head
each). The server is started as the serve benchmark starts it (epic_rag.bench.serve.start_server)."""

from __future__ import annotations

import pytest
from _tiny_serve import CHUNKS, serve_tiny

from epic_rag.engine.connector.tenancy import unique_salt

pytestmark = pytest.mark.slow  # starts vLLM's own OpenAI server processes


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(tmp_path_factory, request):
    if request.param == 1:  # the session's one-worker server (the red-team tests' too: another tenant)
        yield request.getfixturevalue("tiny_serve")
        return
    # tensor parallel workers: one KV head each; these machines need manual binding
    args, env = ["--tensor-parallel-size", str(request.param)], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    yield from serve_tiny(tmp_path_factory, "serve-tp", args, env)


def _complete(client, prompt: list[int], max_tokens: int, params: dict | None = None, **extra):
    # one tenant (its chunks are linked and found only under its namespace), no prefix-cache hit between them
    body = dict(extra, return_token_ids=True, cache_salt=unique_salt("serve-test"))
    if params is not None:
        body["kv_transfer_params"] = params
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body=body)
    return list(r.choices[0].token_ids), (r.model_extra or {}).get("kv_transfer_params")


def test_vllm_serve_with_epic_connector_compiles_and_links_shuffled_chunks_like_the_plain_prompt(server):
    from openai import OpenAI

    url, tok, log = server
    client = OpenAI(base_url=url, api_key="none")
    sink = tok.bos_token_id
    chunk_ids = [tok(c, add_special_tokens=False).input_ids for c in CHUNKS]
    keys = []
    for ids in chunk_ids:  # compile: the lead (here the sink alone) and the chunk; the server names the key
        _, params = _complete(
            client, [sink] + ids, 2, {"epic": {"compile": {"lead": 1}}}, min_tokens=2, ignore_eos=True
        )
        assert params and "stored" in params["epic"], (params, log.read_text()[-3000:])
        keys.append(params["epic"]["stored"])
    assert len(set(keys)) == len(CHUNKS) and all(k.startswith("sink1-") for k in keys)
    question = tok("\nwhich function multiplies by 2?", add_special_tokens=False).input_ids
    prompt, spans = [], []
    for i in (2, 0, 1):  # shuffled
        spans.append([keys[i], 0, len(prompt), 1 + len(chunk_ids[i]), False])
        prompt += [sink] + chunk_ids[i]
    prompt += question
    plain, _ = _complete(client, prompt, 12, {"epic": {"find": False}})  # computed without linking
    for policy in ("legolink-9999", "legolink-0"):
        link = {"epic": {"link": {"policy": policy, "sink": sink, "spans": spans}}}
        linked, params = _complete(client, prompt, 12, link)
        assert linked == plain, policy  # token for token
        assert params["epic"]["linked_spans"] == len(CHUNKS) and params["epic"]["missing"] == [], params
    # a prompt that names nothing: the server finds the compiled chunks in its tokens and links them
    found, params = _complete(client, prompt, 12)
    assert found == plain and params["epic"]["linked_spans"] == len(CHUNKS), params
    # a span naming a record that was never compiled is recomputed: still the plain answer, reported missing
    bad = [list(s) for s in spans]
    bad[1][0] = "sink1-" + "0" * 40
    linked, params = _complete(
        client, prompt, 12, {"epic": {"link": {"policy": "legolink-0", "sink": sink, "spans": bad}}}
    )
    assert linked == plain and params["epic"]["missing"] == [bad[1][0]], params
    # a malformed link is refused by name and the request is computed without linking
    linked, params = _complete(client, prompt, 12, {"epic": {"link": {"policy": "legolink-0", "spans": []}}})
    assert linked == plain and "spans must be a non-empty list" in params["epic"]["error"], params
