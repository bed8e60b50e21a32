"""Exactness of compile + link on a tiny random Llama (fp32)."""

from __future__ import annotations

import dataclasses
import itertools
import uuid

import pytest
import torch

from epic_rag import Chunk, ChunkRef, RagRequest, parse_policy
from epic_rag.engine.connector.epic import pending
from epic_rag.policy import SINK_LEN

CHUNKS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "import os\nimport sys\nprint(os.path.join(sys.prefix, 'lib'))\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n",
]
QUESTION = "which function subtracts?"


def _own() -> str:
    """A cache_salt of its own: the request reuses nothing from vLLM's prefix cache (it links again)."""
    return uuid.uuid4().hex


def _req(chunks=CHUNKS):
    return RagRequest(question=QUESTION, chunks=list(chunks))


def _full_on_same_tokens(engine, request, policy: str, max_tokens: int):
    """`full` over exactly the prompt tokens `policy` builds (with each chunk's sink where it keeps it)."""
    prep = engine.prepare(request, max_tokens=max_tokens, policy=policy)
    return engine.generate(dataclasses.replace(prep, policy=parse_policy("full")))


@pytest.mark.parametrize("policy", ["legolink-4096", "legolink-sink-4096", "legolink-99999999"])
def test_sink_form_legolink_with_k_at_least_chunk_length_equals_full(tiny_engine, policy):
    full = tiny_engine.generate(_req(), max_tokens=16, policy="full")
    linked = tiny_engine.generate(_req(), max_tokens=16, policy=policy)
    assert linked.chunk_hits + linked.chunk_misses == len(CHUNKS)
    assert linked.token_ids == full.token_ids and linked.prompt_tokens == full.prompt_tokens


def test_epic_form_legolink_with_k_at_least_span_length_equals_full_over_its_sink_tokens(tiny_engine):
    linked = tiny_engine.generate(_req(), max_tokens=16, policy="legolink-epic-4096")
    full = _full_on_same_tokens(tiny_engine, _req(), "legolink-epic-4096", 16)
    plain = tiny_engine.generate(_req(), max_tokens=16, policy="full")
    assert linked.prompt_tokens == full.prompt_tokens == plain.prompt_tokens + SINK_LEN * len(CHUNKS)
    assert linked.token_ids == full.token_ids


def test_chunk_linked_behind_the_default_prompt_equals_full_with_no_recompute(tiny_engine):
    # Chunks are compiled behind the compile lead (the default prompt up to its first document), so the
    # first document of a default RagRequest sits exactly where its KV was computed: linking it with no
    # recompute (legolink-0) is exact, the sink's KV included nowhere.
    req = _req(CHUNKS[2:])
    full = tiny_engine.generate(req, max_tokens=16, policy="full")
    linked = tiny_engine.generate(req, max_tokens=16, policy="legolink-0")
    assert linked.linked_tokens >= len(tiny_engine.chunks.place(Chunk(CHUNKS[2])).token_ids)
    assert linked.token_ids == full.token_ids


def test_compile_lead_is_the_default_prompt_up_to_its_first_document(tiny_engine):
    from epic_rag.prompt import compile_lead, encode_glue, render_request

    tok = tiny_engine.tokenizer
    lead = encode_glue(tok, render_request(tok, _req(CHUNKS[:1]))[0])
    assert tiny_engine.chunks.lead == compile_lead(tok) == lead
    prep = tiny_engine.prepare(_req(CHUNKS[:1]), policy="legolink-sink-4")  # exactly what precedes document 1
    assert prep.chunks[0].start == len(lead) and prep.token_ids[: len(lead)] == lead
    assert lead[0] == tok.bos_token_id and len(lead) > 8
    assert compile_lead(tok, "sink") == [tok.bos_token_id]  # EPIC's reference: the sink alone


def test_sink_form_chunk_at_position_zero_links_with_a_negative_shift(tiny_engine):
    segs = [Chunk(CHUNKS[2]), "\n# what does push do?\n"]
    full = tiny_engine.generate(segs, max_tokens=16, policy="full")
    assert tiny_engine.generate(segs, max_tokens=16, policy="legolink-sink-9999").token_ids == full.token_ids
    assert tiny_engine.generate(segs, max_tokens=4, policy="legolink-0").linked_tokens > 0


def test_naive_differs_from_full_when_chunks_follow_context(tiny_engine):
    # Chunks after other text were compiled without that context: reusing them unchanged is approximate.
    full = tiny_engine.generate(_req(), max_tokens=16, policy="full")
    naive = tiny_engine.generate(_req(), max_tokens=16, policy="naive")
    assert naive.recomputed_tokens < full.prompt_tokens
    assert naive.token_ids != full.token_ids


def test_every_permutation_links_without_recompiling(tiny_engine):
    tiny_engine.compile(CHUNKS)
    for perm in itertools.permutations(CHUNKS):
        g = tiny_engine.generate(_req(perm), max_tokens=2, policy="legolink-4")
        assert g.chunk_misses == 0 and g.chunk_hits == len(CHUNKS)


def test_compile_returns_content_keys_independent_of_order(tiny_engine):
    a = tiny_engine.compile(CHUNKS)
    b = tiny_engine.compile(list(reversed(CHUNKS)))
    assert [r.key for r in a] == [r.key for r in reversed(b)]
    assert all(isinstance(r, ChunkRef) and r.num_tokens > 0 for r in a)
    assert len({r.key for r in a}) == len(CHUNKS)


def test_chunk_refs_link_like_texts(tiny_engine):
    refs = tiny_engine.compile(CHUNKS)
    by_text = tiny_engine.generate(_req(), max_tokens=8, policy="legolink-4")
    by_ref = tiny_engine.generate(_req(refs), max_tokens=8, policy="legolink-4")
    assert by_ref.token_ids == by_text.token_ids


def test_linked_kv_never_served_to_exact_requests(tiny_engine):
    # Run a linked request first, then the same prompt with full recompute: the prefix cache must not
    # hand the linked (approximate) KV to the exact request.
    first_full = tiny_engine.generate(_req(), max_tokens=12, policy="full")
    tiny_engine.generate(_req(), max_tokens=12, policy="naive")
    again = tiny_engine.generate(_req(), max_tokens=12, policy="full")
    assert again.token_ids == first_full.token_ids


def test_one_compile_without_a_policy_serves_every_policy_with_no_misses(tiny_engine):
    chunks = [c.replace("a", "q") for c in CHUNKS]  # texts no other test compiled
    refs = tiny_engine.compile(chunks)
    assert all(r.key.startswith(f"{tiny_engine.chunks.variant}-") for r in refs)
    for pol in (
        "legolink-0",
        "legolink-2",
        "legolink-16",
        "legolink-epic-16",
        "legolink-sink-16",
        "naive",
        "cacheblend-15",
        "full",
        "prefix",
    ):
        g = tiny_engine.generate(_req(chunks), max_tokens=2, policy=pol)
        assert g.chunk_misses == 0, pol
        if parse_policy(pol).links_chunks:
            assert g.chunk_keys == [r.key for r in refs] and g.chunk_hits == len(chunks), pol


def test_cacheblend_recomputes_a_fraction_of_chunk_tokens(tiny_engine):
    g0 = tiny_engine.generate(_req(), max_tokens=4, policy="naive", cache_salt=_own())
    g15 = tiny_engine.generate(_req(), max_tokens=4, policy="cacheblend-15", cache_salt=_own())
    g100 = tiny_engine.generate(_req(), max_tokens=16, policy="cacheblend-100")
    span_tokens = sum(r.num_tokens + SINK_LEN for r in tiny_engine.compile(CHUNKS))  # sinks are candidates too
    assert g15.recomputed_tokens - g0.recomputed_tokens == round(0.15 * span_tokens)
    assert g100.token_ids == _full_on_same_tokens(tiny_engine, _req(), "cacheblend-100", 16).token_ids


def test_query_aware_link_recomputing_every_chunk_token_equals_full(tiny_engine):
    # query-100: the probe's picks are every chunk token, so the main pass is a full prefill of the claim
    g = tiny_engine.generate(_req(CHUNKS[::-1]), max_tokens=16, policy="query-100")
    assert g.token_ids == tiny_engine.generate(_req(CHUNKS[::-1]), max_tokens=16, policy="full").token_ids


def test_query_aware_link_recomputes_its_ratio_of_chunk_tokens_beside_the_uncached_ones(tiny_engine):
    naive = tiny_engine.generate(_req(), max_tokens=4, policy="legolink-0")  # the same prompt, nothing picked
    g = tiny_engine.generate(_req(), max_tokens=4, policy="query-20")
    chunk_tokens = sum(r.num_tokens for r in tiny_engine.compile(CHUNKS))
    picked = g.recomputed_tokens - naive.recomputed_tokens
    assert picked == round(0.2 * chunk_tokens)  # the top 20 % by the question's attention
    assert g.prompt_tokens == naive.prompt_tokens and g.linked_tokens == naive.linked_tokens - picked


def test_stream_yields_the_same_text_as_generate(tiny_engine):
    g = tiny_engine.generate(_req(), max_tokens=10, policy="legolink-4")
    pieces = list(tiny_engine.stream(_req(), max_tokens=10, policy="legolink-4"))
    assert len(pieces) >= 1 and "".join(pieces) == g.text


async def test_async_generate_and_stream_match_sync(tiny_engine):
    g = tiny_engine.generate(_req(), max_tokens=10, policy="legolink-4")
    ag = await tiny_engine.agenerate(_req(), max_tokens=10, policy="legolink-4")
    pieces = [p async for p in tiny_engine.astream(_req(), max_tokens=10, policy="legolink-4")]
    assert ag.token_ids == g.token_ids and "".join(pieces) == g.text


async def test_concurrent_requests_are_batched_and_each_exact(tiny_engine):
    import asyncio

    perms = list(itertools.permutations(CHUNKS))
    refs = [tiny_engine.generate(_req(p), max_tokens=8, policy="full").token_ids for p in perms]
    got = await asyncio.gather(*[tiny_engine.agenerate(_req(p), max_tokens=8, policy="legolink-4096") for p in perms])
    assert [g.token_ids for g in got] == refs


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: RagRequest(question="q", chunks=[]), "at least one chunk"),
        (lambda: RagRequest(question="q", chunks=[""]), "empty"),
        (lambda: RagRequest(question="q", chunks=["   \n\t "]), "empty"),
        (lambda: RagRequest(question="   ", chunks=["x"]), "question"),
        (lambda: RagRequest(question="q", chunks=["word " * 3000]), "context window"),
        (lambda: RagRequest(question="q", chunks=[ChunkRef("plain-doesnotexist", 3)]), "not in the store"),
        (lambda: RagRequest(question="q", chunks=[42]), "string"),
        (lambda: 12345, "RagRequest"),
        (lambda: b"raw bytes", "RagRequest"),
        (lambda: "", "empty"),
    ],
)
def test_bad_requests_raise_clear_errors_and_engine_keeps_serving(tiny_engine, make, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.generate(make(), max_tokens=4)
    assert tiny_engine.generate(_req(), max_tokens=2).token_ids


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"policy": "legolink"}, "unknown policy"),
        ({"policy": "cacheblend-500"}, "unknown policy"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_generation_arguments_raise(tiny_engine, kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_engine.generate(_req(), **kwargs)
    assert tiny_engine.generate(_req(), max_tokens=2).token_ids


def test_compile_rejects_bad_chunks_without_storing_anything(tiny_engine):
    before = set(tiny_engine.store.keys())
    with pytest.raises(ValueError):
        tiny_engine.compile(["fine chunk text", "  "])
    with pytest.raises(ValueError):
        tiny_engine.compile("a single string")
    assert set(tiny_engine.store.keys()) == before


def test_prefix_policy_reuses_exact_prefixes_and_matches_full(tiny_engine):
    full = tiny_engine.generate(_req(), max_tokens=8, policy="full")
    tiny_engine.generate(_req(), max_tokens=8, policy="prefix")
    again = tiny_engine.generate(_req(), max_tokens=8, policy="prefix")
    assert again.prefix_cached_tokens > 0 and again.recomputed_tokens < again.prompt_tokens
    assert again.token_ids == full.token_ids and again.chunk_hits == 0


def test_a_failed_link_is_never_served(tiny_engine, monkeypatch):
    from epic_rag.engine.link import linker

    def broken(self, p, deadline=None):
        raise RuntimeError("simulated linker fault")

    monkeypatch.setattr(linker.Linker, "advance", broken)
    with pytest.raises(RuntimeError, match="finish reason 'error'"):
        tiny_engine.generate(_req(), max_tokens=4, policy="legolink-4", cache_salt=_own())
    monkeypatch.undo()
    assert tiny_engine.generate(_req(), max_tokens=4, policy="legolink-4", cache_salt=_own()).token_ids


def test_chunks_gone_from_the_store_are_compiled_again_and_the_request_answered_as_before(tiny_engine, caplog):
    before = tiny_engine.generate(_req(), max_tokens=4, policy="legolink-4", cache_salt=_own())  # compiled and stored
    tiny_engine.store.clear()  # evicted (or lost with a Redis restart) after the engine saw them stored...
    tiny_engine.chunks.stores.recent.clear()  # ...and no longer among this process's recent compiles
    gone = tiny_engine.generate(_req(), max_tokens=4, policy="legolink-4", cache_salt=_own())
    assert "retrying once" in caplog.text  # the link failed on the worker; the engine checked and retried
    assert gone.chunk_misses == len(CHUNKS)  # ...recompiling them
    assert gone.token_ids == before.token_ids and gone.linked_tokens == before.linked_tokens
    assert pending() == 0 and tiny_engine.runtime.idle()


def test_leading_glue_is_linked_exactly_and_not_recomputed(tiny_engine):
    # The template text before the first chunk sits at position 0: its compiled KV is exact.
    chunk_tokens = sum(r.num_tokens for r in tiny_engine.compile(CHUNKS))  # compiled first: every chunk hits
    naive = tiny_engine.generate(_req(), max_tokens=8, policy="naive")
    assert naive.linked_tokens > chunk_tokens
    assert naive.chunk_hits == len(CHUNKS) and len(naive.chunk_keys) == len(CHUNKS)
    segs = ["x" * 40, Chunk(CHUNKS[0]), "\nq?"]
    exact = tiny_engine.generate(segs, max_tokens=8, policy="legolink-4096")
    assert exact.token_ids == tiny_engine.generate(segs, max_tokens=8, policy="full").token_ids


async def test_cancelling_during_setup_aborts_the_submitted_request(tiny_engine, monkeypatch):
    import asyncio
    import time

    req = _req(["a chunk compiled on the fly, " * 20])  # a prompt the tiny model answers at full length
    ref = await tiny_engine.agenerate(req, max_tokens=1500, policy="legolink-4")
    if ref.finish_reason != "length" or ref.total_s < 3.0:
        pytest.skip("the tiny model stopped early: no long generation to cut short")
    link_spans = tiny_engine.chunks.link_spans

    def slow_link_spans(*a, **k):  # a setup that takes a while (as compiling a long chunk does)
        time.sleep(0.5)
        return link_spans(*a, **k)

    monkeypatch.setattr(tiny_engine.chunks, "link_spans", slow_link_spans)
    task = asyncio.ensure_future(tiny_engine.agenerate(req, max_tokens=1500, policy="legolink-4"))
    await asyncio.sleep(0.1)  # inside setup
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # Setup then finishes and submits; the request must be aborted long before its 1500 tokens are done.
    await asyncio.sleep(0.5 + ref.total_s / 3)
    assert not tiny_engine.runtime.llm.has_unfinished_requests(), "the request ran on after its caller was cancelled"


def test_compile_of_stored_chunks_checks_existence_without_loading(tiny_engine, monkeypatch):
    tiny_engine.compile(CHUNKS)
    monkeypatch.setattr(tiny_engine.store, "get", lambda key: pytest.fail("compile loaded stored KV"))
    assert [r.key for r in tiny_engine.compile(CHUNKS)]


def test_full_and_prefix_read_chunk_tokens_without_loading_chunk_kv(tiny_engine, monkeypatch):
    refs = tiny_engine.compile(CHUNKS)
    bare = [ChunkRef(r.key, r.num_tokens) for r in refs]  # no text: tokens come from the engine's token index
    expected = tiny_engine.generate(_req(), max_tokens=2, policy="full").prompt_tokens
    monkeypatch.setattr(tiny_engine.store, "get", lambda key: pytest.fail("a policy without links loaded KV"))
    for pol in ("full", "prefix"):
        for chunks in (refs, bare):
            assert tiny_engine.generate(_req(chunks), max_tokens=2, policy=pol).prompt_tokens == expected


def test_sampling_keywords_beside_a_prepared_request_are_an_error_not_ignored(tiny_engine):
    prep = tiny_engine.prepare(_req(), max_tokens=3, policy="full")
    with pytest.raises(ValueError, match="max_tokens"):
        tiny_engine.generate(prep, max_tokens=50)
    assert len(tiny_engine.generate(prep).token_ids) <= 3


def test_leading_glue_is_never_written_to_the_shared_store(tiny_engine):
    from epic_rag.store import MemoryStore

    old = tiny_engine.store
    tiny_engine.store = MemoryStore()
    try:
        req = RagRequest(question="When?", chunks=CHUNKS[:1], system="A client's own long system prompt, " * 4)
        first = tiny_engine.generate(req, max_tokens=4, policy="legolink-4")
        again = tiny_engine.generate(req, max_tokens=4, policy="legolink-4")
        assert first.token_ids == again.token_ids
        keys = tiny_engine.store.keys()
        assert keys and all(k.startswith(f"{tiny_engine.chunks.variant}-") for k in keys), keys
        assert any(k.startswith("plain-") for k in tiny_engine.chunks.glue.keys())  # cached in-process instead
    finally:
        tiny_engine.store = old


def _in_one_step(engine, calls):
    """Run `calls` (each makes one engine request) from threads, with the engine thread held before it adds
    new requests until all of them wait in its inbox: vLLM then gets them together and schedules (so the
    connector links) them in the same step. Returns each call's result or the exception it raised."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    rt = engine.runtime
    gate, held, lock = threading.Event(), threading.Event(), threading.Lock()
    drain, submit = rt._drain, rt.submit
    submitted = [0]  # requests put in the inbox (finished requests put aborts there too: not counted)

    def hold():
        held.set()
        gate.wait()  # always set by the finally below
        drain()

    def counted_submit(*a, **k):
        submit(*a, **k)
        with lock:
            submitted[0] += 1

    def outcome(call):
        try:
            return call()
        except Exception as e:
            return e

    rt._drain, rt.submit = hold, counted_submit  # the engine thread's next loop waits in hold
    with ThreadPoolExecutor(len(calls)) as pool:
        try:
            assert held.wait(30), "the engine thread did not come round to take new requests"
            futs = [pool.submit(outcome, c) for c in calls]
            deadline = time.monotonic() + 300
            while submitted[0] < len(calls) and time.monotonic() < deadline:
                time.sleep(0.01)
            queued = submitted[0]
        finally:  # the engine thread is never left held, even when this fails
            del rt._drain, rt.submit
            gate.set()
        results = [f.result() for f in futs]
    assert queued == len(calls), f"{queued} of {len(calls)} requests reached the engine together: {results}"
    return results


def _linker():
    from epic_rag.engine import vllm_api

    return vllm_api.kv_connector().linker  # in-process engine core: the worker's connector is this process's


BATCH = [  # (chunks, policy): different chunk orders and lengths
    (CHUNKS, "legolink-16"),
    (CHUNKS[::-1], "legolink-16"),
    (CHUNKS[1:], "legolink-16"),
    ([CHUNKS[2], CHUNKS[0]], "legolink-16"),
]
MIXED = [
    (CHUNKS, "naive"),
    (CHUNKS[::-1], "legolink-9999"),
    ([CHUNKS[2], CHUNKS[0], CHUNKS[1]], "cacheblend-15"),
    (CHUNKS[1:], "legolink-16"),
    (CHUNKS, "cacheblend-15"),
    ([CHUNKS[1], CHUNKS[2], CHUNKS[0]], "query-20"),
]


@pytest.mark.parametrize("batch", [BATCH, MIXED], ids=["legolink-16", "mixed-policies"])
def test_requests_linked_in_one_step_are_recomputed_in_one_batch_and_equal_one_by_one(tiny_engine, batch):
    one_by_one = [tiny_engine.generate(_req(c), max_tokens=12, policy=p, cache_salt=_own()) for c, p in batch]
    before = dict(_linker().batch_sizes)
    got = _in_one_step(  # salts of their own: linked again, not found in vLLM's prefix cache
        tiny_engine,
        [lambda c=c, p=p: tiny_engine.generate(_req(c), max_tokens=12, policy=p, cache_salt=_own()) for c, p in batch],
    )
    sizes = _linker().batch_sizes
    assert sizes[len(batch)] == before.get(len(batch), 0) + 1, dict(sizes)  # one pass linked all of them
    for (chunks, pol), ref, g in zip(batch, one_by_one, got):
        assert not isinstance(g, Exception), (pol, g)
        assert g.token_ids == ref.token_ids, pol
        assert g.recomputed_tokens == ref.recomputed_tokens and g.linked_tokens == ref.linked_tokens, pol
        if pol == "legolink-9999":  # recomputes every chunk token: exact
            assert g.token_ids == tiny_engine.generate(_req(chunks), max_tokens=12, policy="full").token_ids


def test_one_bad_job_in_a_batch_fails_only_its_request(tiny_engine, monkeypatch, caplog):
    from epic_rag.engine.jobs import LinkJob

    initial_recompute = LinkJob.initial_recompute

    def drops_uncached_tokens(self):  # the legolink-7 job's own data is broken: nothing recomputed
        return initial_recompute(self)[:0] if self.policy.name == "legolink-7" else initial_recompute(self)

    batch = [(CHUNKS, "legolink-16"), (CHUNKS[::-1], "legolink-7"), (CHUNKS[1:], "cacheblend-15")]
    refs = [tiny_engine.generate(_req(c), max_tokens=8, policy=p, cache_salt=_own()) for c, p in batch]
    monkeypatch.setattr(LinkJob, "initial_recompute", drops_uncached_tokens)
    before = dict(_linker().batch_sizes)
    got = _in_one_step(  # salts of their own: linked again, not found in vLLM's prefix cache
        tiny_engine,
        [lambda c=c, p=p: tiny_engine.generate(_req(c), max_tokens=8, policy=p, cache_salt=_own()) for c, p in batch],
    )
    assert _linker().batch_sizes[2] == before.get(2, 0) + 1  # the two good ones still linked together
    assert isinstance(got[1], RuntimeError) and "finish reason 'error'" in str(got[1])
    assert "uncached token not recomputed" in caplog.text  # the cause, logged by the worker
    assert [g.token_ids for g in (got[0], got[2])] == [refs[0].token_ids, refs[2].token_ids]


def test_a_fault_in_the_batched_pass_fails_every_request_of_the_batch_and_the_engine_keeps_serving(
    tiny_engine, monkeypatch, caplog
):
    from epic_rag.engine import vllm_api

    def broken(*a, **k):
        raise RuntimeError("simulated fault in a decoder layer")

    batch = [(CHUNKS, "legolink-16"), (CHUNKS[::-1], "naive")]
    monkeypatch.setattr(vllm_api, "decoder_layer_forward", broken)
    got = _in_one_step(  # salts of their own: linked again, not found in vLLM's prefix cache
        tiny_engine,
        [lambda c=c, p=p: tiny_engine.generate(_req(c), max_tokens=4, policy=p, cache_salt=_own()) for c, p in batch],
    )
    for g in got:
        assert isinstance(g, RuntimeError) and "finish reason 'error'" in str(g), g
    assert "simulated fault" in caplog.text
    monkeypatch.undo()
    assert pending() == 0
    assert tiny_engine.generate(_req(), max_tokens=4, policy="legolink-16").token_ids


def test_a_batch_mixing_kernel_and_buffer_attention_equals_one_by_one(tiny_engine, monkeypatch):
    from epic_rag.engine.link.layout import CpuAttnLayout

    # Which requests attend with the kernel: those with an even number of recomputed tokens (a property of
    # the request alone, so one by one and batched take the same paths); the rest attend over buffers.
    can_attend, attention_plan, planned = CpuAttnLayout.can_attend, CpuAttnLayout.attention_plan, []

    def plan(self, cache, seqs, attn):
        planned.append(len(seqs))
        return attention_plan(self, cache, seqs, attn)

    monkeypatch.setattr(
        CpuAttnLayout, "can_attend", lambda self, R, a, b: can_attend(self, R, a, b) and len(R) % 2 == 0
    )
    monkeypatch.setattr(CpuAttnLayout, "attention_plan", plan)
    refs = [tiny_engine.generate(_req(c), max_tokens=12, policy=p) for c, p in MIXED]
    planned.clear()
    got = _in_one_step(
        tiny_engine, [lambda c=c, p=p: tiny_engine.generate(_req(c), max_tokens=12, policy=p) for c, p in MIXED]
    )
    assert any(0 < n < len(MIXED) for n in planned), planned  # one kernel call for some, buffers for the others
    assert [g.token_ids for g in got] == [r.token_ids for r in refs]


def test_links_beyond_the_workspace_run_in_several_passes_and_equal_one_by_one(tiny_engine, monkeypatch):
    refs = [tiny_engine.generate(_req(c), max_tokens=12, policy=p, cache_salt=_own()) for c, p in BATCH]
    linker = _linker()
    # Room for the longest request's claim and little more: the step's links need several passes.
    monkeypatch.setattr(linker, "workspace_tokens", max(r.prompt_tokens for r in refs))
    before = sum(linker.batch_sizes.values())
    got = _in_one_step(
        tiny_engine,
        [lambda c=c, p=p: tiny_engine.generate(_req(c), max_tokens=12, policy=p, cache_salt=_own()) for c, p in BATCH],
    )
    assert sum(linker.batch_sizes.values()) - before >= 2
    assert [g.token_ids for g in got] == [r.token_ids for r in refs]


def test_linker_on_the_flash_attention_plan_and_kernel_contract_equals_one_by_one_and_full(tiny_engine, monkeypatch):
    # The CUDA path cannot run here. This runs the linker through FlashAttnLayout's kernel path as far as a CPU
    # allows: its any-number-of-runs rule (CacheBlend's scattered picks attend with the kernel too), the shared
    # RunPlan, and a kernel written from FlashAttention's varlen contract reading vLLM's CPU pages.
    from epic_rag.engine.link.layout import CpuAttnLayout, FlashAttnLayout, RunPlan
    from epic_rag.testing.varlen import ReferenceFlashKernels

    kernels = ReferenceFlashKernels()

    def attend(self, plan, attn, cache, q, k, v):
        n, H, D = len(plan.slots), attn.num_kv_heads, attn.head_size
        self.write(cache, plan.slots, k.reshape(n, H, D), v.reshape(n, H, D))
        kview, vview = self._views(cache)  # [B, H, D, N], [B, H, N, D] -> FlashAttention's [B, N, H, D]
        out = torch.empty((n, attn.num_heads, D), dtype=q.dtype)
        kernels.varlen(attn, q.reshape(n, -1, D), kview.permute(0, 3, 1, 2), vview.permute(0, 2, 1, 3), out, plan)
        return out.view(n, -1)

    refs = [tiny_engine.generate(_req(c), max_tokens=12, policy=p) for c, p in MIXED]
    monkeypatch.setattr(CpuAttnLayout, "can_attend", FlashAttnLayout.can_attend)
    monkeypatch.setattr(
        CpuAttnLayout, "attention_plan", lambda self, cache, seqs, attn: RunPlan.build(seqs, cache.shape[2])
    )
    monkeypatch.setattr(CpuAttnLayout, "attend", attend)
    got = _in_one_step(
        tiny_engine, [lambda c=c, p=p: tiny_engine.generate(_req(c), max_tokens=12, policy=p) for c, p in MIXED]
    )
    assert kernels.calls > 0
    for (_, pol), ref, g in zip(MIXED, refs, got):
        assert g.token_ids == ref.token_ids, pol
    full = tiny_engine.generate(_req(MIXED[1][0]), max_tokens=12, policy="full")
    assert got[1].token_ids == full.token_ids  # legolink-9999 through the kernel contract: exact


def test_a_link_while_others_decode_runs_a_layer_a_step_and_equals_the_same_link_run_alone(tiny_engine, monkeypatch):
    import threading

    from epic_rag.engine import vllm_api
    from epic_rag.engine.link import linker

    alone = tiny_engine.generate(
        _req(CHUNKS[::-1]), max_tokens=12, policy="legolink-16", cache_salt=_own()
    )  # idle steps: whole
    monkeypatch.setattr(vllm_api.kv_connector()._budget, "share", 0.0)  # a busy step: one layer of a link
    calls = []  # (pass, layers run, without a budget)
    advance = linker.Linker.advance

    def counted(self, p, more=None):
        before = p.layer
        done = advance(self, p, more)
        calls.append((id(p), p.layer - before, more is None))
        return done

    monkeypatch.setattr(linker.Linker, "advance", counted)
    decoding, finished = threading.Event(), []

    def long_decode():  # keeps every step busy while the link runs
        for _ in tiny_engine.stream("count to a thousand", max_tokens=300, policy="full", ignore_eos=True):
            decoding.set()
        finished.append(True)

    t = threading.Thread(target=long_decode)
    t.start()
    if not decoding.wait(60):
        t.join(1)
        pytest.fail("the plain request never streamed")
    got = tiny_engine.generate(_req(CHUNKS[::-1]), max_tokens=12, policy="legolink-16", cache_salt=_own())
    still_decoding = not finished
    t.join(120)
    assert still_decoding and finished  # the link ran while the other request decoded, which then ended
    assert got.token_ids == alone.token_ids and got.recomputed_tokens == alone.recomputed_tokens
    assert got.linked_tokens == alone.linked_tokens > 0
    layers = len(_linker().layers)
    assert [(n, whole) for _, n, whole in calls] == [(1, False)] * layers  # one pass, one layer a step
    assert pending() == 0
