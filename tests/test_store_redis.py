"""Redis tier against a real redis-server started here (127.0.0.1, free port, no persistence)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import socket
import time

import pytest
import torch
from test_store import DTYPES, assert_same, make_kv

from epic_rag.store import DiskStore, RedisStore, TieredStore, codec, open_store
from epic_rag.store import redis_tier as rt
from epic_rag.testing.localredis import LocalRedis, free_port

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server binary not installed (apt-get install redis-server)"
)


def raw(server):
    import redis

    return redis.Redis.from_url(server.url)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_redis_round_trip_is_bit_exact(url, dtype):
    s = open_store(url)
    kv = make_kv(dtype=dtype, base_pos=5)
    s.put(kv)
    assert_same(s.get(kv.key), kv)
    assert s.keys() == [kv.key] and s.contains(kv.key)
    assert s.tier_stats()["redis"]["hits"] == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_redis_int8_round_trip_within_half_a_step_and_separate_from_exact(url, dtype):
    exact, q8 = open_store(url), open_store(url + "&quant=int8")
    kv = make_kv(dtype=dtype, tokens=40)
    q8.put(kv)
    assert exact.get(kv.key) is None and exact.stats.corrupt == 0
    got = q8.get(kv.key)
    step = kv.k.float().abs().amax(-1, keepdim=True) / 127
    assert (
        got.k.dtype == dtype and ((got.k.float() - kv.k.float()).abs() <= step / 2 + got.k.float().abs() * 2**-7).all()
    )
    exact.put(kv)
    assert_same(exact.get(kv.key), kv)


def test_missing_key_is_just_a_miss(url):
    s = open_store(url)
    assert s.get("plain-nothere") is None
    assert s.stats.misses == 1 and s.stats.errors == 0 and s.stats.corrupt == 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_redis_value_is_dropped_and_counted(url, server, damage, caplog):
    s = open_store(url)
    kv = make_kv()
    s.put(kv)
    r = raw(server)
    rkey = s._rkey(kv.key)
    data = bytearray(r.get(rkey))
    if damage == "flip":
        data[-7] ^= 1
    elif damage == "truncate":
        data = data[: len(data) // 2]
    else:
        data = bytearray(b"not a safetensors file")
    r.set(rkey, bytes(data))
    with caplog.at_level(logging.WARNING, logger="epic_rag.store"):
        assert s.get(kv.key) is None
    assert s.stats.corrupt == 1 and "corrupt entry" in caplog.text
    assert r.exists(rkey) == 0


@pytest.mark.parametrize("what", ["value", "manifest"])
def test_a_value_or_manifest_nested_past_the_depth_limit_is_dropped_as_a_corrupt_miss(url, server, what):
    # Review 3 C: a 100k-deep header or parts manifest raised RecursionError out of RedisStore.get: never
    # dropped, every link to the key failed.
    from test_store import _nested_entry

    s = open_store(url + "&secret=s3cret")
    kv = make_kv()
    r, rkey = raw(server), s._rkey(kv.key)
    deep = b"[" * 100_000 + b"]" * 100_000
    r.set(rkey, _nested_entry(kv, "epic header") if what == "value" else rt.MANIFEST + deep)
    assert s.get(kv.key) is None
    assert s.stats.corrupt == 1 and s.stats.misses == 1 and r.exists(rkey) == 0
    s.put(kv)
    assert_same(s.get(kv.key), kv)


@pytest.mark.parametrize(
    "part, tokens, decodes",
    [("256M", 40, False), ("1K", 40, False), ("1K", 300, True)],
    ids=["one value", "parts", "tokens past the first part"],
)
def test_redis_peek_reads_a_records_tokens_by_range_without_its_kv(url, monkeypatch, part, tokens, decodes):
    s = open_store(url + f"&max_part_bytes={part}")
    kv = make_kv(tokens=tokens)
    kv.tenant = "ab" * 32
    s.put(kv)
    if not decodes:  # read by range: no entry decoded (else the whole entry is read, and checked, instead)
        monkeypatch.setattr(codec, "decode", None)
    head = s.peek(kv.key)
    assert (head.token_ids, head.tenant, head.base_pos) == (kv.token_ids, kv.tenant, kv.base_pos)
    assert s.peek("plain-nothere") is None and s.stats.corrupt == 0


def test_ttl_expires_entries(url, server):
    s = open_store(url + "&ttl=0.3")
    kv = make_kv()
    s.put(kv)
    assert 0 < raw(server).pttl(s._rkey(kv.key)) <= 300
    assert s.get(kv.key) is not None
    time.sleep(0.5)
    assert s.get(kv.key) is None and s.stats.errors == 0


def test_keys_evicted_under_maxmemory_are_plain_misses(tmp_path):
    with LocalRedis(tmp_path, extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]) as r:
        s = open_store(r.url)
        kvs = [make_kv(f"plain-{i}", seed=i, tokens=1024) for i in range(20)]  # ~400 KB each, 8 MB in all
        for kv in kvs:
            s.put(kv)
        assert_same(s.get(kvs[-1].key), kvs[-1])
        got = [s.get(kv.key) for kv in kvs[:-1]]
        assert sum(g is None for g in got) >= 10  # evicted by Redis: misses, nothing else
        for g, kv in zip(got, kvs):
            if g is not None:
                assert_same(g, kv)
        assert s.stats.errors == 0 and s.stats.corrupt == 0 and s.stats.available == 1


def test_write_refused_under_noeviction_is_logged_and_skipped(tmp_path, caplog):
    with LocalRedis(tmp_path, extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "noeviction"]) as r:
        s = open_store(r.url)
        with caplog.at_level(logging.ERROR, logger="epic_rag.store"):
            for i in range(6):
                s.put(make_kv(f"plain-{i}", seed=i, tokens=2048))  # ~800 KB each
        assert "refused a write" in caplog.text and "maxmemory" in caplog.text
        assert s.stats.errors >= 1 and s.available
        assert s.get("plain-0") is not None


def test_redis_killed_mid_run_serves_lower_tiers_and_reconnects_after_restart(tmp_path, caplog):
    r = LocalRedis(tmp_path / "redis").start()
    try:
        s = open_store(f"memory+disk:{tmp_path}/disk+{r.url}?timeout=0.5&retry_s=0.5")
        mem, disk, red = s.tiers
        a, b, c = (make_kv(f"plain-{n}", seed=i) for i, n in enumerate("abc"))
        s.put(a)
        assert red.contains(a.key)
        r.stop()  # killed, like a crash
        mem.clear()
        with caplog.at_level(logging.WARNING, logger="epic_rag.store"):
            t0 = time.monotonic()
            assert_same(s.get(a.key), a)  # from disk
            s.put(b)  # disk and memory only; no exception
            assert s.get("plain-zzz") is None
            assert time.monotonic() - t0 < 3
        assert "unreachable" in caplog.text and caplog.text.count("unreachable") == 1
        st = s.tier_stats()["redis"]
        assert st["available"] == 0 and st["errors"] >= 1
        assert disk.contains(b.key) and not red.available
        r.start()  # back, empty (no persistence)
        time.sleep(0.6)  # past the back-off
        with caplog.at_level(logging.WARNING, logger="epic_rag.store"):
            s.put(c)
        assert "reachable again" in caplog.text
        assert red.available and s.tier_stats()["redis"]["available"] == 1
        assert_same(red.get(c.key), c)
        mem.clear()
        disk.clear()
        assert_same(s.get(c.key), c)  # now served by Redis again
    finally:
        r.stop()


def test_redis_down_at_start_is_a_warning_then_the_tier_joins_when_it_appears(tmp_path, caplog):
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="epic_rag.store"):
        s = open_store(f"memory+redis://127.0.0.1:{port}/0?timeout=0.5&retry_s=0.3")
    assert "unreachable" in caplog.text
    mem, red = s.tiers
    kv = make_kv()
    s.put(kv)
    assert_same(s.get(kv.key), kv) and not red.contains(kv.key)
    with LocalRedis(tmp_path, port=port):
        time.sleep(0.4)
        s.put(kv)
        assert red.available and red.contains(kv.key)


def test_server_that_never_answers_does_not_block_longer_than_the_timeout(caplog):
    # A listening socket that never replies: connects succeed, every command would wait forever.
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    try:
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="epic_rag.store"):
            s = RedisStore(f"redis://127.0.0.1:{hung.getsockname()[1]}/0", timeout=0.3, retry_s=60)
        assert time.monotonic() - t0 < 1.5 and "TimeoutError" in caplog.text
        t0 = time.monotonic()
        assert s.get("plain-aaaa") is None
        s.put(make_kv())
        for _ in range(20):  # skipped without network while down
            assert s.get("plain-aaaa") is None
        assert time.monotonic() - t0 < 0.5
        assert not s.available
    finally:
        hung.close()


def test_unroutable_host_never_blocks_longer_than_the_timeout():
    t0 = time.monotonic()
    s = RedisStore("redis://10.255.255.1:6379/0", timeout=0.3, retry_s=60)
    assert s.get("plain-aaaa") is None
    s.put(make_kv())
    assert time.monotonic() - t0 < 2.0
    assert not s.available


def test_hits_in_redis_are_promoted_to_memory_and_disk(url, tmp_path):
    s = open_store(f"memory+disk:{tmp_path}+{url}")
    assert isinstance(s, TieredStore)
    mem, disk, red = s.tiers
    kv = make_kv(dtype=torch.bfloat16)
    red.put(kv)
    assert_same(s.get(kv.key), kv)
    assert mem.contains(kv.key) and disk.contains(kv.key)
    assert_same(DiskStore(tmp_path).get(kv.key), kv)


def test_clear_deletes_only_this_prefix(url, server):
    s = open_store(url)
    s.put(make_kv())
    r = raw(server)
    r.set("someone-else:key", b"x")
    assert s.clear() == 1
    assert s.keys() == [] and r.get("someone-else:key") == b"x"


def test_usage_and_refresh_report_entries_and_bytes(url):
    s = open_store(url)
    kv = make_kv()
    s.put(kv)
    s.refresh()
    n = len(codec.encode(kv))
    assert s.usage() == {kv.key: n}
    assert (s.stats.entries, s.stats.bytes) == (1, n)


def _redis_writer(url: str, rounds: int) -> None:
    s = open_store(url)
    kv = make_kv("plain-shared", seed=7, tokens=256)
    for _ in range(rounds):
        s.put(kv)
        assert s.get(kv.key) is not None


def test_two_processes_writing_the_same_chunk_to_redis_leave_one_valid_entry(url):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_redis_writer, args=(url, 30)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    s = open_store(url)
    assert s.keys() == ["plain-shared"]
    assert_same(s.get("plain-shared"), make_kv("plain-shared", seed=7, tokens=256))


def test_cli_stats_reads_a_live_redis(url):
    from test_store import _OUT, _cli

    open_store(url).put(make_kv())
    assert _cli("store", "stats", "--store", url) == 0
    assert "redis: 1 entries" in _OUT.out


def test_redis_with_a_secret_refuses_and_drops_an_entry_planted_without_it(url, server):
    kv = make_kv(seed=7)
    open_store(url).put(kv)  # a writer to the shared Redis without the deployment secret
    signed = open_store(url + "&secret=s3")
    assert signed.get(kv.key) is None and signed.stats.corrupt == 1
    assert not signed.contains(kv.key)
    signed.put(kv)
    assert_same(signed.get(kv.key), kv)


@pytest.mark.parametrize("size_gib", [0.5, 100], ids=["within-the-cap", "over-the-cap"])
def test_a_planted_parts_manifest_sizes_no_allocation_before_its_parts_arrive(url, server, size_gib):
    """Anyone who can write the Redis (the HMAC covers entries, not manifests) planted a manifest announcing a
    huge entry: the reader allocated it zero-filled before fetching a single part. Now a size over the cap is
    refused, and a buffer grows only with parts that arrive (here none: a miss)."""
    import tracemalloc

    from epic_rag.store.redis_tier import MAX_ENTRY_BYTES, make_manifest

    s = open_store(url)
    key, size = "plain-planted", int(size_gib * (1 << 30))
    parts = -(-size // (256 << 20))
    raw(server).set(s._rkey(key), make_manifest(key, "none", "0" * 32, parts, 256 << 20, size, "0" * 64))
    tracemalloc.start()
    try:
        assert s.get(key) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, peak
    assert (size > MAX_ENTRY_BYTES) == (s.stats.corrupt == 1)


def test_one_tenant_filling_its_redis_quota_leaves_another_tenants_hit_rate_unchanged(url, server):
    # Review 3 B, in the tier every replica shares: the flood deletes its own oldest entries, never the victim's.
    from test_store import FLOOD, VICTIM, hit_rate, quota_evictions, tenant_kv

    one = len(codec.encode(tenant_kv(FLOOD, 0)))
    s = open_store(url + f"&tenant_max_bytes={one * 4}")
    peer = open_store(url + f"&tenant_max_bytes={one * 4}")  # another replica, same quota
    victim = [tenant_kv(VICTIM, i) for i in range(3)]
    for kv in victim:
        s.put(kv)
    before = hit_rate(s, [kv.key for kv in victim])
    counted = quota_evictions("redis")
    for i in range(20):
        (s if i % 2 else peer).put(tenant_kv(FLOOD, i))
    assert before == hit_rate(s, [kv.key for kv in victim]) == 1.0
    for kv in victim:
        assert_same(s.get(kv.key), kv)
    flood = [f"plain-bb{i}" for i in range(20)]
    assert [k for k in flood if s.contains(k)] == flood[-4:]  # its four most recent
    assert s.tenant_usage()[FLOOD] == (one * 4, 4) and s.tenant_usage()[VICTIM][1] == 3
    assert s.stats.quota_evictions + peer.stats.quota_evictions == 16 == quota_evictions("redis") - counted
    assert sorted(s.keys()) == sorted([kv.key for kv in victim] + flood[-4:])  # the lists are no entries


def test_redis_quota_lists_forget_entries_that_expired_without_evicting_for_them(url, server):
    from test_store import FLOOD, tenant_kv

    s = open_store(url + "&tenant_max_entries=2")
    a0, a1, a2 = (tenant_kv(FLOOD, i) for i in range(3))
    s.put(a0)
    s.put(a1)
    raw(server).delete(s._rkey(a0.key))  # gone behind the tier's back (ttl, maxmemory)
    s.put(a2)
    assert s.contains(a1.key) and s.contains(a2.key) and s.stats.quota_evictions == 0
    assert s.tenant_usage()[FLOOD][1] == 2
    s.clear()
    assert raw(server).keys(s.prefix + "*") == []  # the lists go with the entries
