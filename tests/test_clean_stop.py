"""A clean stop (issue 36): Ctrl-C or SIGTERM at any moment stops background work, joins its threads and tears
the engine down in order. Exit code 130 (SIGINT) or 0 (SIGTERM), no C++ abort ("terminate called without an
active exception", what `make demo` ended with when stopped while compiling its corpus), no traceback, and
the disk store holds only whole entries (written to a temp file, then renamed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from epic_rag.corpus import pydoc_documents
from epic_rag.stopping import StopSignals
from epic_rag.store import DiskStore

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"


def test_the_first_stop_signal_interrupts_and_later_ones_wait_for_the_teardown():
    with StopSignals() as s:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs here
        os.kill(os.getpid(), signal.SIGINT)  # during the teardown: ignored
        time.sleep(0.1)
        assert s.received == signal.SIGTERM and s.exit_code == 0
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored
    with StopSignals() as s:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
    assert s.exit_code == 130


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=path, HF_HUB_OFFLINE="1")


def _corpus(folder: Path) -> Path:
    folder.mkdir()
    for doc in pydoc_documents(["json", "csv"]):  # ~40 chunks: minutes of compiling on a CPU
        (folder / doc.name).write_text(doc.text)
    return folder


def _start(args: list[str], log: Path) -> subprocess.Popen:
    # its own session: the signal goes to its whole process group, as a terminal's Ctrl-C does
    return subprocess.Popen(
        [sys.executable, "-m", "epic_rag.cli", *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=log.open("wb"),
        start_new_session=True,
    )


def _wait_for(cond, proc: subprocess.Popen, log: Path, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        assert proc.poll() is None, f"ended before {what} (rc={proc.returncode}):\n{log.read_text()[-4000:]}"
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"no {what} within {timeout} s:\n{log.read_text()[-4000:]}")


def _stopped_cleanly(proc: subprocess.Popen, log: Path, sig: int, expect_rc: int) -> None:
    os.killpg(proc.pid, sig)
    try:
        rc = proc.wait(180)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running 180 s after the signal:\n{log.read_text()[-4000:]}") from None
    err = log.read_text()
    assert "terminate called" not in err, err[-4000:]  # a C++ abort (the exit code would be -6)
    assert "Traceback" not in err, err[-4000:]
    assert rc == expect_rc, f"rc={rc}:\n{err[-4000:]}"


def _only_whole_entries(root: Path) -> int:
    """Every entry in a disk store reads back whole; no temp file of a write is left. The number of entries."""
    assert not [p.name for p in root.rglob(".tmp-*")]
    store = DiskStore(root)
    keys = store.keys()
    assert all(store.get(k) is not None for k in keys)  # a damaged entry reads as None (and is dropped)
    return len(keys)


@pytest.mark.slow
@pytest.mark.smollm
def test_the_demo_stopped_with_ctrl_c_mid_compile_exits_130_without_an_abort_and_keeps_whole_entries(tmp_path):
    corpus, data, log = _corpus(tmp_path / "corpus"), tmp_path / "data", tmp_path / "demo.log"
    args = ["demo", "--model", MODEL, "--corpus", str(corpus), "--data-dir", str(data), "--port", "0"]
    proc = _start([*args, "--no-browser-needed", "--max-model-len", "4096"], log)
    try:
        url = _wait_for(
            lambda: next((w for w in log.read_text().split() if w.startswith("http://127.0.0.1:")), None),
            proc,
            log,
            60,
            "server address",
        )

        def compiling():
            try:
                s = httpx.get(f"{url}/api/status", timeout=5).json()
            except httpx.HTTPError:
                return False
            return s["state"] == "compiling" and 0 < s["compiled"] < s["chunks"]

        _wait_for(compiling, proc, log, 600, "compile under way")
        _stopped_cleanly(proc, log, signal.SIGINT, 130)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert _only_whole_entries(data / "kv") > 0


@pytest.mark.slow
@pytest.mark.smollm
def test_the_engine_of_epic_rag_ask_stopped_with_sigterm_mid_compile_exits_0_and_keeps_whole_entries(tmp_path):
    corpus, store, log = _corpus(tmp_path / "corpus"), tmp_path / "kv", tmp_path / "ask.log"
    args = ["ask", "-q", "How do I parse JSON?", "--docs", str(corpus), "--model", MODEL]
    proc = _start([*args, "--store", f"disk:{store}", "--top-k", "24", "--chunk-tokens", "256"], log)
    try:
        _wait_for(lambda: "engine ready" in log.read_text(), proc, log, 300, "engine start")
        time.sleep(1.0)  # 24 chunks take longer than this to compile
        assert "compiled " not in log.read_text(), "the compile ended before the signal: nothing was tested"
        _stopped_cleanly(proc, log, signal.SIGTERM, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
    _only_whole_entries(store)
