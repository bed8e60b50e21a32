"""EpicConnector without an engine: how its worker side reads spans from its store and reports outcomes and
failures, how its scheduler side parses link jobs and carries outcomes to the request's end, and that attach
refuses an unsupported configuration."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from epic_rag.engine.connector import epic as conn
from epic_rag.engine.connector import meta as cm
from epic_rag.engine.connector.config import ConnectorConfig
from epic_rag.engine.connector.finder import ANCHOR, ChunkFinder
from epic_rag.engine.connector.support import LinkUnsupported
from epic_rag.engine.connector.tenancy import Tenancy
from epic_rag.engine.jobs import LinkRequest, SpanRef
from epic_rag.engine.link.budget import HostBudget
from epic_rag.engine.stores import ChunkStores
from epic_rag.keys import tenant_id
from epic_rag.policy import parse_policy
from epic_rag.store import ChunkKV, MemoryStore


class _Linker:
    """The linker's pass protocol (begin, then advance until done) over `layers` layers, recording each pass;
    the real linker's exactness is tested on real models (test_engine_*)."""

    def __init__(self, layers: int = 1) -> None:
        self.linked, self.layers, self.advances = [], layers, 0

    def begin(self, loads):
        self.linked.append([(ld.job, ld.block_ids, ld.start, ld.end) for ld in loads])
        return SimpleNamespace(loads=list(loads), layer=0), []

    def advance(self, p, more=None):
        self.advances += 1
        while p.layer < self.layers:  # as the real one: asks the budget after each layer
            p.layer += 1
            if more is not None and not more():
                break
        if p.layer < self.layers:
            return False
        for ld in p.loads:
            ld.job.recomputed = 3
        return True


SINK = 1
PROMPT = [SINK, 10, 11, 12, 13, SINK, 20, 21, 22, 5, 6]  # two chunks (each behind the sink) and a question


def _record(key: str, tokens: list[int]) -> ChunkKV:
    n = len(tokens)
    return ChunkKV(key, tokens, torch.zeros(1, n, 1, 2), torch.zeros(1, n, 1, 2))


def _stores(*records: ChunkKV) -> ChunkStores:
    chunks = MemoryStore()
    for r in records:
        chunks.put(r)
    return ChunkStores(chunks, MemoryStore())


def _scheduler(find: str | None = None, **extra) -> conn.EpicConnector:
    c = object.__new__(conn.EpicConnector)  # the scheduler-side state, without a vLLM config
    c._init_scheduler(ConnectorConfig.from_extra({**extra, "find_chunks": find} if find else extra))
    c.async_links, c.block_size = False, 4
    return c


def _worker(meta: cm.EpicMeta, stores: ChunkStores, block_size: int = 4) -> conn.EpicConnector:
    c = object.__new__(conn.EpicConnector)  # the worker-side state start_load_kv uses, without a vLLM config
    c.block_size, c.linker, c.stores = block_size, _Linker(), stores
    c._load_errors, c._step_results, c._captures, c._learned = set(), {}, {}, {}
    c.tp_rank, c.tp_size = 0, 1
    c._queue, c._pass, c._recving = [], None, set()
    c.async_links, c.link_step_share, c._budget = False, 1.0, HostBudget(1.0)
    c._get_connector_metadata = lambda: meta
    return c


def _load(req_id: str, spans, block_ids=(0, 1, 2), policy: str = "legolink-2") -> cm.LoadSpec:
    link = LinkRequest(parse_policy(policy), SINK, tuple(SpanRef(*s) for s in spans))
    claim, cut = link.claimed(len(PROMPT))
    return cm.LoadSpec(req_id, LinkRequest(link.policy, SINK, cut), PROMPT[:claim], list(block_ids), 0, claim)


SPANS = [("sink1-a", 0, 0, 5, False), ("sink1-b", 0, 5, 4, False)]


def test_a_load_reads_each_span_from_the_store_and_links_all_the_step_in_one_batch():
    stores = _stores(_record("sink1-a", PROMPT[0:5]), _record("sink1-b", PROMPT[5:9]))
    c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS), _load("r2", SPANS[1:])]), stores)
    c.start_load_kv(None)
    (batch,) = c.linker.linked  # one call for the step
    assert [[(sp.start, sp.kv.token_ids) for sp in job.spans] for job, *_ in batch] == [
        [(0, PROMPT[0:5]), (5, PROMPT[5:9])],
        [(5, PROMPT[5:9])],
    ]
    assert c.get_block_ids_with_load_errors() == set()
    assert c.build_connector_worker_meta().results == {
        "r1": {"recomputed": 3, "linked_spans": 2, "missing": []},
        "r2": {"recomputed": 3, "linked_spans": 1, "missing": []},
    }
    assert c.build_connector_worker_meta() is None  # reported once


def test_a_span_whose_record_is_missing_or_holds_other_tokens_is_recomputed_not_linked(caplog):
    wrong = _record("sink1-b", [SINK, 20, 21, 99])  # filed under b's key, holding other tokens
    other_sink = _record("sink1-a", [7] + PROMPT[1:5])  # a's tokens compiled behind another sink
    for records, expect_missing in (((), ["sink1-a", "sink1-b"]), ((wrong, other_sink), ["sink1-a", "sink1-b"])):
        c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS)]), _stores(*records))
        with caplog.at_level(logging.WARNING):
            c.start_load_kv(None)
        ((job, *_),) = c.linker.linked[0]
        assert job.spans == []  # every position then has no cache: the linker recomputes it (exact)
        assert c.get_block_ids_with_load_errors() == set()
        assert c.build_connector_worker_meta().results["r1"]["missing"] == expect_missing


@pytest.mark.parametrize("b_is", ["other tokens", "another tenant's"])
def test_a_link_decodes_no_record_whose_header_says_it_cannot_serve_the_span(tmp_path, monkeypatch, b_is):
    # Review 3 F: each named record was read and decoded whole before its tokens were compared, so one link
    # naming 512 records that cannot serve it cost 512 whole reads. Now its header and token ids come first.
    from epic_rag.store import DiskStore, codec

    b = _record("sink1-b", [SINK, 20, 21, 99] if b_is == "other tokens" else PROMPT[5:9])
    if b_is != "other tokens":
        b.tenant = tenant_id("someone else")
    disk = DiskStore(tmp_path)
    for r in (_record("sink1-a", PROMPT[0:5]), b):
        disk.put(r)
    decoded = []
    real = codec.decode
    monkeypatch.setattr(codec, "decode", lambda buf, key, *a: decoded.append(key) or real(buf, key, *a))
    c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS)]), ChunkStores(disk, MemoryStore()))
    c.start_load_kv(None)
    assert decoded == ["sink1-a"]
    ((job, *_),) = c.linker.linked[0]
    assert [sp.kv.token_ids for sp in job.spans] == [PROMPT[0:5]]
    assert c.build_connector_worker_meta().results["r1"]["missing"] == ["sink1-b"]


def _logged_detail(caplog, result: dict) -> str:
    """The log line a client's generic error points to by its id (the client sees no internals)."""
    eid = result["error"].split("(error ")[1].split(";")[0]
    (line,) = [r.getMessage() for r in caplog.records if f"[error {eid}]" in r.getMessage()]
    return line


def test_a_failed_batch_fails_each_request_through_its_blocks_without_raising_into_the_step(caplog):
    stores = _stores(_record("sink1-a", PROMPT[0:5]), _record("sink1-b", PROMPT[5:9]))
    loads = [_load("r1", SPANS, block_ids=(0, 1, 2)), _load("r2", SPANS, block_ids=(3, 4, 5))]
    c = _worker(cm.EpicMeta(loads=loads), stores)

    def broken(p, more=None):
        raise RuntimeError("simulated fault in the batched pass")

    c.linker.advance = broken
    c.start_load_kv(None)  # never raises into vLLM's step
    assert c.get_block_ids_with_load_errors() == {0, 1, 2, 3, 4, 5}  # vLLM fails the requests holding them
    assert c.get_block_ids_with_load_errors() == set()
    results = c.build_connector_worker_meta().results
    assert results["r1"] == results["r2"] and "simulated" not in results["r1"]["error"]  # generic, with an id
    assert results["r1"]["error"].startswith("linking a pass of 2 requests failed (error ")
    assert "RuntimeError: simulated fault in the batched pass" in _logged_detail(caplog, results["r1"])


def test_a_store_that_raises_fails_only_the_request_it_was_reading_for(caplog):
    stores = _stores(_record("sink1-b", PROMPT[5:9]))

    class Exploding(MemoryStore):  # every read of sink1-a raises (its header first, as a link reads it)
        def get(self, key):
            if key == "sink1-a":
                raise OSError("disk gone")
            return stores.chunks.get(key)

        def peek(self, key):
            if key == "sink1-a":
                raise OSError("disk gone")
            return stores.chunks.peek(key)

    c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS), _load("r2", SPANS[1:], block_ids=(7, 8, 9))]), stores)
    c.stores = ChunkStores(Exploding(), stores.glue)
    c.start_load_kv(None)
    assert [[job.token_ids for job, *_ in batch] for batch in c.linker.linked] == [[PROMPT[:9]]]  # r2 only
    assert c.get_block_ids_with_load_errors() == {0, 1, 2}
    result = c.build_connector_worker_meta().results["r1"]
    assert "disk gone" not in result["error"] and "OSError: disk gone" in _logged_detail(caplog, result)


@pytest.mark.parametrize(
    "link, why",
    [
        ({"policy": "full", "spans": [["k", 0, 0, 2, False]]}, "links no chunks"),
        ({"policy": "legolink-2", "spans": []}, "non-empty"),
        ({"policy": "legolink-2", "spans": [["k", 0, 0, 2]]}, "is \\[key, offset, start, n, exact\\]"),
        ({"policy": "legolink-2", "spans": [["k", 0, 4, 2, False], ["j", 0, 5, 1, False]]}, "overlaps"),
        ({"policy": "legolink-2", "spans": [["k", 0, 8, 9, False]]}, "past the prompt"),
        ({"policy": "nope", "spans": [["k", 0, 0, 2, False]]}, "unknown policy"),
        ({"policy": "auto", "spans": [["k", 0, 0, 2, False]]}, "resolved per request by EpicEngine"),
        ({"policy": "legolink-2", "spans": [["../../etc/passwd", 0, 0, 2, False]]}, "invalid chunk key"),
    ],
)
def test_a_malformed_link_is_refused_by_name_and_the_request_runs_as_a_plain_prefill(link, why):
    with pytest.raises(ValueError, match=why):
        LinkRequest.from_params(link, 11)
    c = _scheduler()
    req = SimpleNamespace(request_id="r", prompt_token_ids=PROMPT, kv_transfer_params={"epic": {"link": link}})
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    c.update_state_after_alloc(req, None, 0)
    assert c._active == {}
    done, params = c.request_finished(req, [])
    assert not done and why.replace("\\", "").split()[0].strip("[") in params["epic"]["error"]


def test_the_worker_outcome_reaches_the_request_end_and_nothing_is_kept_for_ended_requests():
    c = _scheduler()
    link = {"policy": "legolink-2", "sink": SINK, "spans": [list(s) for s in SPANS]}
    req = SimpleNamespace(request_id="r", prompt_token_ids=PROMPT, kv_transfer_params={"epic": {"link": link}})
    assert c.get_num_new_matched_tokens(req, 0) == (9, False)  # both chunks claimed
    c.update_state_after_alloc(req, None, 9)
    meta = cm.EpicWorkerMeta({"r": {"recomputed": 4, "missing": []}, "gone": {"recomputed": 1}})
    meta.aggregate(cm.EpicWorkerMeta({"r": {"error": "rank 1 failed"}}))  # an error on any rank wins
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))
    assert set(c._results) == {"r"}  # "gone" already ended: not kept
    assert c.request_finished(req, []) == (False, {"epic": {"error": "rank 1 failed"}})
    assert c._active == {} and c._results == {} and c._finished == ["r"]


class _Blocks:  # the scheduler's KV cache manager, as block_ids_of reads it
    def get_blocks(self, req_id):
        return SimpleNamespace(get_block_ids=lambda: ([4, 5, 6],))


def _step(total_tokens: int = 0, new=()):
    return SimpleNamespace(
        total_num_scheduled_tokens=total_tokens,
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
    )


def test_an_async_link_is_claimed_as_an_async_load_and_sent_to_the_worker_before_its_request_is_scheduled():
    c = _scheduler()
    c.async_links, c._kvm = True, _Blocks()
    link = {"policy": "legolink-2", "sink": SINK, "spans": [list(s) for s in SPANS]}
    req = SimpleNamespace(request_id="r", prompt_token_ids=PROMPT, kv_transfer_params={"epic": {"link": link}})
    assert c.get_num_new_matched_tokens(req, 4) == (5, True)  # vLLM's own prefix hit covers the first 4
    c.update_state_after_alloc(req, None, 5)
    meta = c.build_connector_meta(_step())  # vLLM schedules nothing for r while it waits for its load
    (load,) = meta.loads
    assert (load.req_id, load.block_ids, load.start, load.end, load.token_ids) == ("r", [4, 5, 6], 4, 9, PROMPT[:9])
    assert meta.idle  # nothing scheduled: the worker may link to the end
    assert c.build_connector_meta(_step(total_tokens=3)).loads == []  # sent once
    assert not c.build_connector_meta(_step(total_tokens=3)).idle
    none = SimpleNamespace(request_id="n", prompt_token_ids=PROMPT, kv_transfer_params={"epic": {"find": False}})
    assert c.get_num_new_matched_tokens(none, 0) == (0, False)  # nothing to load: not an async load


def test_a_link_that_vllms_prefix_cache_holds_but_for_less_than_a_block_is_computed_not_linked():
    c = _scheduler()
    link = {"policy": "query-20", "sink": SINK, "spans": [list(s) for s in SPANS]}
    req = SimpleNamespace(request_id="f", prompt_token_ids=PROMPT, kv_transfer_params={"epic": {"link": link}})
    assert c.get_num_new_matched_tokens(req, 8) == (0, False)  # 1 of the 9 claimed tokens left: computed
    assert c.request_finished(req, [])[1] == {"epic": {"prefix_hit": 8, "unlinked": True}}
    assert c.get_num_new_matched_tokens(req, 4) == (5, False)  # a block or more left: linked
    assert c.request_finished(req, [])[1] == {"epic": {"prefix_hit": 4}}


def _async_worker(meta: cm.EpicMeta, layers: int, share: float = 0.0) -> conn.EpicConnector:
    stores = _stores(_record("sink1-a", PROMPT[0:5]), _record("sink1-b", PROMPT[5:9]))
    c = _worker(meta, stores)
    c.linker, c.async_links, c.link_step_share, c._budget = _Linker(layers), True, share, HostBudget(share)
    return c


def test_an_async_link_advances_a_bounded_share_of_each_busy_step_and_is_released_when_done():
    meta = cm.EpicMeta(loads=[_load("r1", SPANS)])
    c = _async_worker(meta, layers=3)  # share 0: one layer a step
    for step in range(3):
        c.start_load_kv(None)
        meta.loads = []  # each load arrives once
        if step < 2:
            assert c.get_finished(set()) == (None, None)  # still linking: vLLM keeps r waiting
            assert c.build_connector_worker_meta() is None
    assert c.linker.advances == 3 and len(c.linker.linked) == 1  # one pass, three steps
    assert c.get_finished(set()) == (None, {"r1"})
    assert c.build_connector_worker_meta().results["r1"] == {"recomputed": 3, "linked_spans": 2, "missing": []}
    assert c._pass is None and c._queue == []  # nothing held


def test_an_idle_step_links_to_the_end_and_links_arriving_meanwhile_wait_for_the_next_pass():
    meta = cm.EpicMeta(loads=[_load("r1", SPANS)])
    c = _async_worker(meta, layers=4)
    c.start_load_kv(None)  # busy step: one layer
    meta.loads = [_load("r2", SPANS[1:], block_ids=(7, 8, 9)), _load("r3", SPANS, block_ids=(10, 11, 12))]
    c.start_load_kv(None)  # r2 and r3 wait: the workspace holds r1's pass
    assert [len(b) for b in c.linker.linked] == [1] and c.get_finished(set()) == (None, None)
    meta.loads, meta.idle = [], True
    c.start_load_kv(None)  # nothing else to run: r1 to the end, then r2 and r3 together
    assert [len(b) for b in c.linker.linked] == [1, 2]
    assert c.get_finished(set()) == (None, {"r1", "r2", "r3"})


def test_a_failed_async_link_reports_its_blocks_and_its_release_in_the_same_step(caplog):
    meta = cm.EpicMeta(loads=[_load("r1", SPANS), _load("r2", SPANS, block_ids=(3, 4, 5))], idle=True)
    c = _async_worker(meta, layers=2)

    def broken(p, more=None):
        raise RuntimeError("simulated fault in a layer")

    c.linker.advance = broken
    c.start_load_kv(None)
    assert c.get_block_ids_with_load_errors() == {0, 1, 2, 3, 4, 5}  # vLLM fails both...
    assert c.get_finished(set()) == (None, {"r1", "r2"})  # ...and frees their blocks once released
    result = c.build_connector_worker_meta().results["r1"]
    assert "RuntimeError: simulated fault in a layer" in _logged_detail(caplog, result)


def test_an_async_link_aborted_before_its_pass_starts_is_released_without_linking():
    meta = cm.EpicMeta(loads=[_load("r1", SPANS)])
    c = _async_worker(meta, layers=3)
    c.start_load_kv(None)  # r1's pass under way
    meta.loads = [_load("r2", SPANS[1:], block_ids=(7, 8, 9))]
    c.start_load_kv(None)  # r2 queued
    meta.loads, meta.finished = [], ["r2"]  # r2 aborted
    c.start_load_kv(None)
    assert c.get_finished(set()) == (None, {"r1", "r2"})  # r1 done (3 layers); r2 released unlinked
    assert [len(b) for b in c.linker.linked] == [1]
    assert "r2" not in c.build_connector_worker_meta().results


def test_attach_refuses_an_unsupported_configuration_before_building_the_linker():
    # A one-layer model shaped like vLLM's (model.model.layers[i].self_attn.{attn, rotary_emb}) with an fp8
    # KV cache: attach must refuse it by name, before the layout self-check would trip over the uint8 cache.
    class Attention(torch.nn.Module):  # vllm_api.find_attention matches vLLM's class name
        def __init__(self) -> None:
            super().__init__()
            self.layer_name = "model.layers.0.self_attn.attn"
            self.num_heads, self.num_kv_heads, self.head_size = 2, 1, 8
            self.kv_cache_dtype = "fp8"
            self.impl = type("CPUAttentionBackendImpl", (), {"logits_soft_cap": 0, "alibi_slopes": None})()

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].self_attn = torch.nn.Module()
    model.model.layers[0].self_attn.attn = Attention()
    model.model.layers[0].self_attn.rotary_emb = object()
    c = object.__new__(conn.EpicConnector)
    c.block_size, c.linker = 16, None
    c.kv_caches = {"model.layers.0.self_attn.attn": torch.zeros((4, 1, 16, 16), dtype=torch.uint8)}
    with pytest.raises(LinkUnsupported, match="kv_cache_dtype='fp8'"):
        c.attach(model)
    assert c.linker is None


def test_the_finder_finds_known_chunks_in_a_prompts_tokens_token_for_token():
    f = ChunkFinder()
    a, b = list(range(100, 100 + ANCHOR + 4)), list(range(300, 300 + ANCHOR + 9))
    a_longer = a + [7, 7]  # starts like a: the longest match wins where both fit
    f.add("sink1-a", a)
    f.add("sink1-al", a_longer)
    f.add("sink1-b", b)
    f.add("sink1-short", [1] * (ANCHOR - 1))  # too short to index
    prompt = [5, 6] + b + [9] + a + [8] + a_longer + a[:-1]  # the last one cut: not a match
    spans = f.find(prompt)
    assert [(s.key, s.offset, s.start, s.n) for s in spans] == [
        ("sink1-b", SINK, 2, len(b)),
        ("sink1-a", SINK, 3 + len(b), len(a)),
        ("sink1-al", SINK, 4 + len(b) + len(a), len(a_longer)),
    ]
    assert f.find([5] * 40) == [] and len(f) == 3


def test_a_request_naming_no_spans_links_the_chunks_found_in_it_unless_it_opts_out():
    c = _scheduler(find="legolink-0")
    chunk = list(range(100, 100 + ANCHOR + 4))
    meta = cm.EpicWorkerMeta({}, {"sink1-a": (tenant_id(""), chunk)})  # the default tenant's
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=meta))  # learned from a compile
    prompt = [5, 6] + chunk + [9, 10]
    plain = SimpleNamespace(request_id="p", prompt_token_ids=prompt, kv_transfer_params=None)
    assert c.get_num_new_matched_tokens(plain, 0) == (2 + len(chunk), False)
    link, _ = c._parse(plain)
    assert link.policy.name == "legolink-0" and [s.key for s in link.spans] == ["sink1-a"]
    opted_out = SimpleNamespace(request_id="o", prompt_token_ids=prompt, kv_transfer_params={"epic": {"find": False}})
    assert c.get_num_new_matched_tokens(opted_out, 0) == (0, False)
    other = SimpleNamespace(request_id="x", prompt_token_ids=prompt, kv_transfer_params={"epic": {"find": "naive"}})
    assert c._parse(other) == (None, None)  # a request may not pick a policy unless the server allows it
    assert "allow_client_find" in c.request_finished(other, [])[1]["epic"]["error"]
    c.tenancy = Tenancy(allow_client_find=True)
    assert c._parse(other)[0].policy.name == "naive"
    for r in (plain, opted_out, other):
        c.request_finished(r, [])
    assert c._parsed == {}


def test_tensor_parallel_ranks_keep_their_own_records_and_agree_on_what_is_missing(monkeypatch):
    from epic_rag.keys import chunk_key, lead_id, record_key

    # rank 1 of 2 holds both records under its own keys; the other rank lacks b's: dropped here too
    stores = _stores(_record("sink1-a.tp2r1", PROMPT[0:5]), _record("sink1-b.tp2r1", PROMPT[5:9]))
    c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS)]), stores)
    c.tp_rank, c.tp_size = 1, 2
    _other_rank(monkeypatch, [0, 0, 1])  # load ok, a found, b missing
    c.start_load_kv(None)
    ((job, *_),) = c.linker.linked[0]
    assert [sp.start for sp in job.spans] == [0]  # only a linked: both ranks recompute b's tokens
    assert c.build_connector_worker_meta().results["r1"]["missing"] == ["sink1-b"]
    # a rank's record keeps its suffix through the key check
    kv = _record(chunk_key("fp", PROMPT[1:5], [SINK]) + ".tp2r1", PROMPT[0:5])
    kv.lead, kv.tenant = lead_id([SINK]), tenant_id("")
    assert record_key("fp", kv) == kv.key


def _other_rank(monkeypatch, flags: list[int]):
    """A second tensor-parallel rank holding `flags` (for the reads' agreement), reached over the group's host
    side (gloo); vLLM's device all-reduce refuses host tensors on CUDA (and reading one back would sync the
    device): it must not be used."""
    import torch.distributed as dist
    from vllm.distributed import parallel_state

    from epic_rag.engine import vllm_api

    host_group = object()
    seen = []

    def all_reduce(t, group=None):
        assert group is host_group and t.device.type == "cpu", (group, t.device)
        seen.append(t.clone())
        if len(seen) == 1:  # the reads' agreement; later ones (the pass's start) went well there
            t += torch.tensor(flags, dtype=t.dtype)

    def device_all_reduce(t):
        raise AssertionError("host flags sent through the device all-reduce")

    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(cpu_group=host_group))
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(vllm_api, "tp_all_reduce", device_all_reduce)
    return seen


def test_tensor_parallel_flags_are_agreed_on_the_groups_host_side_never_through_the_device_all_reduce(monkeypatch):
    stores = _stores(_record("sink1-a.tp2r0", PROMPT[0:5]))  # this rank lacks b; the other fails the load
    c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS)]), stores)
    c.tp_rank, c.tp_size = 0, 2
    seen = _other_rank(monkeypatch, [1, 0, 0])
    c.start_load_kv(None)
    assert [t.tolist() for t in seen] == [[0, 0, 1]]  # one host all-reduce: load ok here, a found, b missing
    assert c.linker.linked == []  # failed on the other rank: failed here too, its blocks reported
    assert c.get_block_ids_with_load_errors() == {0, 1, 2}
    assert "another tensor-parallel rank" in c.build_connector_worker_meta().results["r1"]["error"]


def _scripted_ranks(monkeypatch, others: list[list[bool]]):
    """The other tensor-parallel rank's flags for each host-side agreement, in order; the calls seen here."""
    from epic_rag.engine import vllm_api

    seen = []

    def tp_any(flags):
        seen.append(list(flags))
        other = others[len(seen) - 1]
        return [a or b for a, b in zip(flags, other)]

    monkeypatch.setattr(vllm_api, "tp_any", tp_any)
    monkeypatch.setattr(vllm_api, "tp_rank_size", lambda: (0, 2))
    return seen


@pytest.mark.parametrize("fails_here", [True, False])
def test_a_lazy_attach_that_fails_on_one_tensor_parallel_rank_is_refused_on_every_rank(monkeypatch, fails_here):
    # Under `vllm serve` each rank attaches on first use; a rank that refused used to return before _read's
    # agreement, leaving the other blocked in it. The ranks agree on the outcome first, in that step.
    c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS)]), _stores(_record("sink1-a.tp2r0", PROMPT[0:5])))
    c.linker, c._refusal, c._runner = None, None, SimpleNamespace(get_model=lambda: "the model")
    linker = _Linker()

    def attach(model):
        if fails_here:
            raise RuntimeError("CUDA out of memory allocating the staging ring")
        c.linker, c.tp_size = linker, 2
        return {}

    c.attach = attach
    seen = _scripted_ranks(monkeypatch, [[not fails_here]])
    c.start_load_kv(None)
    assert seen == [[fails_here]]  # one agreement, on the attach outcome, and no other collective after it
    assert c.linker is None and linker.linked == []
    assert c.get_block_ids_with_load_errors() == {0, 1, 2}
    assert "cannot link" in c.build_connector_worker_meta().results["r1"]["error"]
    c.start_load_kv(None)  # later steps: refused on every rank alike, without another collective
    assert len(seen) == 1


def test_a_pass_whose_start_fails_on_another_tensor_parallel_rank_runs_no_layer_on_any(monkeypatch):
    # An OOM in begin (the pass's tables, staging) hits one rank: the other must not run layers whose
    # all-reduces the failed rank never joins.
    stores = _stores(_record("sink1-a.tp2r0", PROMPT[0:5]), _record("sink1-b.tp2r0", PROMPT[5:9]))
    c = _worker(cm.EpicMeta(loads=[_load("r1", SPANS), _load("r2", SPANS, block_ids=(3, 4, 5))]), stores)
    c.tp_size = 2
    seen = _scripted_ranks(monkeypatch, [[False] * 6, [True]])  # reads agreed; the other rank's begin failed
    c.start_load_kv(None)
    assert seen == [[False] * 6, [False]]  # its start agreed after the reads
    assert c.linker.advances == 0
    assert c.get_block_ids_with_load_errors() == {0, 1, 2, 3, 4, 5}
    results = c.build_connector_worker_meta().results
    assert all(r["error"].startswith("linking a pass of 2 requests failed") for r in results.values())


def test_the_model_runner_is_found_behind_model_runner_v2s_kv_connector_object():
    # vLLM 0.32 on CUDA with Triton runs Model Runner V2, which registers the caches from an ActiveKVConnector
    # it builds (not from the runner's own method): the connector must still find the runner and its model.
    class ActiveKVConnector:  # V2's object: no get_model
        def __init__(self, connector, caches):
            connector.register_kv_caches(caches)

    class GPUModelRunner:
        def get_model(self):
            return "the model"

        def initialize_kv_cache(self, connector, caches):
            self.kv_connector = ActiveKVConnector(connector, caches)

        def initialize_kv_cache_v1(self, connector, caches):
            connector.register_kv_caches(caches)

    for init in ("initialize_kv_cache", "initialize_kv_cache_v1"):
        c = object.__new__(conn.EpicConnector)
        getattr(GPUModelRunner(), init)(c, {"layer": torch.zeros(1)})
        assert c._runner is not None and c._runner.get_model() == "the model", init
    c = object.__new__(conn.EpicConnector)
    ActiveKVConnector(c, {})  # no runner anywhere up the stack: none, and attach refuses by name
    assert c._runner is None


def test_every_connector_option_is_checked_at_start_up_and_an_unknown_one_is_refused_by_name():
    cfg = ConnectorConfig.from_extra({"store": "memory", "find_chunks": "legolink-0", "tenant": "t", "max_spans": 9})
    assert (cfg.find_policy.name, cfg.tenancy.default, cfg.max_spans, cfg.async_links) == ("legolink-0", "t", 9, True)
    assert ConnectorConfig.from_extra(None) == ConnectorConfig()
    for extra, why in (
        ({"find_chunk": "legolink-0"}, "unknown option.*find_chunk"),  # a misspelt key never falls back silently
        ({"find_chunks": "nope"}, "unknown policy"),
        ({"find_chunks": "full"}, "find_chunks must name a link policy"),
        ({"find_chunks": "auto"}, "find_chunks must name a link policy"),
        ({"link_step_share": -1}, "link_step_share"),
        ({"async_links": "no"}, "async_links"),
        ({"max_spans": 0}, "max_spans"),
        ({"workspace_tokens": 1.5}, "workspace_tokens"),
        ({"tenant": "a:b"}, "without ':'"),
        ({"allow_client_find": 1}, "must be true or false"),
        ({"max_compile_tokens": 0}, "max_compile_tokens must be an integer >= 1 or null"),
        ({"max_compile_tokens": True}, "max_compile_tokens must be an integer >= 1 or null"),
    ):
        with pytest.raises(ValueError, match=why):
            ConnectorConfig.from_extra(extra)


def test_a_compile_over_max_compile_tokens_fails_with_a_clear_error_before_anything_is_captured_or_stored():
    # Review 3 B: one request could store a whole context window of KV in the shared store.
    from prometheus_client import REGISTRY

    from epic_rag.engine.jobs import CompileRequest

    def refusals() -> float:
        return REGISTRY.get_sample_value("epic_rag_compile_refusals_total", {"reason": "tokens"}) or 0.0

    assert (
        ConnectorConfig().max_compile_tokens == 4096
        and ConnectorConfig.from_extra({"max_compile_tokens": None}).max_compile_tokens is None
    )
    prompt = [SINK] + list(range(100, 120))  # the sink, then a 20-token chunk: a record of 21 tokens
    steps = [(0, 12), (12, len(prompt))]
    for bound, refused in ((20, True), (21, False)):
        stores = _stores()
        specs = [cm.CaptureSpec("r", CompileRequest(None, 1), [0, 1], a, b, len(prompt), prompt) for a, b in steps]
        c = _worker(cm.EpicMeta(captures=specs[:1]), stores)
        c.max_compile_tokens, counted = bound, refusals()
        captured = []
        c._capture_buffer = lambda spec: captured.append(spec) or 1 / 0  # (the linker's copy is not under test)
        for spec in specs:
            c._get_connector_metadata = lambda spec=spec: cm.EpicMeta(captures=[spec])
            c.wait_for_save()
        out = c.build_connector_worker_meta().results["r"]
        if refused:
            assert out == {
                "error": "epic compile: its record would hold 21 tokens, over this server's max_compile_tokens (20); "
                "nothing stored"
            }
            assert captured == [] and refusals() - counted == 1  # counted once per request
        else:
            assert captured and "max_compile_tokens" not in out["error"]
        assert stores.chunks.keys() == []


def test_a_compile_over_max_compile_tokens_is_refused_by_the_scheduler_before_its_prefill_runs():
    c = _scheduler(max_compile_tokens=20)
    prompt = [SINK] + list(range(100, 120))  # a record of 21 tokens
    params = {"epic": {"compile": {"lead": 1}}}
    req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, kv_transfer_params=params)
    assert c._parse(req) == (None, None)  # neither a link nor a compile: a plain prefill, nothing captured
    assert "over this server's max_compile_tokens (20)" in c._results["r"]["error"]
    ok = SimpleNamespace(request_id="s", prompt_token_ids=prompt[:21], kv_transfer_params={"epic": {"compile": {}}})
    assert _scheduler(max_compile_tokens=21)._parse(ok)[1] is not None


# ------------------------------------------------------- the request surface (security review 3, finding D)
GOOD_LINK = {"policy": "legolink-2", "sink": SINK, "spans": [list(s) for s in SPANS]}


def _req(params, req_id: str = "r") -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=PROMPT,
        kv_transfer_params=params,
        cache_salt=None,
        block_hashes=[],  # vLLM's prefix-cache hashes, as on_new_request scopes them
        _block_hasher=None,
    )


def _nested(depth: int) -> list:
    v: list = []
    for _ in range(depth):  # built without recursion: only the code under test may recurse
        v = [v]
    return v


@pytest.mark.parametrize(
    "params, why",
    [
        ({"epic": {"compile": {"leed": 3}}}, "epic compile: unknown field(s) 'leed'; valid: lead, key, glue"),
        ({"epic": {"link": {**GOOD_LINK, "on_misisng": "fail"}}}, "unknown field(s) 'on_misisng'; valid: policy"),
        ({"epic": {"lnk": GOOD_LINK}}, "epic: unknown field(s) 'lnk'; valid: link, compile, find"),
        ({"epic": "link"}, "epic: expected an object with one of link, compile, find, got str"),
        ({"epic": [GOOD_LINK]}, "expected an object"),
        ({"epic": {"find": False, "link": GOOD_LINK}}, "expected exactly one of link, compile, find, got link, find"),
        ({"epic": {"compile": {"lead": 1}, "link": GOOD_LINK}}, "exactly one"),
        ({"epic": {"find": True}}, "epic find: expected a policy name or false, got bool"),  # the finder is empty
        ({"epic": {"find": "nope"}}, "unknown policy"),
        ({"epic": {"link": {**GOOD_LINK, "spans": [_nested(20)]}}}, "a span is [key, offset, start, n, exact]"),
        ({"epic": {"link": {**GOOD_LINK, "on_missing": _nested(20)}}}, "on_missing must be"),
        ({"epic": {"link": {**GOOD_LINK, "spans": [_nested(5000)]}}}, "nested deeper than 32 levels"),
    ],
)
def test_unknown_misplaced_or_deeply_nested_epic_fields_are_refused_with_the_valid_ones(params, why):
    c = _scheduler(allow_client_find=True)
    req = _req(params)
    c.on_new_request(req)
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)  # a plain prefill: nothing linked or captured
    c.update_state_after_alloc(req, None, 0)
    assert c._active == {}
    _, out = c.request_finished(req, [])
    assert why in out["epic"]["error"] and len(out["epic"]["error"]) <= 500
    assert not (c._parsed or c._results or c._prefix_hits)


@pytest.mark.parametrize("params", [{"epic": {"find": False}, "other": _nested(900)}, {"epic": _nested(900)}])
def test_params_nested_too_deep_are_refused_and_taken_off_the_request_before_vllm_pickles_them(params):
    # found on `vllm serve`: the connector refused such a link, then vLLM's pickling of the request's sampling
    # params to its workers raised RecursionError in the engine core's step and killed the server
    c = _scheduler()
    req = _req(params)
    req.sampling_params = SimpleNamespace(extra_args={"kv_transfer_params": params, "other_arg": 1})
    c.on_new_request(req)
    assert req.kv_transfer_params is None and req.sampling_params.extra_args == {"other_arg": 1}
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert "nested deeper than 32 levels" in c.request_finished(req, [])[1]["epic"]["error"]


def test_a_value_nested_too_deep_for_any_check_is_a_clear_error_not_a_crash(monkeypatch):
    c = _scheduler()

    def deep(*a, **k):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(LinkRequest, "from_params", deep)
    req = _req({"epic": {"link": GOOD_LINK}})
    assert c.get_num_new_matched_tokens(req, 0) == (0, False)
    assert c.request_finished(req, [])[1] == {"epic": {"error": "epic: the request's parameters are nested too deeply"}}


def _boom(*a, **k):
    raise RuntimeError("simulated fault in a scheduler hook")


@pytest.mark.parametrize("where", ["scope_block_hashes", "claim"])
def test_a_hook_that_raises_before_the_claim_fails_only_its_request_which_runs_as_a_plain_prefill(
    monkeypatch, caplog, where
):
    c = _scheduler()
    c._kv_cache_config = None
    if where == "scope_block_hashes":  # on_new_request: vLLM calls it unguarded, outside any step
        monkeypatch.setattr(conn.vllm_api, "scope_block_hashes", _boom)
    else:  # get_num_new_matched_tokens
        monkeypatch.setattr(LinkRequest, "claim", _boom)
    bad, good = _req({"epic": {"link": GOOD_LINK}}, "bad"), _req({"epic": {"find": False}}, "good")
    with caplog.at_level(logging.ERROR):
        for r in (bad, good):
            c.on_new_request(r)  # never raises into vLLM's scheduler
            assert c.get_num_new_matched_tokens(r, 0) == (0, False)
            c.update_state_after_alloc(r, None, 0)
    assert c._active == {}  # the bad request links nothing: vLLM computes its whole prompt
    out = c.request_finished(bad, [])[1]["epic"]
    assert "simulated" not in out["error"] and "RuntimeError: simulated fault" in _logged_detail(caplog, out)
    assert c.request_finished(good, [])[1] is None
    assert not (c._parsed or c._results or c._prefix_hits or c._active)


@pytest.mark.parametrize("where", ["update_state_after_alloc", "build_connector_meta"])
def test_a_hook_that_raises_after_the_claim_fails_the_request_through_its_claimed_blocks_only(
    monkeypatch, caplog, where
):
    c = _scheduler()
    c._kvm = _Blocks()  # blocks [4, 5, 6] of 4 tokens; vLLM's own prefix hit holds the first 4 tokens
    req = _req({"epic": {"link": GOOD_LINK}})
    assert c.get_num_new_matched_tokens(req, 4) == (5, False)  # positions [4, 9) claimed
    with caplog.at_level(logging.ERROR):
        if where == "update_state_after_alloc":
            monkeypatch.setattr(Tenancy, "of", _boom)
            c.update_state_after_alloc(req, None, 5)
        else:
            c.update_state_after_alloc(req, None, 5)
            monkeypatch.setattr(LinkRequest, "cut", _boom)
        meta = c.build_connector_meta(_step(total_tokens=5))
    (load,) = meta.loads
    assert (load.start, load.end, load.link.on_missing) == (4, 9, "fail")
    # the worker, as it is: the load names no record and asks to fail, so its blocks are reported failed
    w = _worker(meta, _stores(_record("sink1-a", PROMPT[0:5]), _record("sink1-b", PROMPT[5:9])))
    w.start_load_kv(None)
    assert w.linker.linked == [] and w.get_block_ids_with_load_errors() == {5, 6}  # not block 4 (the prefix hit)
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=w.build_connector_worker_meta()))
    out = c.request_finished(req, [])[1]["epic"]
    assert "simulated" not in out["error"] and "RuntimeError: simulated fault" in _logged_detail(caplog, out)
    assert not (c._parsed or c._results or c._prefix_hits or c._active)


def test_a_compile_whose_capture_cannot_be_prepared_stops_with_its_own_error_and_others_go_on(monkeypatch, caplog):
    c = _scheduler()
    c._kvm = _Blocks()
    bad, good = _req({"epic": {"compile": {"lead": 1}}}, "bad"), _req({"epic": {"compile": {"lead": 1}}}, "good")
    for r in (bad, good):
        c.update_state_after_alloc(r, None, 0)
    real = conn.vllm_api.block_ids_of

    def block_ids_of(kvm, req_id):
        return _boom() if req_id == "bad" else real(kvm, req_id)

    monkeypatch.setattr(conn.vllm_api, "block_ids_of", block_ids_of)
    step = _step(total_tokens=8, new=[SimpleNamespace(req_id="bad", num_computed_tokens=0)])
    step.scheduled_new_reqs.append(SimpleNamespace(req_id="good", num_computed_tokens=0))
    step.num_scheduled_tokens = {"bad": 4, "good": 4}
    with caplog.at_level(logging.ERROR):
        meta = c.build_connector_meta(step)
    assert [s.req_id for s in meta.captures] == ["good"]
    monkeypatch.setattr(conn.vllm_api, "block_ids_of", real)  # the next step: "bad" is never captured again
    step.scheduled_new_reqs = [SimpleNamespace(req_id=r, num_computed_tokens=4) for r in ("bad", "good")]
    meta = c.build_connector_meta(step)
    assert [(s.req_id, s.prompt) for s in meta.captures] == [("good", None)]
    c.update_connector_output(SimpleNamespace(kv_connector_worker_meta=cm.EpicWorkerMeta({"bad": {"stored": "k"}})))
    out = c.request_finished(bad, [])[1]["epic"]  # its own error, never a later outcome of the worker
    assert set(out) == {"error"} and "RuntimeError: simulated fault" in _logged_detail(caplog, out)


def test_request_finished_that_raises_still_forgets_the_request_and_reports_an_error(caplog):
    c = _scheduler()
    req = _req({"epic": {"link": GOOD_LINK}})
    c.get_num_new_matched_tokens(req, 0)
    c._prefix_hits["r"] = "not a pair"  # any fault inside the hook
    with caplog.at_level(logging.ERROR):
        done, out = c.request_finished(req, [])
    assert not done and out["epic"]["error"].startswith("epic: reporting the request's outcome failed (error ")
    assert not (c._parsed or c._results or c._prefix_hits or c._active)
