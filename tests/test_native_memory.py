"""What made the demo's RSS creep up under load (docs/reliability.md, the soak's open finding), each bounded:
oneDNN's global primitive cache in vLLM's CPU ops (one primitive per batch size), freed heap memory glibc
keeps in its arenas (handed back by the engine thread's malloc_trim), and a regex compiled per request into
re's module cache. No model is loaded here."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from epic_rag.engine.heap import HeapTrimmer, malloc_trim
from epic_rag.engine.runtime import Runtime

ROOT = Path(__file__).resolve().parents[1]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_trimmer_trims_at_most_every_interval_under_load_and_once_after_work_when_idle():
    clock, calls = _Clock(), []
    tr = HeapTrimmer(every_s=10.0, trim=lambda: calls.append(clock.t), clock=clock, idle_gap_s=1.0)
    tr.on_idle()
    assert calls == []  # nothing ran yet: nothing to give back
    for _ in range(50):  # continuous load: 50 steps over 25 s
        clock.t += 0.5
        tr.after_step()
    assert calls == [10.0, 20.0]
    clock.t += 0.5
    tr.on_idle()  # the burst ended: one trim
    tr.on_idle()
    assert calls == [10.0, 20.0, 25.5]
    clock.t += 0.2
    tr.after_step()
    tr.on_idle()  # within the idle gap of the last trim: waits
    assert len(calls) == 3
    clock.t += 1.0
    tr.on_idle()
    assert calls[-1] == pytest.approx(26.7)
    clock.t += 5
    tr.on_idle()  # still idle, nothing new freed: no more
    assert tr.trims == 4 and len(calls) == 4


def test_trimmer_off_and_a_failing_trim_turns_itself_off_without_raising():
    clock = _Clock()
    off = HeapTrimmer(every_s=0, trim=lambda: pytest.fail("trimmed while off"), clock=clock)
    clock.t = 100
    off.after_step()
    off.on_idle()
    assert not off.enabled

    def boom():
        raise OSError("no")

    bad = HeapTrimmer(every_s=1, trim=boom, clock=clock)
    clock.t += 2
    bad.after_step()  # logged, not raised
    assert not bad.enabled and bad.trims == 0
    with pytest.raises(ValueError, match="heap trim"):
        HeapTrimmer(every_s=-1)


def test_engine_thread_trims_the_heap_once_its_requests_are_done():
    from test_runtime_faults import ScriptedLLM

    llm = ScriptedLLM()
    rt = Runtime(llm)
    trimmed = queue.SimpleQueue()
    rt.trimmer = HeapTrimmer(every_s=3600, trim=lambda: trimmed.put(llm.has_unfinished_requests()), idle_gap_s=0)
    box: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(4):  # queued before the thread starts: one burst of work
        rt.submit(f"r{i}", None, None, box.put)
    rt.start()
    try:
        assert trimmed.get(timeout=5) is False  # after the work, with nothing left unfinished
        assert box.qsize() == 12  # every output was delivered before the trim
        with pytest.raises(queue.Empty):
            trimmed.get(timeout=1.2)  # idle with nothing new: no further trims
    finally:
        rt.shutdown()


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(malloc_trim() is None or not Path("/proc/self/status").exists(), reason="needs glibc and /proc")
def test_malloc_trim_hands_freed_heap_pages_back():
    """What the engine's trim is for: heap blocks freed between live ones stay resident until trimmed."""
    blocks = [bytearray(64 << 10) for _ in range(3200)]  # 200 MiB of heap blocks (below the mmap threshold)
    pins = blocks[::16]  # one live block in 16: the holes between them cannot go back by themselves
    before = _rss_kib()
    del blocks
    kept = _rss_kib()
    malloc_trim()()
    after = _rss_kib()
    assert len(pins) == 200
    assert kept > before - 50_000, (before, kept, after)  # freed, but still resident
    assert after < kept - 120_000, (before, kept, after)  # given back by the trim


def test_prepare_process_bounds_onednn_primitive_cache_and_keeps_a_users_setting(monkeypatch):
    from epic_rag.config import EngineConfig
    from epic_rag.engine import vllm_api

    monkeypatch.setattr(vllm_api.torch.cuda, "is_available", lambda: False)
    saved = dict(os.environ)  # prepare_process sets the process environment: put it back afterwards
    try:
        os.environ.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
        vllm_api.prepare_process(EngineConfig(model="smollm2-135m-instruct"))
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(vllm_api.ONEDNN_PRIMITIVE_CACHE)
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "7"
        vllm_api.prepare_process(EngineConfig(model="smollm2-135m-instruct"))
        assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow  # vLLM in a fresh process
def test_onednn_matmuls_over_many_batch_sizes_hold_bounded_memory_after_prepare_process():
    """vLLM's CPU linear kernel over 400 distinct batch sizes (as steps of varied load produce) in a fresh
    process set up like the engine's: live heap growth stays near the bounded cache (~43 MiB measured here
    with 128 primitives; oneDNN's default 1024 held ~130 MiB and kept growing with more sizes)."""
    pytest.importorskip("vllm")
    code = textwrap.dedent(
        """
        import ctypes, random, sys
        sys.path.insert(0, sys.argv[1])
        import torch
        from epic_rag.config import EngineConfig
        from epic_rag.engine import vllm_api
        vllm_api.prepare_process(EngineConfig(model="smollm2-135m-instruct"))
        from vllm import _custom_ops as ops
        if not ops._supports_onednn:
            print("skip")
            sys.exit(0)

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in
                        ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                         "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        torch.manual_seed(0)
        handler = ops.create_onednn_mm(torch.randn(1536, 576).t(), 32)
        x = torch.randn(4096, 576)
        live = libc.mallinfo2().uordblks
        for m in random.Random(0).sample(range(1, 4097), 400):
            ops.onednn_mm(handler, x[:m], None)
        print((libc.mallinfo2().uordblks - live) / 2**20)
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEDNN_", "DNNL_"))}
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.split()[-1]
    if last == "skip":
        pytest.skip("this vLLM build has no oneDNN matmul")
    assert float(last) < 80, f"live heap grew {last} MiB over 400 batch sizes"


def test_chat_template_placeholders_compile_no_regex_per_request():
    from epic_rag.prompt import _Marks
    from epic_rag.types import Chunk

    cache = getattr(re, "_cache", None)
    if not isinstance(cache, dict):
        pytest.skip("this Python's re module keeps no _cache dict")
    re.purge()
    for _ in range(40):
        marks = _Marks()
        text = f"<s>{marks.add([Chunk('doc')])} and {marks.add(['q'])}</s>"
        assert marks.split(text) == ["<s>", Chunk("doc"), " and ", "q", "</s>"]
    assert len(cache) < 5, len(cache)  # was one pattern per request (per nonce)
    marks = _Marks()
    mark = marks.add(["a"])
    with pytest.raises(ValueError, match="placeholders"):
        marks.split(mark.replace("_0\x00", "_0"))  # its end mangled by the template
    with pytest.raises(ValueError, match="placeholders"):
        marks.split(mark + mark)  # repeated
