"""vLLM's LLMEngine run in-process by one stepping thread, with per-request output streams.

Callers (sync threads or asyncio tasks) submit requests; the thread adds them between steps (the
engine core is not thread-safe), steps while anything is unfinished, and routes each delta to its
request's sink. Many concurrent requests are batched by vLLM's scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..types import Delta
from . import vllm_api
from .connector.tenancy import unique_salt
from .heap import TRIM_EVERY_S, HeapTrimmer

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting caller checks that the engine thread is alive
STALL_S = 600.0  # a request with no output for this long is given up (a step hung inside vLLM)


EMPTY = object()  # what next_item returns when nothing came within its timeout


async def next_item(q: asyncio.Queue, timeout: float):
    """The next item of `q`, or EMPTY after `timeout` s. A cancellation of the caller always propagates:
    Python 3.11's `asyncio.wait_for` returns the item instead when the cancellation arrives as the item does
    (a client leaving a fast token stream), and the request ran on to its end."""
    getter = asyncio.ensure_future(q.get())
    try:
        done, _ = await asyncio.wait({getter}, timeout=timeout)
    finally:
        if not getter.done():
            getter.cancel()  # Queue.get leaves the item queued when cancelled
    return getter.result() if done else EMPTY


@dataclass
class _Pending:
    req_id: str
    prompt: Any
    params: Any
    sink: Callable[[Delta | BaseException], None]


@dataclass
class Runtime:
    llm: Any  # vllm.v1.engine.llm_engine.LLMEngine
    _inbox: "queue.SimpleQueue[_Pending | tuple[str, str]]" = field(default_factory=queue.SimpleQueue)
    _sinks: dict[str, Callable] = field(default_factory=dict)
    _wake: threading.Event = field(default_factory=threading.Event)
    _stop: bool = False
    _thread: threading.Thread | None = None
    fatal: BaseException | None = None
    # Freed heap memory goes back to the OS at most this often under load, and once after work (heap.py)
    heap_trim_s: float = TRIM_EVERY_S
    stop_timeout_s: float = 60.0  # shutdown waits this long for the step under way (a long prefill on a CPU)
    trimmer: HeapTrimmer = field(init=False)

    def __post_init__(self) -> None:
        self.trimmer = HeapTrimmer(self.heap_trim_s)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="epic-rag-engine", daemon=True)
        self._thread.start()

    def health(self) -> str | None:
        """None while requests can be served; otherwise why not (a fatal error, a dead or unstarted thread,
        vLLM's engine core process gone: vLLM's own monitor marks it dead, seen here even while idle)."""
        if self.fatal is not None:
            return f"engine stopped after a fatal error ({type(self.fatal).__name__})"
        if self._thread is None:
            return "engine thread not started"
        if not self._thread.is_alive():
            return "engine thread is not running"
        if _core_dead(self.llm):
            return "vLLM's engine core process has died"
        return None

    def wait_for(self, ev: threading.Event, stall_s: float = STALL_S) -> None:
        """Wait until `ev` is set (a request ended); raise when the engine thread dies meanwhile, or when
        nothing ends for `stall_s` (a step hung inside vLLM), instead of waiting for ever."""
        self.poll(lambda t: ev.wait(t) or None, stall_s)

    def poll(self, get: Callable[[float], Any], stall_s: float = STALL_S) -> Any:
        """`get(timeout)` until it returns something other than None (or raises queue.Empty meaning none
        yet), checking the engine's health every POLL_S; TimeoutError after `stall_s` without a result."""
        deadline = time.monotonic() + stall_s
        while True:
            try:
                got = get(POLL_S)
            except queue.Empty:
                got = None
            if got is not None:
                return got
            why = self.health()
            if why is not None:
                raise RuntimeError(why)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no output from the engine for {stall_s:g} s")

    def submit(self, req_id: str, prompt: Any, params: Any, sink: Callable[[Delta | BaseException], None]) -> None:
        if self.fatal is not None:
            raise RuntimeError(f"engine stopped after a fatal error: {self.fatal}")
        if self._stop:
            raise RuntimeError("engine shut down")
        self._inbox.put(_Pending(req_id, prompt, params, sink))
        self._wake.set()
        if self.fatal is not None or self._stop or (self._thread is not None and not self._thread.is_alive()):
            # the thread ended (or is ending) after the checks above: it may never take this from the inbox
            self._fail_inbox(self.fatal or RuntimeError("engine shut down"))

    def submit_tokens(
        self,
        prompt_ids: list[int],
        sink: Callable[[Delta | BaseException], None],
        *,
        max_tokens: int,
        temperature: float = 0.0,
        salt: str | None = None,
        kv_params: dict | None = None,
        stop: list[str] | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> str:
        """Submit a tokenized prompt; returns its request id. A fresh `salt` (the default, in the default
        tenant namespace: tenancy.py) keeps its KV out of everyone else's prefix-cache hits. `options`: further
        checked sampling options (epic_rag.sampling)."""
        prompt, params = vllm_api.request_inputs(
            prompt_ids, salt or unique_salt(), max_tokens, temperature, stop, seed, kv_params, **options
        )
        req_id = uuid.uuid4().hex
        self.submit(req_id, prompt, params, sink)
        return req_id

    def _decode(self, token_ids: list[int]) -> str:
        return self.llm.get_tokenizer().decode(token_ids)

    def idle(self) -> bool:
        """True when no request is in flight: none waiting for output here, none unfinished in vLLM."""
        return not self._sinks and not vllm_api.has_work(self.llm)

    def in_flight(self) -> int:
        """Requests submitted and not finished (their output still streams to a sink)."""
        return len(self._sinks)

    def abort(self, req_id: str) -> None:
        self._inbox.put(("abort", req_id))
        self._wake.set()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop stepping: the thread ends the step it is in (a compile's record is stored whole or not at all)
        and fails every request still waiting. True once the thread has ended (or never ran); False when it is
        still inside a step after `timeout` s (default stop_timeout_s), and vLLM's engine must then be left
        alone."""
        self._stop = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.stop_timeout_s if timeout is None else timeout)
        return self._thread is None or not self._thread.is_alive()

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Pending):
                try:
                    self.llm.add_request(item.req_id, item.prompt, item.params)
                except Exception as e:  # bad request: tell the caller, keep serving
                    _notify(item.sink, e)
                    if _is_engine_dead(e):  # not this request's fault: no request can be served any more
                        raise
                    continue
                self._sinks[item.req_id] = item.sink
            elif self._sinks.pop(item[1], None) is not None:  # ("abort", req_id)
                self.llm.abort_request([item[1]])

    def _fail_inbox(self, err: BaseException) -> None:
        """Every request still waiting in the inbox gets `err` (none is left waiting for a dead thread)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Pending):
                _notify(item.sink, err)

    def _loop(self) -> None:
        try:
            while not self._stop:
                self._drain()
                if not vllm_api.has_work(self.llm):
                    self.trimmer.on_idle()
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._route(self.llm.step())
                self.trimmer.after_step()
        except BaseException as e:  # a failed step, add or abort: the engine is unusable from here on
            log.exception("engine thread failed; failing every pending request")
            self.fatal = e
            sinks, self._sinks = list(self._sinks.values()), {}
            for sink in sinks:
                _notify(sink, e)
            self._fail_inbox(e)
            return
        # stopped: callers still waiting are told so
        err = RuntimeError("engine shut down")
        sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            _notify(sink, err)
        self._fail_inbox(err)

    def _route(self, outputs) -> None:
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            sink = self._sinks.get(rid)
            if sink is None:
                continue
            c = out.outputs[0] if out.outputs else None
            lps = getattr(c, "logprobs", None) if c else None
            d = Delta(
                text=c.text if c else "",
                token_ids=list(c.token_ids) if c else [],
                finished=out.finished,
                finish_reason=c.finish_reason if c else None,
                t=now,
                cached_tokens=getattr(out, "num_cached_tokens", None),
                logprobs=None if lps is None else vllm_api.token_logprobs(lps, list(c.token_ids), self._decode),
                kv_transfer_params=getattr(out, "kv_transfer_params", None) if out.finished else None,
            )
            if out.finished:
                del self._sinks[rid]
            if not _notify(sink, d) and not out.finished:  # nobody can take its output: stop generating it
                del self._sinks[rid]
                self.llm.abort_request([rid])


def _is_engine_dead(e: BaseException) -> bool:
    """vLLM's EngineDeadError: its engine core (own process) is gone, for good."""
    from vllm.v1.engine.exceptions import EngineDeadError

    return isinstance(e, EngineDeadError)


def _core_dead(llm) -> bool:
    """Whether vLLM marked its engine core process dead (a multiprocess engine; False in-process)."""
    resources = getattr(getattr(llm, "engine_core", None), "resources", None)
    return getattr(resources, "engine_dead", False) is True


def _notify(sink: Callable[[Delta | BaseException], None], d: Delta | BaseException) -> bool:
    """Call a sink; one that raises (e.g. call_soon_threadsafe on a closed event loop) is logged, never
    allowed to kill the stepping thread that serves everyone else. False when it raised."""
    try:
        sink(d)
        return True
    except Exception:
        log.warning("a request's output sink failed; dropping its output", exc_info=True)
        return False
