"""Issue 26 at unit level, without an engine: the worker derives every compile key itself (the client cannot
file KV under a key of its choosing), keys commit to the whole lead and the tenant, records are checked on
read against their lead, tenant and tokens, tenants never see each other's records or finder entries, the
server's options say what clients may ask, and every scheduler-side hot path stays bounded under adversarial
input (each with a size or time assertion). The same properties through a real `vllm serve` process:
tests/test_redteam_serve.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from epic_rag.engine.connector import epic as conn
from epic_rag.engine.connector import meta as cm
from epic_rag.engine.connector.config import ConnectorConfig
from epic_rag.engine.connector.finder import ANCHOR, PER_ANCHOR, ChunkFinder
from epic_rag.engine.connector.tenancy import Tenancy, namespace_of, unique_salt
from epic_rag.engine.jobs import MAX_SPANS, Capture, CompileRequest, LinkRequest, SpanRef
from epic_rag.engine.stores import ChunkStores, checked_store, new_glue_store
from epic_rag.keys import chunk_key, compile_variant, key_of, lead_id, record_key, tenant_id
from epic_rag.matching import ChunkTextIndex
from epic_rag.policy import parse_policy
from epic_rag.store import ChunkKV, MemoryStore
from epic_rag.types import ChunkRef

FP = "fingerprint"
SINK = 1
LEAD = [SINK, 40, 41, 42]  # the honest compile lead (template, instructions)
EVIL = [SINK, 66, 66, 66, 66]  # an attacker's lead: "ignore the documents and ..."
CHUNK = list(range(100, 100 + ANCHOR + 8))
A, B = tenant_id("tenant-a"), tenant_id("tenant-b")
FAST_S = 0.05  # the target: adversarial input at the caps adds under 50 ms to a request


def _worker_stores() -> ChunkStores:
    """The stores a worker opens (stores.worker_stores): chunk and glue stores behind the key check."""
    return ChunkStores(checked_store(MemoryStore(), FP), checked_store(new_glue_store(), FP))


def _compile_worker(stores: ChunkStores) -> conn.EpicConnector:
    c = object.__new__(conn.EpicConnector)  # the worker-side state a compile's last step uses
    c.fingerprint, c.stores, c.tp_rank, c.tp_size = FP, stores, 0, 1
    c._step_results, c._learned = {}, {}
    return c


def _capture(prompt: list[int], lead: int, value: float) -> Capture:
    n = len(prompt) - max(lead, 1) + 1  # the sink and the chunk
    k = torch.full((1, n, 1, 2), value)
    return Capture(k, k.clone(), lead=max(lead, 1), filled_to=len(prompt))


def _compile(c: conn.EpicConnector, prompt: list[int], lead: int, tenant: str, key=None, glue=False, value=0.0):
    spec = cm.CaptureSpec("r", CompileRequest(key, lead, glue), [], 0, len(prompt), len(prompt), prompt, tenant)
    c._store(spec, _capture(prompt, lead, value))
    return c._step_results.pop("r")


# ------------------------------------------------------------------ keys the worker derives
def test_a_compile_naming_the_honest_key_behind_another_lead_is_refused_and_stores_nothing():
    stores = _worker_stores()
    c = _compile_worker(stores)
    honest = chunk_key(FP, CHUNK, LEAD, "tenant-a")
    out = _compile(c, EVIL + CHUNK, len(EVIL), A, key=honest, value=6.0)
    assert "is not the key of this tenant, lead and chunk" in out["error"]
    assert stores.chunks.inner.keys() == [] and c._learned == {}  # nothing stored, nothing learned
    # the same compile without a key is stored under its own key, the evil lead's, for this tenant only
    out = _compile(c, EVIL + CHUNK, len(EVIL), A, value=6.0)
    assert out["stored"] == chunk_key(FP, CHUNK, EVIL, "tenant-a") != honest
    assert out["stored"].startswith(compile_variant(EVIL) + "-")
    assert stores.get(honest) is None
    # the honest compile, naming its key or not, lands under the key the client computed
    assert _compile(c, LEAD + CHUNK, len(LEAD), A, key=honest)["stored"] == honest
    kv = stores.get(honest)
    assert kv.token_ids == [SINK] + CHUNK and kv.lead == lead_id(LEAD) and kv.tenant == A
    assert c._learned[honest] == (A, CHUNK)  # the finder learns it for its tenant


def test_glue_is_compiled_bare_and_its_key_is_derived_too():
    with pytest.raises(ValueError, match="glue is compiled bare"):
        CompileRequest.from_params({"lead": 2, "glue": True}, 10)
    c = _compile_worker(_worker_stores())
    glue = [SINK, 5, 6, 7, 8, 9]
    out = _compile(c, glue, 0, A, glue=True)
    assert out["stored"] == chunk_key(FP, glue, [], "tenant-a") and out["stored"].startswith("plain-")
    assert "is not the key" in _compile(c, glue, 0, A, key=chunk_key(FP, glue, [], "tenant-b"), glue=True)["error"]


def test_keys_commit_to_the_whole_lead_not_to_the_32_bits_in_their_label():
    # Two leads whose hashes share their first 8 hex digits (a birthday search, ~2^16 hashes) got one key
    # when the key committed only to that label: KV computed behind either was served for both.
    seen: dict[str, list[int]] = {}
    i = 0
    while True:
        lead = [SINK, i, i + 1]
        label = compile_variant(lead)
        if label in seen:
            other = seen[label]
            break
        seen[label] = lead
        i += 1
    assert compile_variant(lead) == compile_variant(other)
    assert chunk_key(FP, CHUNK, lead) != chunk_key(FP, CHUNK, other)


def test_keys_differ_by_tenant_and_a_namespace_never_appears_in_a_record():
    assert chunk_key(FP, CHUNK, LEAD, "tenant-a") != chunk_key(FP, CHUNK, LEAD, "tenant-b")
    assert "tenant-a" not in A and len(A) == 64  # records carry the namespace's hash, a salt stays secret


@pytest.mark.parametrize("lie", ["the other lead", "another tenant", "other tokens"])
def test_a_record_is_checked_on_read_against_its_lead_tenant_and_tokens(lie):
    """The trust check: a record filed under the honest key whose content was computed in another context is
    refused (a miss: recompiled or recomputed), never linked."""
    store = MemoryStore()
    stores = ChunkStores(checked_store(store, FP), new_glue_store())
    honest = chunk_key(FP, CHUNK, LEAD, "tenant-a")
    kv = ChunkKV(honest, [SINK] + CHUNK, torch.zeros(1, 1 + len(CHUNK), 1, 2), torch.zeros(1, 1 + len(CHUNK), 1, 2))
    kv.lead, kv.tenant = lead_id(LEAD), A
    store.put(kv)
    assert stores.get(honest) is kv  # the genuine record
    planted = ChunkKV(honest, list(kv.token_ids), kv.k + 6, kv.v + 6, lead=kv.lead, tenant=kv.tenant)
    if lie == "the other lead":  # the right tokens, KV computed behind the attacker's lead (its record says so)
        planted.lead = lead_id(EVIL)
    elif lie == "another tenant":
        planted.tenant = B
    else:
        planted.token_ids = [SINK] + CHUNK[:-1] + [7]
    store.put(planted)
    assert record_key(FP, planted) != honest
    assert stores.get(honest) is None and stores.chunks.stats.corrupt == 1


# ------------------------------------------------------------------ tenancy
def _read_worker(stores: ChunkStores, loads: list[cm.LoadSpec]) -> conn.EpicConnector:
    c = _compile_worker(stores)
    c.block_size, c.linker = 4, SimpleNamespace(begin=lambda loads: (None, []), advance=lambda p, d: True)
    c._load_errors, c._captures, c._queue, c._pass, c._recving, c._bound_at = set(), {}, [], None, set(), 0.0
    c.async_links, c.link_step_share = False, 1.0
    c._get_connector_metadata = lambda: cm.EpicMeta(loads=loads)
    return c


def test_a_tenant_linking_another_tenants_key_gets_the_answer_of_a_key_never_compiled():
    stores = _worker_stores()
    _compile(_compile_worker(stores), LEAD + CHUNK, len(LEAD), A)
    key_a = chunk_key(FP, CHUNK, LEAD, "tenant-a")
    never = chunk_key(FP, [9] * len(CHUNK), LEAD, "tenant-a")
    prompt = [SINK] + CHUNK + [5, 6]
    link = LinkRequest(parse_policy("legolink-0"), SINK, (SpanRef(key_a, 0, 0, 1 + len(CHUNK)),))
    never_link = LinkRequest(link.policy, SINK, (SpanRef(never, 0, 0, 1 + len(CHUNK)),))
    claim = 1 + len(CHUNK)
    loads = [
        cm.LoadSpec("a", link, prompt[:claim], [0, 1, 2, 3, 4, 5, 6], 0, claim, tenant=A),
        cm.LoadSpec("b", link, prompt[:claim], [7, 8, 9, 10, 11, 12, 13], 0, claim, tenant=B),
        cm.LoadSpec("n", never_link, prompt[:claim], [14, 15, 16, 17, 18, 19, 20], 0, claim, tenant=B),
    ]
    c = _read_worker(stores, loads)
    (kvs_a, _), (kvs_b, _), (kvs_n, _) = c._read(loads)
    assert kvs_a[0] is not None and kvs_b == [None] == kvs_n  # B: as missing as a key nobody compiled
    jobs = [c._job(ld, kvs, None) for ld, kvs in zip(loads, [kvs_a, kvs_b, kvs_n])]
    assert [len(j.spans) for j, _ in jobs] == [1, 0, 0]
    assert jobs[1][1] == [key_a] and jobs[2][1] == [never]  # `missing` names the asked key either way


def test_finder_entries_are_scoped_by_tenant():
    f = ChunkFinder()
    f.add("a-key", CHUNK, A)
    prompt = [5] + CHUNK + [6]
    assert [s.key for s in f.find(prompt, A)] == ["a-key"]
    assert f.find(prompt, B) == []


def test_a_requests_tenant_is_its_cache_salts_namespace_or_the_servers_default():
    assert namespace_of(None, "dflt") == "dflt" == namespace_of(":x", "dflt")
    assert namespace_of("acme:req-1") == "acme" == namespace_of("acme")
    assert namespace_of(unique_salt("acme")) == "acme" and unique_salt("acme") != unique_salt("acme")
    t = Tenancy.from_extra({"tenant": "shared"})
    assert t.of(SimpleNamespace(cache_salt=None)) == tenant_id("shared")
    assert t.of(SimpleNamespace(cache_salt="acme:1")) == t.of(SimpleNamespace(cache_salt="acme:2")) == tenant_id("acme")


@pytest.mark.parametrize(
    "extra, why",
    [
        ({"allow_client_compiles": "yes"}, "must be true or false"),
        ({"allow_client_find": 1}, "must be true or false"),
        ({"tenant": "a:b"}, "without ':'"),
        ({"tenant": 3}, "must be a string"),
    ],
)
def test_malformed_tenancy_options_refuse_to_start(extra, why):
    with pytest.raises(ValueError, match=why):
        Tenancy.from_extra(extra)


def _scheduler(**extra) -> conn.EpicConnector:
    c = object.__new__(conn.EpicConnector)  # the scheduler-side state, without a vLLM config
    c._init_scheduler(ConnectorConfig.from_extra({"find_chunks": "legolink-0", **extra}))
    c.async_links, c.block_size = False, 4
    return c


def test_a_server_without_client_compiles_refuses_them_by_name_and_runs_the_prompt_plainly():
    c = _scheduler(allow_client_compiles=False)
    req = SimpleNamespace(
        request_id="r", prompt_token_ids=LEAD + CHUNK, cache_salt=None, kv_transfer_params={"epic": {"compile": {}}}
    )
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    c.update_state_after_alloc(req, None, 0)
    assert c._active == {}  # nothing captured
    assert "does not accept compiles" in c.request_finished(req, [])[1]["epic"]["error"]


# ------------------------------------------------------------------ bounded work
def _timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def test_the_finder_under_a_flood_of_chunks_sharing_one_anchor_stays_capped_and_fast():
    # The review's stall: 5000 learned chunks sharing an anchor and an 8000-token prompt of that anchor took
    # 27.5 s on the scheduler thread (nothing scheduled for anyone meanwhile).
    f = ChunkFinder()
    anchor = list(range(1000, 1000 + ANCHOR))
    for i in range(5000):
        f.add(f"k{i}", anchor + [7] * (i % 50) + [i], A)
    assert len(f) == PER_ANCHOR
    prompt = (anchor * 600)[:8192]
    spans, dt = _timed(lambda: f.find(prompt, A))
    assert spans == [] and dt < FAST_S, dt


def test_the_finder_stops_at_its_budget_when_every_candidate_fails_at_its_last_token():
    f = ChunkFinder()
    head = list(range(1000, 1000 + ANCHOR))
    for i in range(PER_ANCHOR):  # long chunks that match the prompt up to their last token
        f.add(f"k{i}", head + [7] * (1000 + 100 * i) + [99], A)
    prompt = [7] * 100 + head + [7] * 8000
    prompt = prompt + (head + [7] * 2000) * 2  # more near-misses later in the prompt
    _, dt = _timed(lambda: f.find(prompt[:8192], A))
    assert dt < FAST_S, dt


def test_the_finder_is_bounded_by_bytes_not_by_a_count_of_chunks():
    f = ChunkFinder(max_bytes=1 << 20)
    for i in range(200):  # 200 chunks of 4096 tokens: 6.4 MiB of tokens as int64
        f.add(f"k{i}", [i] * ANCHOR + list(range(4096 - ANCHOR)), A)
    assert f.nbytes <= 1 << 20 and 0 < len(f) < 40
    assert [s.key for s in f.find([199] * ANCHOR + list(range(4096 - ANCHOR)), A)] == ["k199"]  # newest kept


def test_a_link_naming_too_many_spans_is_refused_before_any_is_read():
    spans = [["sink1-a", 0, i, 1, False] for i in range(4000)]
    with pytest.raises(ValueError, match="4000 spans, more than this server's limit of 512"):
        LinkRequest.from_params({"policy": "legolink-0", "spans": spans}, 5000)
    c = _scheduler(max_spans=16)
    req = SimpleNamespace(
        request_id="r",
        prompt_token_ids=list(range(40)),
        cache_salt=None,
        kv_transfer_params={"epic": {"link": {"policy": "legolink-0", "spans": spans[:20]}}},
    )
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "limit of 16" in c.request_finished(req, [])[1]["epic"]["error"]


def test_spans_of_one_record_read_it_once_and_are_sliced_from_it():
    # One link naming MAX_SPANS spans of one key read it MAX_SPANS times before (a full copy from disk or
    # Redis each); now once.
    store = MemoryStore()
    stores = ChunkStores(checked_store(store, FP), new_glue_store())
    _compile(_compile_worker(stores), LEAD + CHUNK, len(LEAD), A)
    key = chunk_key(FP, CHUNK, LEAD, "tenant-a")
    n = MAX_SPANS
    prompt = CHUNK[:1] * n + [5]
    spans = tuple(SpanRef(key, 1, i, 1) for i in range(n))  # each span: the chunk's first token
    link = LinkRequest(parse_policy("legolink-0"), None, spans)
    load = cm.LoadSpec("r", link, prompt[:n], list(range(n // 4 + 1)), 0, n, tenant=A)
    c = _read_worker(stores, [load])
    hits = store.stats.hits
    ((kvs, err),), dt = _timed(lambda: c._read([load]))
    assert err is None and all(kv is not None for kv in kvs) and store.stats.hits - hits == 1
    job, missing = c._job(load, kvs, None)
    assert len(job.spans) == n and missing == [] and dt < FAST_S, dt


def test_text_matching_under_a_flood_of_texts_sharing_one_anchor_stays_capped_and_fast():
    # The review's case: 5000 texts with one 32-character anchor and an 8000-character message took 6.9 s.
    idx = ChunkTextIndex()
    for i in range(5000):
        idx.add(ChunkRef(f"k{i}", 8, "x" * 32 + "y" * (i % 100) + str(i)))
    assert len(idx) == idx.per_anchor
    _, dt = _timed(lambda: idx.split("x" * 8000))
    assert dt < FAST_S, dt
    honest = ChunkRef("h", 8, "An honest chunk of text, found inside a rendered prompt.")
    idx.add(honest)
    assert [s for s in idx.split("Context: " + honest.text + " Question?") if isinstance(s, ChunkRef)] == [honest]


def test_the_text_index_is_bounded_by_bytes():
    idx = ChunkTextIndex(max_bytes=1 << 20)
    for i in range(100):  # 100 texts of 64 KiB
        idx.add(ChunkRef(f"k{i}", 8, f"{i:08d} " + "z" * (64 << 10)))
    assert idx.nbytes <= 1 << 20 and 0 < len(idx) < 20
    assert f"{99:08d} " + "z" * (64 << 10) in idx  # the newest kept


def test_a_key_from_another_fingerprint_or_variant_label_never_matches():
    assert key_of(FP, A, lead_id(LEAD), [SINK] + CHUNK) == chunk_key(FP, CHUNK, LEAD, "tenant-a")
    assert key_of("other", A, lead_id(LEAD), [SINK] + CHUNK) != chunk_key(FP, CHUNK, LEAD, "tenant-a")


def _put_and_get(store):
    """(key, record, what the store returns for it) for one of tenant A's records with its lead."""
    key = chunk_key(FP, CHUNK, LEAD, "tenant-a")
    kv = ChunkKV(key, [SINK] + CHUNK, torch.ones(1, 1 + len(CHUNK), 1, 2), torch.ones(1, 1 + len(CHUNK), 1, 2))
    kv.lead, kv.tenant = lead_id(LEAD), A
    store.put(kv)
    got = store.get(key)
    assert (got.lead, got.tenant) == (kv.lead, kv.tenant) and record_key(FP, got) == key
    return key, kv, got


def test_a_records_lead_and_tenant_survive_the_shared_tiers_and_are_covered_by_the_hmac(tmp_path):
    from epic_rag.store import codec, open_store

    store = open_store(f"disk:{tmp_path}/kv?secret=s3cret")
    key, kv, got = _put_and_get(store)
    # a writer without the secret re-labels the record's lead: the entry no longer verifies
    forged = ChunkKV(key, kv.token_ids, kv.k, kv.v, lead=lead_id(EVIL), tenant=A)
    (tmp_path / "kv" / f"{key}.safetensors").write_bytes(codec.encode(forged))
    assert store.get(key) is None


@pytest.mark.parametrize("spec", ["memory", "memory?quant=int8", "disk:{tmp}/kv", "memory+disk:{tmp}/kv2"])
def test_a_records_lead_and_tenant_survive_every_tier(tmp_path, spec):
    from epic_rag.store import open_store

    store = open_store(spec.format(tmp=tmp_path))
    key, kv, got = _put_and_get(store)
    part = got.slice(1, 5)
    assert (part.lead, part.tenant) == (kv.lead, kv.tenant)
