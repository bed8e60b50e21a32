"""Faults while serving, on the real engine (tiny model): Redis stopped and restarted under load, a
disk store that fills up, turns read-only, or has its files damaged while requests run, an engine process
SIGKILLed in the middle of writing a compiled chunk, and clients that disconnect mid-stream.

Every answer given during a fault must be the answer given without it (same token ids at temperature 0):
a tier that fails is skipped and the chunk is compiled again, never served from a bad entry. Store-level
versions of these faults (one tier, no engine) are in tests/test_store.py and tests/test_store_redis.py.

The engine under test is the session's `tiny_engine`; a test points it at another store by swapping
`engine.store` (the only place the engine reads chunks from) and restores it afterwards.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import _engine_process
import httpx
import psutil
import pytest
import torch
from test_demo_unit import HashEncoder
from test_reliability_inputs import engine_idle
from test_store import mount_tmpfs_or_skip, readonly_dir  # noqa: F401  (fixture)

from epic_rag import RagRequest
from epic_rag.engine.connector.epic import pending
from epic_rag.engine.stores import RETRY_S
from epic_rag.store import DiskStore, MemoryStore, open_store
from epic_rag.testing.localredis import LocalRedis
from epic_rag_demo.background import BackgroundServer
from epic_rag_demo.config import DEFAULT_POLICY, DemoConfig
from epic_rag_demo.server import create_app

ROOT = Path(__file__).resolve().parents[1]

# A pool of chunks no other test compiles; request i links a rotating pair of them.
POOL = [
    f"Fault fixture {i}: the {w} station logs {i * 37 % 101} readings per hour and reports to {c}."
    for i, (w, c) in enumerate(
        [
            ("Aster", "Brill"),
            ("Corvel", "Dunmere"),
            ("Elsby", "Farrow"),
            ("Gantry", "Holm"),
            ("Isel", "Jarrow"),
            ("Kestle", "Lorn"),
            ("Marrow", "Nesh"),
            ("Orrin", "Pell"),
        ]
    )
]
QUESTIONS = ["How many readings does the station log?", "Where does it report?", "Which station is it?"]


def request(i: int) -> RagRequest:
    return RagRequest(
        question=QUESTIONS[i % len(QUESTIONS)], chunks=[POOL[i % len(POOL)], POOL[(i * 3 + 1) % len(POOL)]]
    )


N_DISTINCT = len(POOL) * len(QUESTIONS)


@pytest.fixture
def with_store(tiny_engine):
    """Point the engine at another store for one test (restored afterwards)."""
    old = tiny_engine.store

    def swap(store):
        tiny_engine.store = store
        return store

    yield swap
    tiny_engine.store = old


@pytest.fixture(scope="module")
def references(tiny_engine):
    """Token ids of every distinct request, from a fresh memory store (no fault anywhere)."""
    old = tiny_engine.store
    tiny_engine.store = MemoryStore()
    try:
        return {
            i: tiny_engine.generate(request(i), max_tokens=6, policy="legolink-4").token_ids for i in range(N_DISTINCT)
        }
    finally:
        tiny_engine.store = old


class Load:
    """`workers` threads sending requests back to back; every answer is checked against the references."""

    def __init__(self, engine, references, workers: int = 3) -> None:
        self.engine, self.refs = engine, references
        self.stop = threading.Event()
        self.results: list[tuple[float, int, int, int]] = []  # (time, request, hits, misses)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._work, args=(w,), daemon=True) for w in range(workers)]
        self.t0 = time.monotonic()

    def _work(self, w: int) -> None:
        i = w
        while not self.stop.is_set():
            k = i % N_DISTINCT
            try:
                g = self.engine.generate(request(k), max_tokens=6, policy="legolink-4")
                if g.token_ids != self.refs[k]:
                    self.errors.append(f"request {k}: {g.token_ids} != {self.refs[k]}")
                self.results.append((time.monotonic() - self.t0, k, g.chunk_hits, g.chunk_misses))
            except Exception as e:  # reported by the test
                self.errors.append(f"request {k}: {type(e).__name__}: {e}")
            i += 7

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def answered_between(self, a: float, b: float) -> list[tuple[float, int, int, int]]:
        return [r for r in self.results if a <= r[0] < b]


def assert_clean(engine) -> None:
    assert engine_idle(engine) and pending() == 0 and engine.runtime.fatal is None


# ---------------------------------------------------------------------- Redis
@pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="needs the redis-server binary (apt-get install redis-server)"
)
def test_redis_stopped_and_restarted_under_load_every_request_is_answered_correctly(
    tiny_engine, references, with_store, tmp_path
):
    r = LocalRedis(tmp_path / "redis").start()
    try:
        store = with_store(open_store(f"{r.url}?timeout=0.5&retry_s=0.3&prefix=fault:"))
        with Load(tiny_engine, references) as load:
            time.sleep(2.0)
            t_stop = time.monotonic() - load.t0
            r.stop()  # killed, no shutdown handshake
            time.sleep(0.5)
            down = store.tier_stats()["redis"]
            time.sleep(2.0)
            down_after = store.tier_stats()["redis"]
            t_start = time.monotonic() - load.t0
            r.start()  # back, empty (no persistence)
            time.sleep(3.0)
        assert load.errors == [], load.errors[:5]
        during = load.answered_between(t_stop + 0.5, t_start)
        after = load.answered_between(t_start + 1.5, 1e9)
        assert len(during) >= 3, "no request was answered while Redis was down"
        assert down["available"] == 0 == down_after["available"]
        assert down_after["hits"] == down["hits"] and down_after["puts"] == down["puts"]  # Redis skipped
        # chunks still linked meanwhile, from this process's recent compiles (Redis could not serve them)
        assert any(hits > 0 for _, _, hits, _ in during)
        assert any(hits > 0 for _, _, hits, _ in after), "Redis was not used again after its restart"
        st = store.tier_stats()["redis"]
        assert st["available"] == 1 and st["errors"] >= 1 and st["corrupt"] == 0
        assert len(store.keys()) > 0  # writes resumed into the restarted server
    finally:
        r.stop()
    assert_clean(tiny_engine)


# ---------------------------------------------------------------------- disk: full, read-only, damaged
def _needs_mount(tmp_path: Path, opts: str) -> Path:
    return mount_tmpfs_or_skip(tmp_path / "mnt", opts)


def test_disk_store_that_fills_up_while_serving(tiny_engine, references, with_store, tmp_path, caplog):
    d = _needs_mount(tmp_path, "size=160k")
    try:
        store = with_store(DiskStore(d))
        with caplog.at_level("ERROR", logger="epic_rag.store"):
            with Load(tiny_engine, references) as load:
                time.sleep(3.0)
        assert load.errors == [], load.errors[:5]
        assert len(load.results) >= N_DISTINCT
        assert store.stats.errors >= 1 and "No space left on device" in caplog.text
        names = sorted(p.name for p in d.iterdir())
        assert names and not [n for n in names if n.startswith(".tmp-")], names  # no temp file left behind
        assert all(store.verify(n.removesuffix(".safetensors")) for n in names)  # what was written is whole
        assert store.stats.corrupt == 0
    finally:
        subprocess.run(["umount", str(d)], check=False)
    assert_clean(tiny_engine)


def test_disk_store_turning_read_only_while_serving(tiny_engine, references, with_store, tmp_path, caplog):
    d = _needs_mount(tmp_path, "size=8m")
    try:
        store = with_store(DiskStore(d))
        tiny_engine.compile(POOL[:4])  # half the chunks written while writable
        written = set(store.keys())
        assert len(written) == 4
        assert subprocess.run(["mount", "-o", "remount,ro", str(d)]).returncode == 0
        with caplog.at_level("ERROR", logger="epic_rag.store"):
            with Load(tiny_engine, references) as load:
                time.sleep(2.5)
        assert load.errors == [], load.errors[:5]
        assert set(store.keys()) == written  # nothing new, nothing lost
        assert store.stats.errors >= 1 and "Read-only file system" in caplog.text
        assert any(hits > 0 for _, _, hits, _ in load.results)  # old entries still read
        assert subprocess.run(["mount", "-o", "remount,rw", str(d)]).returncode == 0
        time.sleep(RETRY_S)  # records the disk refused are offered to it again after this long
        for i in range(N_DISTINCT):
            tiny_engine.generate(request(i), max_tokens=6, policy="legolink-4")
        assert set(store.keys()) > written  # writes resume once the disk is writable again
    finally:
        subprocess.run(["umount", str(d)], check=False)
    assert_clean(tiny_engine)


def test_read_only_disk_store_from_the_start(tiny_engine, references, with_store, readonly_dir):  # noqa: F811
    store = with_store(DiskStore(readonly_dir))
    for i in range(N_DISTINCT):
        assert tiny_engine.generate(request(i), max_tokens=6, policy="legolink-4").token_ids == references[i]
    assert store.stats.errors >= 1 and not list(readonly_dir.iterdir())
    assert_clean(tiny_engine)


def test_disk_files_truncated_corrupted_and_deleted_while_serving(tiny_engine, references, with_store, tmp_path):
    d = tmp_path / "kv"
    store = with_store(DiskStore(d))
    rng = random.Random(7)
    damage = {"flip": 0, "truncate": 0, "garbage": 0, "delete": 0}
    stop = threading.Event()

    def vandal():
        while not stop.is_set():
            files = [p for p in d.glob("*.safetensors")]
            if files:
                p, how = rng.choice(files), rng.choice(list(damage))
                try:
                    if how == "flip":
                        with open(p, "r+b") as f:
                            size = os.fstat(f.fileno()).st_size
                            if not size:
                                continue
                            f.seek(rng.randrange(size))
                            b = f.read(1)
                            f.seek(-1, 1)
                            f.write(bytes([b[0] ^ (1 << rng.randrange(8))]))
                    elif how == "truncate":
                        os.truncate(p, rng.randrange(max(1, p.stat().st_size)))
                    elif how == "garbage":
                        p.write_bytes(os.urandom(rng.randrange(1, 4096)))
                    else:
                        p.unlink()
                    damage[how] += 1
                except FileNotFoundError:
                    pass
            time.sleep(0.02)

    t = threading.Thread(target=vandal, daemon=True)
    with Load(tiny_engine, references) as load:
        time.sleep(1.0)
        t.start()
        time.sleep(4.0)
        stop.set()
        t.join(10)
    assert load.errors == [], load.errors[:5]
    assert sum(damage.values()) >= 20 and all(damage.values()), damage
    assert store.stats.corrupt >= 1  # bad entries were found and dropped
    assert any(hits > 0 for _, _, hits, _ in load.results)
    for i in range(N_DISTINCT):  # and everything still answers the same
        assert tiny_engine.generate(request(i), max_tokens=6, policy="legolink-4").token_ids == references[i]
    assert all(store.verify(k) for k in store.keys())
    assert_clean(tiny_engine)


# ---------------------------------------------------------------------- SIGKILL while writing a compiled chunk
KILL_SCRIPT = r"""
import json, os, sys, time, types
cfg = json.loads(sys.argv[1])
from epic_rag import EngineConfig, EpicEngine
from epic_rag.paths import cache_dir
from epic_rag.store import disk as disk_mod
from epic_rag.testing.tiny_model import build_tiny_model

model = build_tiny_model(cache_dir() / "test-models" / "tiny-llama-v1")
eng = EpicEngine(EngineConfig(model=str(model), policy="legolink-16", store="disk:" + cfg["dir"], max_model_len=2048,
                              max_num_seqs=4, kv_cache_gib=1, dtype="float32"))
writes = {"n": 0}

def fdopen(fd, mode="r", *a, **k):          # the disk tier's file writes; the Nth stops half-way
    f = os.fdopen(fd, mode, *a, **k)
    if "w" not in mode:
        return f
    writes["n"] += 1
    if writes["n"] != cfg["hang_at"]:
        return f

    class HalfWrite:
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return False
        def write(self, data):
            f.write(data[: len(data) // 2])
            f.flush()
            print("MIDWRITE", writes["n"], flush=True)
            time.sleep(3600)                # killed here by the test
    return HalfWrite()

proxy = types.ModuleType("os")              # only the disk tier sees the patched fdopen
proxy.__dict__.update(os.__dict__)
proxy.fdopen = fdopen
disk_mod.os = proxy
print("READY", flush=True)
chunks = cfg["chunks"]
for i in range(0, len(chunks), 4):
    eng.compile(chunks[i:i + 4])
    print("BATCH", i, flush=True)
print("DONE", flush=True)
"""

KILL_CHUNKS = [
    f"Kill fixture {i}: the {n} archive holds {i * 53 % 997} boxes of letters from {y}."
    for i, (n, y) in enumerate(
        zip(
            ["Amber", "Basalt", "Cedar", "Dune", "Ember", "Flint", "Garnet", "Heath", "Iris", "Jasper", "Kelp", "Loam"],
            range(1871, 1883),
        )
    )
]


@pytest.mark.slow  # starts an engine process and kills it
def test_engine_killed_mid_write_leaves_no_entry_that_reads_as_valid(tiny_engine, with_store, tmp_path):
    d = tmp_path / "kv"
    d.mkdir()
    hang_at = 6  # batch 1 writes 4 entries, batch 2 is killed on its 2nd
    log = open(tmp_path / "engine.log", "w+")
    proc = subprocess.Popen(
        _engine_process.command(KILL_SCRIPT, {"dir": str(d), "hang_at": hang_at, "chunks": KILL_CHUNKS}),
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        cwd=_engine_process.ROOT,
        env=_engine_process.environment(),
    )
    lines: list[str] = []
    killed = threading.Event()

    def watchdog():
        if not killed.wait(600):
            proc.kill()

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for line in proc.stdout:
            lines.append(line.strip())
            if line.startswith("MIDWRITE"):
                os.kill(proc.pid, signal.SIGKILL)  # the engine process dies in the middle of a compile
                break
    finally:
        killed.set()
        proc.kill()
        proc.wait(30)
        log.seek(0)
        err = log.read()
        log.close()
    assert proc.returncode == -signal.SIGKILL and f"MIDWRITE {hang_at}" in lines, (lines, err[-3000:])
    entries = sorted(p.name for p in d.iterdir() if not p.name.startswith("."))
    temps = [p for p in d.iterdir() if p.name.startswith(".tmp-")]
    assert len(entries) == hang_at - 1 and len(temps) == 1 and temps[0].stat().st_size > 0

    # `epic-rag store verify` reads every entry: all whole, nothing corrupt; the half-written temp is no entry.
    r = subprocess.run(
        [sys.executable, "-m", "epic_rag.cli", "store", "verify", "--store", f"disk:{d}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0 and f"{hang_at - 1} checked, {hang_at - 1} ok, 0 corrupt" in r.stdout, r.stdout + r.stderr

    # A new engine on the same folder compiles exactly what is missing, and the surviving entries are bit-exact.
    exact = {}
    with_store(MemoryStore())
    for ref in tiny_engine.compile(KILL_CHUNKS):
        exact[ref.key] = tiny_engine.store.get(ref.key)
    disk = with_store(DiskStore(d))
    survivors = set(disk.keys())
    assert len(survivors) == hang_at - 1 and survivors <= set(exact)
    refs = tiny_engine.compile(KILL_CHUNKS)
    assert disk.stats.puts == len(KILL_CHUNKS) - len(survivors)
    assert set(disk.keys()) == {r.key for r in refs}
    for key in survivors:
        kv = disk.get(key)
        assert (
            torch.equal(kv.k, exact[key].k) and torch.equal(kv.v, exact[key].v) and kv.token_ids == exact[key].token_ids
        )
    assert disk.stats.corrupt == 0
    assert_clean(tiny_engine)


# ---------------------------------------------------------------------- clients that go away mid-stream
@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    root = tmp_path_factory.mktemp("faults-http")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "stations.txt").write_text("\n\n".join(POOL))
    # no refine pass: its compiles would keep the engine busy after a client left (what these tests check)
    cfg = DemoConfig(
        corpus=str(corpus),
        data_dir=root / "data",
        store="memory",
        api_key="k",
        top_k=2,
        max_tokens_limit=1500,
        refine_neighbours=0,
    )
    app = create_app(engine=tiny_engine, config=cfg, encoder=HashEncoder())
    srv = BackgroundServer(app).start()
    assert app.state.demo.library.wait_ready(60)
    srv.app = app
    yield srv
    srv.stop()


def _disconnect_mid_stream(url: str) -> int:
    got = 0
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer k"}, timeout=60) as c:
        with c.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "Describe every station at length."}],
                "stream": True,
                "max_tokens": 1500,
                "policy": "legolink-4",
            },
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
                    got += 1
                    if got == 3:
                        break
    return got


def _settled(server, tiny_engine) -> None:
    assert engine_idle(tiny_engine, 10), "the engine kept generating for a client that left"
    assert pending() == 0
    end = time.monotonic() + 5
    while server.app.state.demo.active_chats and time.monotonic() < end:
        time.sleep(0.02)
    assert server.app.state.demo.active_chats == 0


def test_repeated_disconnects_free_their_requests_and_memory(server, tiny_engine):
    proc = psutil.Process()
    # legolink-4 is not one of the page's policies: its label is its kind (a fixed set of labels)
    cancelled = server.app.state.demo.metrics.chat.labels("legolink", "true", "cancelled")
    before = cancelled._value.get()
    for _ in range(8):  # warm-up: allocator pools, caches, first compiles
        assert _disconnect_mid_stream(server.url) == 3
        _settled(server, tiny_engine)
    rss0 = proc.memory_info().rss
    n = 30
    for _ in range(n):
        assert _disconnect_mid_stream(server.url) == 3
        _settled(server, tiny_engine)
    growth = proc.memory_info().rss - rss0
    assert cancelled._value.get() - before == 8 + n
    assert growth < 24 << 20, f"RSS grew {growth / 2**20:.1f} MiB over {n} disconnects"
    print(f"\nRSS growth over {n} mid-stream disconnects: {growth / 2**20:.2f} MiB")


def _counting_aborts(monkeypatch, tiny_engine) -> list[str]:
    """Ids of the generation requests torn down in flight (RequestRun.cancel: a request that had already
    finished is not cancelled, so this shows the client's leaving stopped work, not that it happened to be
    over; compiles do not go through it)."""
    from epic_rag.engine.request import RequestRun

    aborted: list[str] = []
    real = RequestRun.cancel

    def cancel(self) -> None:
        aborted.append(self.req_id)
        real(self)

    monkeypatch.setattr(RequestRun, "cancel", cancel)
    return aborted


def test_non_stream_clients_that_give_up_are_cancelled(server, tiny_engine, monkeypatch):
    cancelled = server.app.state.demo.metrics.chat.labels("legolink", "false", "cancelled")
    before = cancelled._value.get()
    aborted = _counting_aborts(monkeypatch, tiny_engine)
    for _ in range(3):
        with httpx.Client(
            base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=httpx.Timeout(30, read=0.5)
        ) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.post(
                    "/v1/chat/completions",
                    json={
                        "messages": [{"role": "user", "content": "Describe every station at length."}],
                        "max_tokens": 1500,
                        "policy": "legolink-4",
                    },
                )
        _settled(server, tiny_engine)
    assert cancelled._value.get() - before == 3  # the route saw each client leave (else: "ok" after the fact)
    assert len(set(aborted)) == 3


async def test_many_concurrent_disconnects(server, tiny_engine, monkeypatch):
    cancelled = server.app.state.demo.metrics.chat.labels(DEFAULT_POLICY, "true", "cancelled")  # none named
    before = cancelled._value.get()
    aborted = _counting_aborts(monkeypatch, tiny_engine)

    async def one(i: int):
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": "Bearer k"}, timeout=60) as c:
            async with c.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": f"Station report {i}, at length."}],
                    "stream": True,
                    "max_tokens": 1500,
                },
            ) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"role"' not in line:
                        return True
        return False

    got = await asyncio.gather(*(one(i) for i in range(12)))
    assert all(got)
    await asyncio.to_thread(_settled, server, tiny_engine)
    assert cancelled._value.get() - before == 12
    assert len(set(aborted)) == 12  # each was still generating when its client left
