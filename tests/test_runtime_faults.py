"""The engine runtime's stepping thread under faults, with a scripted stand-in for vLLM's LLMEngine (no
model): a dead thread is reported, no request is left waiting for it, and a bad sink cannot kill it."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from types import SimpleNamespace

import pytest

from epic_rag.engine.runtime import EMPTY, Runtime, next_item
from epic_rag.types import Delta


class ScriptedLLM:
    """Each request yields 3 one-token outputs. `gate` (when set) holds step() until released; `fail`
    makes step() raise."""

    def __init__(self, steps: int = 3) -> None:
        self.reqs: dict[str, int] = {}
        self.steps = steps
        self.aborted: list[str] = []
        self.gate: threading.Event | None = None
        self.in_step = threading.Event()
        self.fail: BaseException | None = None

    def add_request(self, rid, prompt, params):
        self.reqs[rid] = 0

    def has_unfinished_requests(self):
        return bool(self.reqs)

    def abort_request(self, ids):
        for i in ids:
            self.aborted.append(i)
            self.reqs.pop(i, None)

    def step(self):
        self.in_step.set()
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        outs = []
        for rid in list(self.reqs):
            self.reqs[rid] += 1
            done = self.reqs[rid] >= self.steps
            if done:
                del self.reqs[rid]
            c = SimpleNamespace(text="x", token_ids=[1], finish_reason="length" if done else None)
            outs.append(SimpleNamespace(request_id=rid, outputs=[c], finished=done))
        return outs


@pytest.fixture()
def rt():
    llm = ScriptedLLM()
    r = Runtime(llm)
    r.start()
    yield r, llm
    r.shutdown()


def _last(box: queue.SimpleQueue, timeout: float = 5.0):
    while True:
        item = box.get(timeout=timeout)  # queue.Empty (a failed test) instead of waiting for ever
        if isinstance(item, BaseException) or item.finished:
            return item


def test_a_failed_step_fails_running_and_queued_requests_and_reports_unhealthy(rt):
    r, llm = rt
    assert r.health() is None
    llm.gate = threading.Event()
    running, queued = queue.SimpleQueue(), queue.SimpleQueue()
    r.submit("a", None, None, running.put)
    assert llm.in_step.wait(5)  # the thread is inside step(): the next request stays in the inbox
    r.submit("b", None, None, queued.put)
    llm.fail = RuntimeError("CUDA error: device lost")
    llm.gate.set()
    assert isinstance(_last(running), RuntimeError)
    assert isinstance(_last(queued), RuntimeError), "a request in the inbox was left waiting for a dead engine"
    r._thread.join(5)
    assert "fatal error" in r.health()
    with pytest.raises(RuntimeError, match="fatal"):
        r.submit("c", None, None, queued.put)


def test_a_sink_that_raises_cannot_kill_the_stepping_thread(rt):
    r, llm = rt

    def closed_loop_sink(d):
        raise RuntimeError("Event loop is closed")

    good = queue.SimpleQueue()
    r.submit("bad", None, None, closed_loop_sink)
    r.submit("good", None, None, good.put)
    d = _last(good)
    assert isinstance(d, Delta) and d.finished
    assert r.health() is None and r._thread.is_alive()
    assert "bad" in llm.aborted  # nobody could take its output: it stopped generating
    assert r.idle()


def test_a_request_submitted_after_shutdown_fails_instead_of_hanging(rt):
    r, _ = rt
    r.shutdown()
    assert r.health() is not None
    with pytest.raises(RuntimeError, match="shut down"):
        r.submit("late", None, None, lambda d: None)


def test_a_wait_on_a_hung_step_times_out_and_a_wait_on_a_dead_engine_raises(rt):
    r, llm = rt
    llm.gate = threading.Event()  # step() hangs (until released at the end)
    ev = threading.Event()
    r.submit("a", None, None, lambda d: ev.set() if isinstance(d, BaseException) or d.finished else None)
    assert llm.in_step.wait(5)
    with pytest.raises(TimeoutError, match="no output"):
        r.wait_for(ev, stall_s=1.5)
    llm.fail = RuntimeError("device lost")
    llm.gate.set()
    with pytest.raises(RuntimeError, match="fatal|not running|device lost"):
        r.poll(lambda t: queue.SimpleQueue().get(timeout=t), stall_s=30)


def test_a_compile_batch_failing_part_way_aborts_its_requests_and_leaves_nothing_in_flight(rt, monkeypatch):
    import torch

    from epic_rag.engine.chunks import ChunkResolver
    from epic_rag.engine.stores import ChunkStores
    from epic_rag.store import MemoryStore

    r, llm = rt
    llm.gate = threading.Event()  # both compile requests stay in flight
    kv_info = {"num_layers": 1, "num_kv_heads": 1, "head_size": 2, "kv_dtype": str(torch.float32)}
    tok = SimpleNamespace(bos_token_id=1, eos_token_id=2)
    res = ChunkResolver(ChunkStores(MemoryStore(), MemoryStore()), r, tok, "fp", kv_info, 64, [1, 5, 6])
    calls = []

    def submit_tokens(prompt, sink, **kw):  # the second submit fails (e.g. the engine refuses it)
        calls.append(prompt)
        if len(calls) == 2:
            raise RuntimeError("refused")
        rid = f"r{len(calls)}"
        r.submit(rid, None, None, sink)
        return rid

    monkeypatch.setattr(r, "submit_tokens", submit_tokens)
    with pytest.raises(RuntimeError, match="refused"):
        res.resolve([([7, 8], res.variant), ([9, 10], res.variant)])
    assert not res._inflight  # nobody waits on the failed compiles
    llm.gate.set()  # the step in progress returns; the abort queued meanwhile is applied next
    deadline = time.monotonic() + 5
    while "r1" not in llm.aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "r1" in llm.aborted


def test_shutdown_ends_the_step_under_way_fails_the_waiting_requests_and_only_then_frees_the_engine(rt):
    from epic_rag.engine.engine import EpicEngine

    r, llm = rt
    llm.gate = threading.Event()
    box = queue.SimpleQueue()
    r.submit("a", None, None, box.put)
    assert llm.in_step.wait(5)
    freed = []
    eng = object.__new__(EpicEngine)  # only what shutdown reads
    eng.runtime, eng._llm, eng._local = (
        r,
        SimpleNamespace(engine_core=SimpleNamespace(shutdown=lambda: freed.append(1))),
        None,
    )
    r.stop_timeout_s = 0.2
    eng.shutdown()  # the step is still running: vLLM's engine is not torn down under it
    assert freed == [] and r._thread.is_alive()
    llm.gate.set()  # the step ends: the thread stops, the request is told, the engine core goes
    assert r.shutdown(timeout=5) is True
    assert isinstance(_last(box), RuntimeError)
    eng.shutdown()
    assert freed == [1]


async def _cancelled_as_an_item_arrives(wait) -> str:
    """Cancel a consumer blocked in `wait(q)` in the same loop turn as an item reaches `q` (the item first):
    a client leaving while the engine streams tokens back-to-back."""
    q: asyncio.Queue = asyncio.Queue()
    task = asyncio.ensure_future(wait(q))
    await asyncio.sleep(0)  # the consumer now waits on q
    q.put_nowait("token")
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    return "ran on"


async def test_a_stream_cancelled_as_a_token_arrives_is_cancelled():
    assert await _cancelled_as_an_item_arrives(lambda q: next_item(q, 1.0)) == "cancelled"


async def test_the_cancellation_lost_with_wait_for_on_this_python_is_what_next_item_keeps():
    # the fault next_item exists for: where wait_for still drops it (3.11), this shows the scenario is real
    import sys

    got = await _cancelled_as_an_item_arrives(lambda q: asyncio.wait_for(q.get(), 1.0))
    assert got == ("ran on" if sys.version_info < (3, 12) else "cancelled")


async def test_next_item_returns_the_item_or_empty_after_its_timeout_and_loses_nothing():
    q: asyncio.Queue = asyncio.Queue()
    assert await next_item(q, 0.01) is EMPTY
    q.put_nowait(1)
    q.put_nowait(2)
    assert await next_item(q, 0.01) == 1
    assert await next_item(q, 0.01) == 2
    assert q.empty()
