"""Chunk KV store: spec parsing, memory and disk tiers, integrity, int8 mode, stacks, CLI (no Redis here:
see test_store_redis.py). Everything runs against real folders; no mocks."""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from epic_rag.store import ChunkKV, CorruptEntry, DiskStore, MemoryStore, TieredStore, codec, open_store
from epic_rag.store.base import TenantQuota
from epic_rag.store.spec import parse_size

L, T, H, D = 3, 17, 2, 8
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_kv(
    key: str = "plain-aaaa", dtype=torch.float32, seed: int = 0, tokens: int = T, base_pos: int = 0, shape=(L, H, D)
) -> ChunkKV:
    g = torch.Generator().manual_seed(seed)
    n_layers, h, d = shape
    k = (torch.randn(n_layers, tokens, h, d, generator=g) * 3).to(dtype)
    v = torch.randn(n_layers, tokens, h, d, generator=g).to(dtype)
    return ChunkKV(key, [int(x) for x in torch.randint(0, 50000, (tokens,), generator=g)], k, v, base_pos)


def assert_same(a: ChunkKV, b: ChunkKV) -> None:
    assert a.key == b.key and a.token_ids == b.token_ids and a.base_pos == b.base_pos
    assert a.k.dtype == b.k.dtype and a.v.dtype == b.v.dtype
    assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))  # bit-exact, NaN-safe
    assert torch.equal(a.v.view(torch.uint8), b.v.view(torch.uint8))


def entry_path(store: DiskStore, key: str) -> Path:
    return store._path(key)


# ------------------------------------------------------------------ specs
@pytest.mark.parametrize(
    "spec, kinds",
    [
        ("memory", ["MemoryStore"]),
        ("memory:1000", ["MemoryStore"]),
        ("memory?max_bytes=2G&quant=int8", ["MemoryStore"]),
        ("disk:{tmp}/a", ["DiskStore"]),
        ("memory+disk:{tmp}/a?max_bytes=10M", ["MemoryStore", "DiskStore"]),
        ("memory+disk:{tmp}/a+b+disk:{tmp}/c?quant=int8", ["MemoryStore", "DiskStore", "DiskStore"]),
        ("gpu?max_bytes=1M&device=cpu+memory?pin=0", ["DeviceStore", "MemoryStore"]),
    ],
)
def test_good_specs_open_the_tiers_they_name(spec, kinds, tmp_path):
    s = open_store(spec.format(tmp=tmp_path))
    tiers = s.tiers if isinstance(s, TieredStore) else [s]
    assert [type(t).__name__ for t in tiers] == kinds
    if spec.startswith("memory:"):
        assert tiers[0].max_bytes == 1000
    if "quant=int8" in spec:
        assert tiers[-1].quant == "int8"
    if "a+b" in spec:  # '+' inside a path is kept when no tier scheme follows it
        assert tiers[1].root == tmp_path / "a+b"
        assert list(s.tier_stats()) == ["memory", "disk", "disk2"]


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "non-empty"),
        ("   ", "non-empty"),
        ("memroy", "unknown tier"),
        ("s3://bucket", "unknown tier"),
        ("memory+", "empty tier"),
        ("disk:", "needs a folder"),
        ("memory?max_bytes=lots", "byte count"),
        ("memory?max_bytes=0", "at least one byte"),
        ("memory?quant=int4", "quant must be one of"),
        ("memory?colour=red", "unknown memory option 'colour'"),
        ("memory?max_bytes=1G&max_bytes=2G", "given twice"),
        ("memory?max_bytes", "bad query"),
        ("memory+memory", "more than one memory tier"),
        ("disk:/tmp/x?ttl=5", "unknown disk option 'ttl'"),
        ("disk:/tmp/x?fsync=maybe", "fsync"),
        ("redis://", "no host"),
        ("redis://localhost:notaport/0", "bad port"),
        ("redis://localhost:6379/zero", "db must be a number"),
        ("redis://localhost:6379/0?ttl=-1", "ttl must be a finite number"),
        ("redis://localhost:6379/0?timeout=abc", "timeout must be a number"),
        ("gpu", "needs max_bytes"),
        ("memory+gpu?max_bytes=1G", "must be the first"),
        ("gpu?max_bytes=1G&quant=int8", "unknown gpu option 'quant'"),
        ("memory?pin=yes", "pin must be"),
    ],
)
def test_bad_specs_raise_value_error_with_a_clear_message(spec, match):
    with pytest.raises(ValueError, match=match):
        open_store(spec)


def test_sizes_use_binary_units():
    assert parse_size("512") == 512
    assert parse_size("4k") == 4096
    assert parse_size("1.5M") == 1536 * 1024
    assert parse_size("2GiB") == parse_size("2G") == parse_size("2gb") == 2 << 30


def test_bad_keys_are_refused():
    s = MemoryStore()
    for key in ["", "../etc/passwd", "a/b", "x@int8", "-lead"]:
        with pytest.raises(ValueError, match="invalid chunk key"):
            s.get(key)


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ["memory", "disk:{tmp}/d", "memory+disk:{tmp}/d"])
def test_round_trip_is_bit_exact(spec, dtype, tmp_path):
    s = open_store(spec.format(tmp=tmp_path))
    kv = make_kv(dtype=dtype, base_pos=3)
    s.put(kv)
    got = s.get(kv.key)
    assert_same(got, kv)
    assert got.quant == "none"
    if isinstance(s, TieredStore):  # and straight from the disk tier, not the memory copy
        assert_same(s.tiers[1].get(kv.key), kv)


def test_round_trip_keeps_special_values_bit_exact(tmp_path):
    kv = make_kv()
    kv.k[0, 0, 0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    s = DiskStore(tmp_path)
    s.put(kv)
    assert_same(s.get(kv.key), kv)


def test_disk_entries_are_plain_safetensors_with_a_json_header(tmp_path):
    from safetensors import safe_open

    s = DiskStore(tmp_path)
    kv = make_kv(dtype=torch.bfloat16)
    s.put(kv)
    with safe_open(str(entry_path(s, kv.key)), "pt") as f:
        assert sorted(f.keys()) == ["k", "token_ids", "v"]
        meta = json.loads(f.metadata()["epic"])
        assert torch.equal(f.get_tensor("k"), kv.k)
    assert meta["key"] == kv.key and meta["dtype"] == "bfloat16" and meta["shape"] == [L, T, H, D]
    assert meta["quant"] == "none" and len(meta["sha256"]) == 64
    assert b"pickle" not in entry_path(s, kv.key).read_bytes()[:200]


# ------------------------------------------------------------------ budgets
def test_memory_lru_evicts_oldest_under_its_byte_budget():
    size = make_kv().nbytes
    s = MemoryStore(max_bytes=int(size * 2.5))
    for i in range(3):
        s.put(make_kv(f"plain-{i}", seed=i))
        if i == 1:
            assert s.get("plain-0") is not None  # 0 is now more recent than 1
    assert s.keys() == ["plain-0", "plain-2"]
    assert s.stats.evictions == 1 and s.stats.bytes == 2 * size <= s.max_bytes


def test_disk_evicts_least_recently_used_files_under_its_budget(tmp_path):
    one = len(codec.encode(make_kv()))
    s = DiskStore(tmp_path, max_bytes=int(one * 3.2))
    for i in range(3):
        s.put(make_kv(f"plain-{i}", seed=i))
        time.sleep(0.02)
    assert s.get("plain-0") is not None  # touches plain-0: now the most recent
    time.sleep(0.02)
    s.put(make_kv("plain-3", seed=3))  # 4 files > budget: evict the oldest down to 90%
    assert sorted(s.keys()) == ["plain-0", "plain-3"]
    assert s.stats.evictions == 2
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= s.max_bytes
    assert s.get("plain-1") is None


def test_entry_larger_than_the_budget_is_not_stored(tmp_path):
    kv = make_kv()
    m, d = MemoryStore(max_bytes=kv.nbytes - 1), DiskStore(tmp_path, max_bytes=kv.nbytes // 2)
    m.put(kv)
    d.put(kv)
    assert m.keys() == [] and d.keys() == []


# ------------------------------------------------------------------ integrity
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("where", ["tensor data", "last byte", "header json", "header length"])
def test_flipped_byte_is_detected_counted_and_removed(where, tmp_path, caplog):
    s = DiskStore(tmp_path)
    kv = make_kv()
    s.put(kv)
    p = entry_path(s, kv.key)
    hlen = int.from_bytes(p.read_bytes()[:8], "little")
    offset = {"tensor data": 8 + hlen + 100, "last byte": -1, "header json": 8 + hlen // 2, "header length": 1}[where]
    _flip(p, offset)
    with caplog.at_level(logging.WARNING, logger="epic_rag.store"):
        assert s.get(kv.key) is None
    assert s.stats.corrupt == 1 and s.stats.hits == 0
    assert not p.exists()
    assert "corrupt entry" in caplog.text
    s.put(kv)  # a recompiled entry is stored again and served
    assert_same(s.get(kv.key), kv)


@pytest.mark.parametrize("keep", [0, 5, 100, -1])
def test_truncated_file_is_detected_counted_and_removed(keep, tmp_path):
    s = DiskStore(tmp_path)
    kv = make_kv()
    s.put(kv)
    p = entry_path(s, kv.key)
    data = p.read_bytes()
    p.write_bytes(data[:keep] if keep >= 0 else data[:-1])
    assert s.get(kv.key) is None
    assert s.stats.corrupt == 1 and not p.exists()


def _nested_entry(kv: ChunkKV, where: str, depth: int = 100_000) -> bytes:
    """kv's entry with JSON nested `depth` levels deep in its safetensors header or in its epic header."""
    if where == "safetensors header":
        head = b'{"x":' + b"[" * depth + b"]" * depth + b"}"
        return len(head).to_bytes(8, "little") + head
    meta, tensors = codec.pack(kv, "none")
    from safetensors.torch import save

    return save(tensors, metadata={"epic": "[" * depth + "]" * depth})


@pytest.mark.parametrize("secret", [None, "s3cret"], ids=["sha256", "hmac"])
@pytest.mark.parametrize("where", ["safetensors header", "epic header"])
def test_a_header_nested_past_the_depth_limit_is_dropped_as_a_corrupt_miss_not_raised(where, secret, tmp_path):
    # Review 3 C: json.loads of a 100k-deep header raised RecursionError out of DiskStore.get, so the entry was
    # never dropped and every link to its key failed (on_missing: recompute included).
    kv = make_kv()
    data = _nested_entry(kv, where)
    with pytest.raises(CorruptEntry, match="nests deeper"):
        codec.decode(data, kv.key, secret=secret.encode() if secret else None)
    s = DiskStore(tmp_path, secret=secret)
    entry_path(s, kv.key).write_bytes(data)
    assert s.get(kv.key) is None
    assert s.stats.corrupt == 1 and s.stats.misses == 1 and not entry_path(s, kv.key).exists()
    s.put(kv)  # the recompiled entry takes its place
    assert_same(s.get(kv.key), kv)


def test_decode_turns_any_error_of_unforeseen_bytes_into_a_corrupt_entry(monkeypatch):
    # Whatever a check trips over (here: a RecursionError from deep inside), the reader sees CorruptEntry, the
    # one exception every tier drops an entry for.
    kv = make_kv()

    def boom(*a):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(codec, "_check_meta", boom)
    with pytest.raises(CorruptEntry, match="RecursionError"):
        codec.decode(codec.encode(kv), kv.key)


def test_json_depth_counts_brackets_outside_strings_only():
    assert codec.json_depth(b'{"a": [1, {"b": "[[[{{{"}], "c": "\\"}') == 3
    assert codec.json_depth(b'"[[["') == 0 and codec.json_depth(b"[" * 50) == 50


def test_a_fifo_under_a_keys_file_name_is_a_miss_at_once_and_dropped(tmp_path):
    # Review 3 C: open() of a FIFO blocks until a writer comes: DiskStore.get hung inside the engine step.
    s = DiskStore(tmp_path)
    p = entry_path(s, "plain-aaaa")
    os.mkfifo(p)
    got = []
    reader = threading.Thread(target=lambda: got.append(s.get("plain-aaaa")), daemon=True)
    reader.start()
    reader.join(timeout=5)
    try:
        assert not reader.is_alive(), "DiskStore.get blocked on a FIFO"
        assert got == [None] and s.stats.corrupt == 1 and not p.exists()
        assert s.peek("plain-aaaa") is None and not s.contains("plain-aaaa") and s.keys() == []
    finally:
        if reader.is_alive():  # release the blocked reader (old code) so the test process can end
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))


def test_a_symbolic_link_under_a_keys_file_name_is_never_followed(tmp_path):
    # A link planted in the shared folder (to a genuine entry elsewhere, or to any file the engine can read)
    # is not an entry: dropped (the link, never its target) and missed.
    elsewhere = DiskStore(tmp_path / "elsewhere")
    kv = make_kv()
    elsewhere.put(kv)
    s = DiskStore(tmp_path / "tier")
    p = entry_path(s, kv.key)
    p.symlink_to(entry_path(elsewhere, kv.key))
    assert s.get(kv.key) is None
    assert s.stats.corrupt == 1 and not os.path.lexists(p)
    p.symlink_to(entry_path(elsewhere, kv.key))
    assert s.peek(kv.key) is None and not s.contains(kv.key) and s.usage() == {}
    assert_same(elsewhere.get(kv.key), kv)  # the target is untouched


def test_peek_reads_a_records_tokens_and_context_without_its_kv(tmp_path, monkeypatch):
    kv = make_kv()
    kv.tenant, kv.lead = "ab" * 32, "cd" * 32
    for s in (
        MemoryStore(),
        MemoryStore(quant="int8"),
        DiskStore(tmp_path),
        TieredStore([MemoryStore(), DiskStore(tmp_path)]),
    ):
        s.put(kv)
        monkeypatch.setattr(codec, "decode", None)  # no tier may decode a whole entry to peek
        head = s.peek(kv.key)
        monkeypatch.undo()
        assert (head.key, head.token_ids, head.tenant, head.lead, head.base_pos) == (
            kv.key,
            kv.token_ids,
            kv.tenant,
            kv.lead,
            kv.base_pos,
        )
        assert s.peek("plain-nothere") is None and s.stats.hits == 0


def test_entry_of_another_key_is_not_returned(tmp_path):
    # A file holding chunk A's KV under chunk B's name (e.g. a model or dtype change producing a new key
    # while an old file was copied over) must not be served as B.
    s = DiskStore(tmp_path)
    a, b = make_kv("plain-aaaa", seed=1), make_kv("plain-bbbb", seed=2)
    s.put(a)
    shutil.copy(entry_path(s, a.key), entry_path(s, b.key))
    assert s.get(b.key) is None
    assert s.stats.corrupt == 1
    assert_same(s.get(a.key), a)


def test_other_dtype_under_the_same_key_is_a_different_entry(tmp_path):
    # Keys carry the KV dtype (engine fingerprint); the stored header carries it too and is checked.
    s = DiskStore(tmp_path)
    s.put(make_kv("plain-fp32", dtype=torch.float32))
    assert s.get("plain-bf16") is None and s.stats.corrupt == 0
    s.put(make_kv("plain-bf16", dtype=torch.bfloat16))
    assert s.get("plain-fp32").k.dtype == torch.float32
    assert s.get("plain-bf16").k.dtype == torch.bfloat16


def _forge(kv: ChunkKV, **meta_changes) -> bytes:
    """An entry whose header was edited AND whose checksum was recomputed to match (a careful forger)."""
    from safetensors.torch import save

    meta, tensors = codec.pack(kv, "none")
    meta.update(meta_changes)
    meta["sha256"] = codec._digest(meta, ((n, codec._tensor_bytes(tensors[n])) for n in sorted(tensors)))
    return save(tensors, metadata={"epic": json.dumps(meta)})


@pytest.mark.parametrize(
    "change",
    [
        {"dtype": "float16"},
        {"shape": [L, T, H, D * 2]},
        {"shape": [L, T + 1, H, D]},
        {"base_pos": -1},
        {"format": "other/1"},
        {"quant": "int8"},
    ],
)
def test_header_inconsistent_with_tensors_is_rejected_even_with_a_valid_checksum(change, tmp_path):
    kv = make_kv()
    with pytest.raises(CorruptEntry):
        codec.decode(_forge(kv, **change), kv.key)
    s = DiskStore(tmp_path)
    entry_path(s, kv.key).write_bytes(_forge(kv, **change))
    assert s.get(kv.key) is None and s.stats.corrupt == 1


def test_verify_checks_without_touching_lru_order(tmp_path):
    s = DiskStore(tmp_path)
    kv = make_kv()
    s.put(kv)
    p = entry_path(s, kv.key)
    os.utime(p, (1000, 1000))
    assert s.verify(kv.key)
    assert p.stat().st_mtime == 1000
    _flip(p, -1)
    assert not s.verify(kv.key) and not p.exists()


# ------------------------------------------------------------------ deployment secret (HMAC)
SECRET = "a deployment secret"


def test_with_a_secret_an_entry_planted_without_it_is_refused_and_dropped(tmp_path):
    # Anyone who can write the shared folder can compute a sha256; only secret holders can sign.
    DiskStore(tmp_path).put(make_kv(seed=1))
    reader = DiskStore(tmp_path, secret=SECRET)
    assert reader.get("plain-aaaa") is None
    assert reader.stats.corrupt == 1 and not entry_path(reader, "plain-aaaa").exists()


def test_with_a_secret_signed_entries_round_trip_and_another_secret_is_refused(tmp_path):
    kv = make_kv(seed=2)
    DiskStore(tmp_path, secret=SECRET).put(kv)
    assert_same(DiskStore(tmp_path, secret=SECRET).get(kv.key), kv)
    other = DiskStore(tmp_path, secret="another secret")
    assert other.get(kv.key) is None and other.stats.corrupt == 1


def test_with_a_secret_a_forged_entry_with_a_copied_hmac_is_refused(tmp_path):
    # The forger re-computes the sha256 over its own KV and copies a genuine entry's HMAC.
    from safetensors.torch import save

    s = DiskStore(tmp_path, secret=SECRET)
    s.put(make_kv(seed=3))
    genuine = codec.read_header(entry_path(s, "plain-aaaa").read_bytes())[1]
    meta, tensors = codec.pack(make_kv(seed=4), "none")
    meta["sha256"] = codec._digest(meta, ((n, codec._tensor_bytes(tensors[n])) for n in sorted(tensors)))
    meta["hmac"] = genuine["hmac"]
    entry_path(s, "plain-aaaa").write_bytes(save(tensors, metadata={"epic": json.dumps(meta)}))
    assert s.get("plain-aaaa") is None and s.stats.corrupt == 1


def test_a_reader_without_the_secret_still_checks_and_keeps_signed_entries(tmp_path):
    # `store verify` run without the secret must not delete a signed deployment's entries.
    kv = make_kv(seed=5)
    DiskStore(tmp_path, secret=SECRET).put(kv)
    plain = DiskStore(tmp_path)
    assert plain.verify(kv.key) and plain.stats.corrupt == 0
    _flip(entry_path(plain, kv.key), -1)
    assert not plain.verify(kv.key)


def test_the_secret_comes_from_the_spec_or_the_environment_and_is_not_in_repr(tmp_path, monkeypatch):
    monkeypatch.delenv(codec.SECRET_ENV, raising=False)
    assert open_store(f"disk:{tmp_path}/a").secret is None
    assert open_store(f"disk:{tmp_path}/a?secret=s1").secret == b"s1"
    monkeypatch.setenv(codec.SECRET_ENV, "s2")
    store = open_store(f"memory+disk:{tmp_path}/a")
    assert store.tiers[1].secret == b"s2" and "s2" not in repr(store)
    assert open_store(f"disk:{tmp_path}/a?secret=s1").secret == b"s1"  # the spec wins


def test_key_checked_view_refuses_an_entry_whose_tokens_hash_to_another_key(caplog):
    from epic_rag.keys import chunk_key
    from epic_rag.store import KeyCheckedStore

    inner = MemoryStore()
    view = KeyCheckedStore(inner, lambda e: chunk_key("fp", e.token_ids))
    genuine = make_kv(seed=6)
    genuine = ChunkKV(chunk_key("fp", genuine.token_ids), genuine.token_ids, genuine.k, genuine.v)
    view.put(genuine)
    assert_same(view.get(genuine.key), genuine)
    misfiled = make_kv(genuine.key, seed=7)  # other tokens and KV under the genuine key
    inner.put(misfiled)
    with caplog.at_level(logging.ERROR, logger="epic_rag.store"):
        assert view.get(genuine.key) is None
    assert view.stats.corrupt == 1 and "do not hash to its key" in caplog.text
    assert inner.contains(genuine.key)  # refused, not deleted: a recompile overwrites it


# ------------------------------------------------------------------ int8
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("spec", ["memory?quant=int8", "disk:{tmp}/q?quant=int8"])
def test_int8_round_trip_error_within_half_a_step(spec, dtype, tmp_path):
    s = open_store(spec.format(tmp=tmp_path))
    kv = make_kv(dtype=dtype, tokens=64)
    kv.k[1, 5] = 0  # an all-zero token must survive (scale 0)
    s.put(kv)
    got = s.get(kv.key)
    assert got.k.dtype == dtype and got.quant == "int8" and got.token_ids == kv.token_ids
    for ref, out in ((kv.k, got.k), (kv.v, got.v)):
        ref32, out32 = ref.float(), out.float()
        step = ref32.abs().amax(dim=-1, keepdim=True) / 127  # per token, per head
        cast = out32.abs() * {torch.float32: 0, torch.bfloat16: 2**-8, torch.float16: 2**-11}[dtype]
        assert ((out32 - ref32).abs() <= step / 2 * (1 + 1e-5) + cast + 1e-12).all()
        rel = (out32 - ref32).norm() / ref32.norm()
        assert rel < 0.01
    assert torch.equal(got.k[1, 5], torch.zeros_like(got.k[1, 5]))


def test_int8_entries_are_about_four_times_smaller_than_fp32(tmp_path):
    kv = make_kv(tokens=128, shape=(4, 2, 64))
    exact, packed = len(codec.encode(kv)), len(codec.encode(kv, "int8"))
    assert 3.5 < exact / packed < 4.0


def test_int8_and_exact_entries_never_collide(tmp_path):
    exact, q8 = DiskStore(tmp_path), DiskStore(tmp_path, quant="int8")
    kv = make_kv()
    exact.put(kv)
    assert q8.get(kv.key) is None and q8.stats.corrupt == 0  # a miss, not someone else's entry
    q8.put(kv)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{kv.key}.safetensors", f"{kv.key}@int8.safetensors"]
    assert_same(exact.get(kv.key), kv)
    assert q8.get(kv.key).quant == "int8"
    assert exact.keys() == q8.keys() == [kv.key]
    # A file copied across namespaces is refused by the header check.
    shutil.copy(tmp_path / f"{kv.key}@int8.safetensors", tmp_path / f"{kv.key}.safetensors")
    assert exact.get(kv.key) is None and exact.stats.corrupt == 1


def test_int8_values_never_enter_an_exact_shared_tier(tmp_path):
    s = open_store(f"memory+disk:{tmp_path}/exact+disk:{tmp_path}/q8?quant=int8")
    mem, exact, q8 = s.tiers
    q8.put(make_kv())
    got = s.get("plain-aaaa")
    assert got.quant == "int8"
    assert mem.contains("plain-aaaa")  # promoted into this process's memory
    assert not exact.contains("plain-aaaa")  # but never into the exact shared folder


def test_int8_refuses_non_finite_kv_without_raising(tmp_path, caplog):
    kv = make_kv()
    kv.v[0, 0, 0, 0] = float("nan")
    s = DiskStore(tmp_path, quant="int8")
    with caplog.at_level(logging.ERROR, logger="epic_rag.store"):
        s.put(kv)
    assert s.keys() == [] and "inf/nan" in caplog.text


# ------------------------------------------------------------------ stacks
def test_hits_in_lower_tiers_are_promoted_to_upper_tiers(tmp_path):
    s = open_store(f"memory+disk:{tmp_path}/a+disk:{tmp_path}/b")
    mem, a, b = s.tiers
    kv = make_kv()
    b.put(kv)
    assert_same(s.get(kv.key), kv)
    assert mem.contains(kv.key) and a.contains(kv.key)
    st = s.tier_stats()
    assert (st["memory"]["misses"], st["disk"]["misses"], st["disk2"]["hits"]) == (1, 1, 1)
    s.get(kv.key)
    assert s.tier_stats()["memory"]["hits"] == 1 and s.tier_stats()["disk2"]["hits"] == 1


def test_writes_go_through_every_tier(tmp_path):
    s = open_store(f"memory+disk:{tmp_path}/a")
    kv = make_kv()
    s.put(kv)
    assert all(t.contains(kv.key) for t in s.tiers)
    assert s.keys() == [kv.key]
    assert s.delete(kv.key) and not any(t.contains(kv.key) for t in s.tiers)


def test_tier_stats_count_hits_misses_bytes_and_load_time(tmp_path):
    s = open_store(f"memory+disk:{tmp_path}")
    kv = make_kv()
    assert s.get(kv.key) is None
    s.put(kv)
    s.tiers[0].clear()
    s.get(kv.key)
    st = s.tier_stats()
    assert set(st) == {"memory", "disk"}
    assert st["disk"]["hits"] == 1 and st["disk"]["misses"] == 1 and st["disk"]["load_seconds"] > 0
    assert st["disk"]["bytes"] == entry_path(s.tiers[1], kv.key).stat().st_size and st["disk"]["entries"] == 1
    assert st["memory"]["bytes"] == kv.nbytes and st["memory"]["puts"] == 2  # the write, then the promotion
    assert {"evictions", "corrupt", "errors", "available", "load_seconds_max"} <= set(st["disk"])


def test_concurrent_threads_read_and_write_consistently(tmp_path):
    s = open_store(f"memory?max_bytes={make_kv().nbytes * 3}+disk:{tmp_path}")
    kvs = [make_kv(f"plain-{i}", seed=i) for i in range(8)]
    errors = []

    def work(offset):
        try:
            for j in range(40):
                kv = kvs[(offset + j) % len(kvs)]
                got = s.get(kv.key)
                if got is None:
                    s.put(kv)
                else:
                    assert_same(got, kv)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(st["corrupt"] == 0 and st["errors"] == 0 for st in s.tier_stats().values())


# ------------------------------------------------------------------ several processes
def _write_same_chunk(folder: str, rounds: int) -> None:
    s = DiskStore(folder)
    kv = make_kv("plain-shared", seed=7, tokens=256)
    for _ in range(rounds):
        s.put(kv)
        got = s.get(kv.key)
        assert got is not None and got.key == kv.key  # a reader never sees a half-written file


def test_two_processes_writing_the_same_chunk_leave_one_valid_entry(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_same_chunk, args=(str(tmp_path), 30)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [p.name for p in tmp_path.iterdir()] == ["plain-shared.safetensors"]  # no temp files left
    s = DiskStore(tmp_path)
    assert_same(s.get("plain-shared"), make_kv("plain-shared", seed=7, tokens=256))


# ------------------------------------------------------------------ faults
def _mount_tmpfs(path: Path, opts: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def mount_tmpfs_or_skip(path: Path, opts: str) -> Path:
    """Mount a small tmpfs at `path`, or skip saying what is missing: root, or a mount that root may do here
    (a container without CAP_SYS_ADMIN refuses it). `make test` prints the reason (-ra)."""
    if os.geteuid() != 0:
        pytest.skip(f"needs root to mount a small tmpfs (running as uid {os.geteuid()})")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"running as root, but mounting a tmpfs failed here: {(r.stderr or r.stdout).strip()[:200]}")
    return path


@pytest.fixture
def readonly_dir(tmp_path):
    """A folder this process cannot write: chmod for ordinary users; for root, a read-only tmpfs mount
    or the immutable attribute. Skips when none of these is possible here."""
    d = tmp_path / "ro"
    undo = None
    if os.geteuid() != 0:
        d.mkdir()
        d.chmod(0o555)
        undo = lambda: d.chmod(0o755)  # noqa: E731
    elif _mount_tmpfs(d, "ro,size=1m"):
        undo = lambda: subprocess.run(["umount", str(d)], check=False)  # noqa: E731
    elif shutil.which("chattr") and subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
        undo = lambda: subprocess.run(["chattr", "-i", str(d)], check=False)  # noqa: E731
    else:
        pytest.skip("running as root, but neither a read-only tmpfs mount nor chattr +i works here")
    try:
        yield d
    finally:
        undo()


def test_read_only_disk_folder_put_logs_an_error_and_does_not_raise(readonly_dir, caplog):
    s = open_store(f"memory+disk:{readonly_dir}")
    kv = make_kv()
    with caplog.at_level(logging.ERROR, logger="epic_rag.store"):
        s.put(kv)
        s.put(make_kv("plain-other"))
    assert "cannot write chunk plain-aaaa" in caplog.text
    assert caplog.text.count("cannot write chunk") == 1  # logged once, not per write
    assert s.tier_stats()["disk"]["errors"] == 2
    assert_same(s.get(kv.key), kv)  # the memory tier still serves
    assert not list(readonly_dir.iterdir())


def test_full_disk_put_logs_an_error_and_serving_continues(tmp_path, caplog):
    d = mount_tmpfs_or_skip(tmp_path / "full", "size=64k")
    try:
        s = DiskStore(d)
        small, big = make_kv("plain-small"), make_kv("plain-big", tokens=2048)
        s.put(small)
        with caplog.at_level(logging.ERROR, logger="epic_rag.store"):
            s.put(big)
        assert "No space left on device" in caplog.text and s.stats.errors == 1
        assert s.get(big.key) is None
        assert_same(s.get(small.key), small)
        assert [p.name for p in d.iterdir()] == ["plain-small.safetensors"]  # temp file removed
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_folder_that_cannot_be_created_is_logged_and_misses(readonly_dir, caplog):
    with caplog.at_level(logging.ERROR, logger="epic_rag.store"):
        s = DiskStore(readonly_dir / "sub")
    assert "cannot create the folder" in caplog.text
    assert s.get("plain-aaaa") is None
    s.put(make_kv())
    assert s.keys() == []


# ------------------------------------------------------------------ CLI
class _Out:
    def __init__(self):
        self.out = self.err = ""


_OUT = _Out()


def _cli(*argv) -> int:
    """`epic-rag ARGV` in a fresh interpreter (the real entry point; one parser per process)."""
    r = subprocess.run(
        [sys.executable, "-m", "epic_rag.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    _OUT.out, _OUT.err = r.stdout, r.stderr
    return r.returncode


def test_cli_stats_ls_verify_clear(tmp_path):
    spec = f"disk:{tmp_path}"
    s = DiskStore(tmp_path)
    for i in range(3):
        s.put(make_kv(f"plain-{i}", seed=i))
    assert _cli("store", "stats", "--store", spec) == 0
    assert "disk: 3 entries" in _OUT.out
    assert _cli("store", "stats", "--json", "--store", spec) == 0
    assert json.loads(_OUT.out)["disk"]["entries"] == 3
    assert _cli("store", "ls", "--store", spec) == 0
    lines = _OUT.out.splitlines()
    assert [ln.split("\t")[1] for ln in lines] == ["plain-0", "plain-1", "plain-2"]
    assert _cli("store", "verify", "--store", spec) == 0
    assert "3 checked, 3 ok, 0 corrupt" in _OUT.out
    _flip(entry_path(s, "plain-1"), -3)
    assert _cli("store", "verify", "--store", spec) == 1
    assert "3 checked, 2 ok, 1 corrupt" in _OUT.out
    assert _cli("store", "clear", "--store", spec) == 0
    assert "2 entries deleted" in _OUT.out
    assert list(tmp_path.iterdir()) == []


def test_cli_bad_spec_is_an_error_message_not_a_traceback():
    assert _cli("store", "stats", "--store", "floppy:/a") == 2
    assert "unknown tier" in _OUT.err


# ------------------------------------------------------------------ gpu tier and page-locked memory
def test_gpu_tier_holds_copies_on_its_device_under_its_budget_and_promotes_hits_from_below(tmp_path):
    # device=cpu runs the tier's logic here; on a GPU machine its device is cuda (the default)
    store = open_store(f"gpu?max_bytes={2 * make_kv().nbytes}&device=cpu+disk:{tmp_path}")
    gpu, disk = store.tiers
    kv = make_kv("plain-a")
    disk.put(kv)
    got = store.get("plain-a")  # a hit below is promoted into the gpu tier
    assert_same(got, kv)
    assert gpu.contains("plain-a") and gpu.get("plain-a").k.device == gpu.device
    for key in ("plain-b", "plain-c"):
        store.put(make_kv(key))
    assert gpu.keys() == ["plain-b", "plain-c"] and disk.contains("plain-a")  # LRU under its byte budget
    gpu.put(make_kv("plain-q", tokens=4 * T))  # larger than the whole budget: never copied over
    assert not gpu.contains("plain-q")
    lossy = make_kv("plain-i")
    lossy.quant = "int8"
    gpu.put(lossy)  # exact records only
    assert not gpu.contains("plain-i")


def test_a_gpu_tier_miss_returns_the_promoted_device_record_copied_from_the_page_locked_one(tmp_path):
    # N3: the link used to get the host record back and stage it again (the first link of new chunks moved
    # their bytes twice); the promotion also copies from the memory tier's own (page-locked) copy, promoted
    # first. device=meta stands for the GPU here: a device the host records are not on.
    from epic_rag.store.memory import DeviceStore

    gpu, mem, disk = DeviceStore(4 * make_kv().nbytes, device="meta"), MemoryStore(pin=False), DiskStore(tmp_path)
    store = TieredStore([gpu, mem, disk])
    kv = make_kv("plain-a")
    disk.put(kv)
    seen = []
    hold = gpu._hold
    gpu._hold = lambda r: seen.append(r) or hold(r)
    got = store.get("plain-a")
    assert got.k.device.type == "meta" and got is gpu.get("plain-a")  # what the gpu tier holds
    assert seen[0] is mem.get("plain-a")  # copied from the memory tier's copy
    assert store.get("plain-a") is got  # a hit in the top tier: that record, no copy


def test_a_gpu_tier_promotion_copies_on_a_side_stream_and_the_compute_stream_waits_on_the_device(tmp_path):
    # N3: the copy used to run on the compute stream, ahead of the link's kernels; now the compute stream waits
    # for it on the device (an event) and the caching allocator learns the record is used there
    from epic_rag.store.memory import DeviceStore
    from epic_rag.testing.fake_streams import FakeStreams

    api = FakeStreams()
    gpu = DeviceStore(4 * make_kv().nbytes, device="meta", streams=api)
    store = TieredStore([gpu, MemoryStore(pin=False)])
    store.tiers[1].put(make_kv("plain-a"))
    got = store.get("plain-a")
    (side,) = [s for s in api.streams if s is not api.compute]
    assert [k for k, _ in side.log] == ["copy", "copy", "record"]
    assert [k for k, _ in api.compute.log] == ["wait"] and api.compute.log[0][1][0] is side.log[2][1][0]
    assert [(t, s) for t, s in api.kept] == [(got.k, api.compute), (got.v, api.compute)]
    assert api.host_waits == []


def test_page_locked_records_count_the_blocks_torchs_host_allocator_reserves(monkeypatch):
    # N4: torch's pinned allocator rounds every block up to a power of two (and keeps it): a record of
    # 33 KiB per K or V holds 64 KiB each, so a budget counted in nbytes pinned about twice itself
    from epic_rag.store import memory

    monkeypatch.setattr(memory, "_pinned_copy", lambda t: t.clone())  # no CUDA here: the copy, unpinned
    kv = make_kv(tokens=33 * 1024 // (L * H * D * 4) or 1)
    per_tensor = kv.nbytes // 2
    rounded = 1 << (per_tensor - 1).bit_length()
    m = MemoryStore(max_bytes=4 * rounded, pin=True)
    for i in range(3):
        m.put(make_kv(f"plain-{i}", tokens=kv.num_tokens, seed=i))
    assert m.stats.bytes == 2 * 2 * rounded and m.keys() == ["plain-1", "plain-2"]
    assert memory.host_block_bytes(per_tensor) == rounded and memory.host_block_bytes(1 << 20) == 1 << 20
    unpinned = MemoryStore(max_bytes=4 * rounded, pin=False)
    unpinned.put(kv)
    assert unpinned.stats.bytes == kv.nbytes  # pageable memory: what it holds


def test_a_gpu_tier_on_a_machine_without_cuda_is_refused_by_name():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        open_store("gpu?max_bytes=1G")


def test_gpu_and_memory_tiers_stay_with_the_linking_process(tmp_path):
    from epic_rag.store import open_shared_tiers
    from epic_rag.store.spec import gpu_tier_bytes

    shared = open_shared_tiers(f"gpu?max_bytes=1M&device=cpu+memory+disk:{tmp_path}")
    assert type(shared).__name__ == "DiskStore"
    assert gpu_tier_bytes("gpu?max_bytes=3G+memory") == 3 * 2**30 and gpu_tier_bytes("memory") == 0


def test_memory_tier_pins_its_records_only_where_a_cuda_device_exists():
    m = MemoryStore()
    assert m.pin == torch.cuda.is_available()
    kv = make_kv("plain-p")
    m.put(kv)
    if not m.pin:  # an unpinned tier keeps the very object, no copy
        assert m.get("plain-p") is kv


# ------------------------------------------------------------------ tenant quotas (review 3 B)
VICTIM, FLOOD = "aa" * 32, "bb" * 32  # tenant ids (keys.tenant_id: hex)


def tenant_kv(tenant: str, i: int) -> ChunkKV:
    kv = make_kv(f"plain-{tenant[:2]}{i}", seed=i)
    kv.tenant = tenant
    return kv


def entry_size(tier: str) -> int:
    """What one tenant_kv entry takes from a budget: its file on disk, its tensors in memory."""
    kv = tenant_kv(FLOOD, 0)
    return len(codec.encode(kv)) if tier == "disk" else kv.nbytes


def hit_rate(store, keys) -> float:
    return sum(store.get(k) is not None for k in keys) / len(keys)


def quota_evictions(tier: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("epic_rag_store_quota_evictions_total", {"tier": tier}) or 0.0


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_one_tenant_filling_its_quota_leaves_another_tenants_hit_rate_unchanged(tier, tmp_path):
    # Review 3 B: the LRU was global, so one tenant's compiles evicted every other tenant's chunks.
    one = entry_size(tier)
    where = "memory" if tier == "memory" else f"disk:{tmp_path}"
    pin = "&pin=0" if tier == "memory" else ""
    s = open_store(f"{where}?max_bytes={one * 10}&tenant_max_bytes={one * 4}{pin}")
    victim = [tenant_kv(VICTIM, i) for i in range(3)]
    for kv in victim:
        s.put(kv)
    before = hit_rate(s, [kv.key for kv in victim])
    counted = quota_evictions(tier)
    for i in range(40):  # ten times its quota
        s.put(tenant_kv(FLOOD, i))
        if tier == "disk":
            time.sleep(0.002)  # (mtime order)
    assert before == hit_rate(s, [kv.key for kv in victim]) == 1.0
    for kv in victim:
        assert_same(s.get(kv.key), kv)
    usage = s.tenant_usage()
    assert usage[FLOOD][0] <= one * 4 and usage[FLOOD][1] == 4 and usage[VICTIM][1] == 3
    assert hit_rate(s, [f"plain-bb{i}" for i in range(36, 40)]) == 1.0  # the flood keeps its most recent
    assert s.stats.quota_evictions == 36 and quota_evictions(tier) - counted == 36


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_over_the_tier_budget_the_tenant_holding_the_most_evicts_its_own_oldest_first(tier, tmp_path):
    # No quota set: a tenant filling the tier evicts itself once it is the largest, never a smaller tenant.
    one = entry_size(tier)
    s = MemoryStore(max_bytes=one * 10, pin=False) if tier == "memory" else DiskStore(tmp_path, max_bytes=one * 10)
    victim = [tenant_kv(VICTIM, i) for i in range(3)]
    for kv in victim:
        s.put(kv)
        if tier == "disk":
            time.sleep(0.002)
    for i in range(30):
        s.put(tenant_kv(FLOOD, i))
        if tier == "disk":
            time.sleep(0.002)
    assert hit_rate(s, [kv.key for kv in victim]) == 1.0
    assert s.get("plain-bb29") is not None and s.get("plain-bb0") is None
    assert s.stats.quota_evictions == 0 and s.stats.evictions > 0


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_quota_by_entries_evicts_the_tenants_least_recently_used_entry(tier, tmp_path):
    s = (
        MemoryStore(pin=False, quota=TenantQuota(max_entries=2))
        if tier == "memory"
        else DiskStore(tmp_path, quota=TenantQuota(max_entries=2))
    )
    a0, a1, a2 = (tenant_kv(FLOOD, i) for i in range(3))
    s.put(a0)
    time.sleep(0.01)
    s.put(a1)
    time.sleep(0.01)
    assert s.get(a0.key) is not None  # a0 is now the more recent
    time.sleep(0.01)
    s.put(a2)
    assert sorted(k for k in s.keys()) == sorted([a0.key, a2.key])
    assert s.stats.quota_evictions == 1


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_an_entry_larger_than_its_tenants_whole_quota_is_not_stored_and_is_counted(tier, tmp_path):
    one = entry_size(tier)
    q = TenantQuota(max_bytes=one - 1)
    s = MemoryStore(pin=False, quota=q) if tier == "memory" else DiskStore(tmp_path, quota=q)
    s.put(tenant_kv(VICTIM, 0))
    assert s.keys() == [] and s.stats.quota_refusals == 1 and s.stats.puts == 0


@pytest.mark.parametrize(
    "spec, match",
    [
        ("memory?tenant_max_bytes=0", "at least one byte"),
        ("memory?tenant_max_bytes=lots", "byte count"),
        ("disk:/tmp/x?tenant_max_entries=0", "tenant_max_entries must be a whole number"),
        ("disk:/tmp/x?tenant_max_entries=1.5", "tenant_max_entries must be a whole number"),
        ("gpu?max_bytes=1M&tenant_max_bytes=1M", "unknown gpu option 'tenant_max_bytes'"),
    ],
)
def test_bad_tenant_quota_options_are_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        open_store(spec)
