"""A fleet on one Redis: entries split into parts under Redis' value limit and published atomically, and the
compile lock that has one replica compile a chunk while the others wait for it. Against a real redis-server
started here; the "replicas" are separate store instances (own connections) in threads."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch
from test_store import assert_same, make_kv

from epic_rag.store import RedisStore, codec, open_store
from epic_rag.store import redis_tier as rt
from epic_rag.testing.localredis import free_port

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server binary not installed (apt-get install redis-server)"
)
KEY = "plain-fleet"


@pytest.fixture
def raw(server):
    import redis

    with redis.Redis.from_url(server.url) as r:
        yield r


def all_keys(raw, store: RedisStore) -> list[bytes]:
    return sorted(raw.scan_iter(match=store.prefix + "*"))


def part_keys(raw, store: RedisStore) -> list[bytes]:
    return [k for k in all_keys(raw, store) if b"@part." in k]


def entry_size(kv) -> int:
    return len(codec.encode(kv))


# ------------------------------------------------------------------ parts
def _part_bytes(case: str, n: int) -> int:
    if case == "whole":  # the entry is exactly one part: a single value, as before parts existed
        return n
    if case == "one_byte_over":  # one byte more than a part: two parts, the last of one byte
        return n - 1
    if case == "exact_multiple":  # n = k * part_bytes, k > 1: k full parts
        return next(d for d in range(rt.MIN_PART_BYTES, n // 2 + 1) if n % d == 0)
    return (n // 3) + 1  # "uneven": three parts, the last shorter


@pytest.mark.parametrize("case", ["whole", "one_byte_over", "exact_multiple", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_entry_is_split_into_parts_no_larger_than_max_part_bytes_and_read_back_bit_exact(url, raw, case, dtype):
    kv = make_kv(KEY, dtype=dtype, tokens=64, seed=3)
    n = entry_size(kv)
    pb = _part_bytes(case, n)
    s = open_store(f"{url}&max_part_bytes={pb}")
    s.put(kv)
    parts = part_keys(raw, s)
    assert len(parts) == (0 if pb >= n else -(-n // pb))
    if case == "one_byte_over":
        assert sorted(raw.strlen(k) for k in parts) == [1, pb]
    if case == "exact_multiple":
        assert len(parts) >= 2 and {raw.strlen(k) for k in parts} == {pb}
    assert max(raw.strlen(k) for k in all_keys(raw, s)) <= pb  # no value (manifest included) exceeds it
    assert all(raw.pttl(k) == -1 for k in parts)  # published: no provisional expiry left
    reader = open_store(f"{url}&max_part_bytes=1M")  # a reader's own part size does not matter
    assert_same(reader.get(KEY), kv)
    assert reader.keys() == [KEY] and reader.contains(KEY)
    assert reader.usage() == {KEY: n}
    assert reader.stats.corrupt == 0 and reader.stats.errors == 0


def test_entry_within_max_part_bytes_is_the_single_value_readers_before_parts_read(url, raw):
    s = open_store(f"{url}&max_part_bytes=1M")
    kv = make_kv(KEY)
    s.put(kv)
    assert raw.get(s._rkey(KEY)) == codec.encode(kv) and part_keys(raw, s) == []


def test_single_value_written_before_parts_stays_readable_above_max_part_bytes(url, raw):
    kv = make_kv(KEY, tokens=64)
    s = open_store(f"{url}&max_part_bytes=1K")
    raw.set(s._rkey(KEY), codec.encode(kv))  # what the tier wrote before it split entries
    assert_same(s.get(KEY), kv)
    assert s.usage() == {KEY: entry_size(kv)}


def test_parts_with_ttl_expire_with_their_manifest(url, raw):
    s = open_store(f"{url}&max_part_bytes=1K&ttl=60")
    s.put(make_kv(KEY, tokens=64))
    assert all(0 < raw.pttl(k) <= 60_000 for k in all_keys(raw, s))


def test_int8_entries_are_split_in_their_own_namespace(url, raw):
    exact, q8 = open_store(f"{url}&max_part_bytes=1K"), open_store(f"{url}&max_part_bytes=1K&quant=int8")
    kv = make_kv(KEY, tokens=128)
    exact.put(kv)
    q8.put(kv)
    assert exact.keys() == [KEY] == q8.keys()
    assert_same(exact.get(KEY), kv) and q8.get(KEY).quant == "int8"
    q8.clear()
    assert_same(exact.get(KEY), kv) and q8.get(KEY) is None
    assert all(b"@int8" not in k for k in all_keys(raw, exact))


def test_reader_concurrent_with_an_overwriting_writer_gets_one_whole_entry_never_a_mix(url, raw):
    # Two different entries under one key (a content-addressed key never changes content; a forced
    # overwrite is the worst case for a reader): the writer alternates them, readers loop meanwhile.
    a, b = make_kv(KEY, tokens=128, seed=1), make_kv(KEY, tokens=128, seed=2)
    writer = open_store(f"{url}&max_part_bytes=1K")  # ~13 KB entries: 13 parts each
    writer.put(a)
    stop = threading.Event()
    seen, bad = {"a": 0, "b": 0, "miss": 0}, []

    def read():
        r = open_store(f"{url}&max_part_bytes=1K")
        while not stop.is_set():
            got = r.get(KEY)
            if got is None:
                seen["miss"] += 1
            elif torch.equal(got.k, a.k) and torch.equal(got.v, a.v) and got.token_ids == a.token_ids:
                seen["a"] += 1
            elif torch.equal(got.k, b.k) and torch.equal(got.v, b.v) and got.token_ids == b.token_ids:
                seen["b"] += 1
            else:
                bad.append(got)
        if r.stats.corrupt:
            bad.append(f"{r.stats.corrupt} corrupt")

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    t0, writes = time.monotonic(), 0
    while time.monotonic() - t0 < 2.0 or seen["a"] + seen["b"] < 20:
        writer.put(b if writes % 2 == 0 else a)
        writes += 1
    stop.set()
    for t in readers:
        t.join(30)
    assert bad == [] and seen["miss"] == 0, (seen, bad[:1])
    assert seen["a"] + seen["b"] >= 20 and writes > 10
    # Only the current entry's parts stay for good; those of replaced entries expire after the grace time.
    current = raw.get(writer._rkey(KEY))
    wid = rt.parse_manifest(current, KEY, "none")["id"]
    for k in part_keys(raw, writer):
        ttl = raw.pttl(k)
        assert ttl == -1 if wid.encode() in k else 0 < ttl <= rt.PART_GRACE_S * 1000


class _Crash(BaseException):
    """The writer process dying (not an error the tier handles)."""


class _DiesBeforeTheManifest:
    """A client whose MULTI/EXEC (the manifest's publication) never happens: the writer died after its parts."""

    def __init__(self, client):
        self._client = client

    def pipeline(self, transaction=True):
        if transaction:
            raise _Crash()
        return self._client.pipeline(transaction=False)

    def __getattr__(self, name):
        return getattr(self._client, name)


@pytest.mark.parametrize("before", ["old_entry", "nothing"])
def test_writer_dying_between_its_parts_and_its_manifest_leaves_the_old_entry_or_a_miss(url, raw, before):
    old, new = make_kv(KEY, tokens=64, seed=1), make_kv(KEY, tokens=64, seed=2)
    s = open_store(f"{url}&max_part_bytes=1K")
    if before == "old_entry":
        s.put(old)
    parts_before = set(part_keys(raw, s))
    s._client = _DiesBeforeTheManifest(s._client)
    with pytest.raises(_Crash):
        s.put(new)
    reader = open_store(f"{url}&max_part_bytes=1K")
    if before == "old_entry":
        assert_same(reader.get(KEY), old)
    else:
        assert reader.get(KEY) is None and not reader.contains(KEY) and reader.keys() == []
    assert reader.stats.corrupt == 0
    orphans = set(part_keys(raw, s)) - parts_before
    assert len(orphans) == -(-entry_size(new) // 1024)  # written, never named by a manifest...
    assert all(0 < raw.pttl(k) <= rt.PART_PENDING_S * 1000 for k in orphans)  # ...and they expire


def test_a_part_gone_missing_is_a_miss_and_the_dead_entry_is_removed(url, raw):
    s = open_store(f"{url}&max_part_bytes=1K")
    s.put(make_kv(KEY, tokens=64))
    raw.delete(part_keys(raw, s)[1])  # evicted under maxmemory, say
    assert s.get(KEY) is None
    assert s.stats.corrupt == 0 and s.stats.misses == 1
    assert all_keys(raw, s) == []  # manifest and the remaining parts dropped: the chunk will be recompiled


def test_a_damaged_part_is_refused_as_corrupt_and_the_entry_dropped(url, raw):
    s = open_store(f"{url}&max_part_bytes=1K")
    s.put(make_kv(KEY, tokens=64))
    k = part_keys(raw, s)[2]
    data = bytearray(raw.get(k))
    data[100] ^= 1
    raw.set(k, bytes(data))
    assert s.get(KEY) is None and s.stats.corrupt == 1
    assert all_keys(raw, s) == []


def test_a_manifest_naming_the_parts_of_another_write_is_refused(url, raw):
    # Two valid entries of one key; the manifest of the first pointed at the parts of the second (same count
    # and size): every part is whole and the entry decodes, but it is not the entry the manifest names.
    s = open_store(f"{url}&max_part_bytes=1K")
    s.put(make_kv(KEY, tokens=64, seed=1))
    first = raw.get(s._rkey(KEY))
    s.put(make_kv(KEY, tokens=64, seed=2))
    second = rt.parse_manifest(raw.get(s._rkey(KEY)), KEY, "none")
    m = rt.parse_manifest(first, KEY, "none")
    forged = rt.make_manifest(KEY, "none", second["id"], m["parts"], m["part_bytes"], m["size"], m["sha256"])
    raw.set(s._rkey(KEY), forged)
    assert s.get(KEY) is None and s.stats.corrupt == 1


def test_with_a_secret_an_entry_assembled_from_parts_is_checked_against_it(url):
    kv = make_kv(KEY, tokens=64)
    open_store(f"{url}&max_part_bytes=1K").put(kv)  # written without the deployment secret
    signed = open_store(f"{url}&max_part_bytes=1K&secret=s3")
    assert signed.get(KEY) is None and signed.stats.corrupt == 1
    signed.put(kv)
    assert_same(signed.get(KEY), kv)


def test_delete_and_clear_remove_the_parts_too(url, raw):
    s = open_store(f"{url}&max_part_bytes=1K")
    s.put(make_kv(KEY, tokens=64))
    s.put(make_kv("plain-other", tokens=64))
    raw.set("someone-else:key", b"x")
    assert s.delete(KEY) and not s.delete(KEY)
    assert s.keys() == ["plain-other"] and all(KEY.encode() not in k for k in all_keys(raw, s))
    assert s.clear() == 1
    assert all_keys(raw, s) == [] and raw.get("someone-else:key") == b"x"


@pytest.mark.parametrize(
    "query, match",
    [
        ("max_part_bytes=600M", "max_part_bytes must be between"),
        ("max_part_bytes=512", "max_part_bytes must be between"),
        ("max_part_bytes=lots", "max_part_bytes must be a byte count"),
        ("lock_ttl=-1", "lock_ttl must be a finite number"),
    ],
)
def test_bad_part_size_or_lock_ttl_is_a_clear_error(query, match):
    with pytest.raises(ValueError, match=match):
        open_store(f"redis://127.0.0.1:{free_port()}/0?timeout=0.2&{query}")


# ------------------------------------------------------------------ compile lock
def test_two_replicas_needing_the_same_chunk_at_once_compile_it_once_and_the_other_loads_it(url):
    kv = make_kv(KEY, tokens=64)
    replicas = [open_store(f"memory+{url}&max_part_bytes=1K") for _ in range(2)]
    compiles, got = [], {}
    start = threading.Barrier(2)

    def replica(i: int) -> None:
        store = replicas[i]
        start.wait()
        if store.get(KEY) is None:
            with store.compile_lock(KEY) as lock:
                if lock.found is None:
                    compiles.append(i)
                    time.sleep(0.5)  # compiling
                    store.put(kv)
                    got[i] = kv
                else:
                    got[i] = lock.found

    threads = [threading.Thread(target=replica, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(compiles) == 1
    waiter = 1 - compiles[0]
    assert_same(got[waiter], kv)
    stats = [r.tier_stats()["redis"] for r in replicas]
    assert stats[waiter]["fleet_waits"] == 1 and stats[compiles[0]]["fleet_waits"] == 0
    assert sum(s["fleet_takeovers"] for s in stats) == 0 and sum(s["puts"] for s in stats) == 1
    assert replicas[waiter].tiers[0].contains(KEY)  # loaded into the waiter's memory tier


def test_replica_that_missed_just_before_another_published_loads_instead_of_compiling(url):
    first, second = open_store(url), open_store(url)
    assert second.get(KEY) is None  # a miss...
    first.put(make_kv(KEY))  # ...then another replica publishes before this one takes the lock
    lock = second.compile_lock(KEY)
    assert not lock.acquire() and not lock.held
    assert_same(lock.wait(), make_kv(KEY))
    assert second.stats.fleet_waits == 1


def test_lock_of_a_dead_holder_expires_and_the_waiter_compiles(url):
    holder, waiter = open_store(f"{url}&lock_ttl=0.5"), open_store(f"{url}&lock_ttl=0.5")
    assert holder.compile_lock(KEY).acquire()  # then the holder dies: never stores, never releases
    lock = waiter.compile_lock(KEY)
    t0 = time.monotonic()
    assert not lock.acquire()
    assert lock.wait() is None and lock.held  # the lock expired: the waiter holds it now and compiles
    assert 0.3 < time.monotonic() - t0 < 1.5
    assert waiter.stats.fleet_takeovers == 1 and waiter.stats.fleet_waits == 0
    lock.release()


def test_holder_releasing_without_publishing_hands_the_compile_to_the_waiter(url):
    holder, waiter = open_store(url), open_store(url)  # default lock ttl (120 s): not what ends the wait
    held = holder.compile_lock(KEY)
    assert held.acquire()
    lock = waiter.compile_lock(KEY)
    assert not lock.acquire()
    threading.Timer(0.3, held.release).start()  # its compile failed, or its write was refused
    t0 = time.monotonic()
    assert lock.wait() is None and lock.held
    assert time.monotonic() - t0 < 2.0
    lock.release()


def test_wait_is_bounded_when_the_lock_stays_taken(url):
    holder, waiter = open_store(f"{url}&lock_ttl=30"), open_store(f"{url}&lock_ttl=30")
    assert holder.compile_lock(KEY).acquire()
    lock = waiter.compile_lock(KEY)
    assert not lock.acquire()
    t0 = time.monotonic()
    assert lock.wait(timeout=0.4) is None and not lock.held  # compiles without the lock
    assert 0.3 < time.monotonic() - t0 < 1.5 and waiter.stats.fleet_takeovers == 1


def test_lock_is_released_only_by_its_holder(url, raw):
    first, second = open_store(f"{url}&lock_ttl=0.2"), open_store(f"{url}&lock_ttl=30")
    mine = first.compile_lock(KEY)
    assert mine.acquire()
    time.sleep(0.35)  # expired: the first holder overran its ttl
    theirs = second.compile_lock(KEY)
    assert theirs.acquire()
    mine.release()  # must not release the second holder's lock
    name = f"{second.prefix}{KEY}@compile"
    assert raw.exists(name) and not first.compile_lock(KEY).acquire()
    theirs.release()
    assert not raw.exists(name)


@pytest.mark.parametrize("spec", ["memory", "disk:{tmp}/kv", "memory+disk:{tmp}/kv"])
def test_compile_lock_of_a_store_without_redis_is_granted_at_once(spec, tmp_path):
    s = open_store(spec.format(tmp=tmp_path))
    lock = s.compile_lock(KEY)
    assert not lock.shared and lock.acquire() and lock.acquire()  # nothing shared to wait for
    assert lock.wait() is None
    with s.compile_lock(KEY) as again:
        assert again.found is None


def test_lock_ttl_zero_turns_the_lock_off(url):
    a, b = open_store(f"{url}&lock_ttl=0"), open_store(f"{url}&lock_ttl=0")
    assert not a.compile_lock(KEY).shared
    assert a.compile_lock(KEY).acquire() and b.compile_lock(KEY).acquire()


def test_unreachable_redis_does_not_hold_up_compiles():
    s = open_store(f"memory+redis://127.0.0.1:{free_port()}/0?timeout=0.3&retry_s=60")
    t0 = time.monotonic()
    lock = s.compile_lock(KEY)
    assert lock.shared and lock.acquire() and not lock.held
    assert lock.wait() is None
    assert time.monotonic() - t0 < 1.0
