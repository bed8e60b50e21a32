"""Streamed completions (SSE): the engine's events pumped at the engine's pace, keep-alives while it is quiet,
an idle limit, and a response that ends (aborting the request) when the client disconnects or stops reading."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Callable

import anyio
from fastapi.responses import StreamingResponse

from epic_rag.integrations import openai_token_logprob
from epic_rag.types import Delta, Generation

from .errors import failure_message
from .openai_format import epic_figures, text_logprobs, usage
from .plans import Plan
from .state import DemoState

log = logging.getLogger(__name__)


class _StalledReader(Exception):
    """The client did not take a write within the stream's write timeout."""


class EventStreamResponse(StreamingResponse):
    """SSE response that stops (and closes its generator, which aborts the request in the engine) as soon as
    the client disconnects, or stops reading: a write the client does not take within `write_timeout_s`
    ends the response, so a stalled reader cannot hold its slot, the engine request or the busy flag that
    pauses background compilation."""

    media_type = "text/event-stream"

    def __init__(
        self,
        content,
        *,
        on_close: Callable[[], None] | None = None,
        write_timeout_s: float | None = None,
        on_stall: Callable[[], None] | None = None,
        **kw,
    ) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close  # runs however the response ends (even if the stream never started)
        self.write_timeout_s = write_timeout_s
        self.on_stall = on_stall
        self.stalled = False

    async def __call__(self, scope, receive, send):
        async def bounded_send(message) -> None:
            if self.write_timeout_s is None:
                await send(message)
                return
            with anyio.move_on_after(self.write_timeout_s) as waited:
                await send(message)  # uvicorn waits here while the socket's buffers are full
            if waited.cancelled_caught:
                raise _StalledReader

        try:
            async with anyio.create_task_group() as tg:

                async def stream():
                    try:
                        await self.stream_response(bounded_send)
                    except _StalledReader:
                        self.stalled = True
                        log.warning(
                            "streamed response dropped: the client took no write for %g s", self.write_timeout_s
                        )
                        if self.on_stall is not None:
                            self.on_stall()
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()
            if self.on_close is not None:
                self.on_close()


class _StreamIdle(Exception):
    pass


@dataclasses.dataclass(slots=True)
class _Raised:
    error: BaseException


async def _paced(events, keepalive_s: float, idle_s: float):
    """The engine's events, with None whenever it has said nothing for `keepalive_s` (the caller sends an SSE
    comment: proxies keep the connection, and a stalled reader meets the write timeout even while the engine
    is quiet); _StreamIdle after `idle_s` without an event. Closing this cancels the pending read, which
    aborts the request in the engine."""
    it = events.__aiter__()
    pending: asyncio.Future | None = None
    last = time.monotonic()
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            left = idle_s - (time.monotonic() - last)
            if left <= 0:
                raise _StreamIdle(f"no output from the engine for {idle_s:g} s")
            done, _ = await asyncio.wait({pending}, timeout=min(keepalive_s, left))
            if not done:
                yield None
                continue
            fut, pending = pending, None
            try:
                ev = fut.result()
            except StopAsyncIteration:
                return
            last = time.monotonic()
            yield ev
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def event_stream(state: DemoState, engine, body, plan, release: Callable[[], None]) -> EventStreamResponse:
    return EventStreamResponse(
        stream_completion(state, engine, body, plan),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        on_close=release,
        write_timeout_s=state.cfg.stream_write_timeout_s,
        on_stall=lambda: state.metrics.errors.labels("stalled_reader").inc(),
    )


async def stream_completion(state: DemoState, engine, body, plan: Plan):
    m = state.metrics
    model = state.cfg.served_model
    kind = "text_completion" if plan.text else "chat.completion.chunk"
    offset = 0  # characters streamed so far (legacy logprobs' text_offset)

    def chunk(delta: dict, finish: str | None = None, logprobs: list[dict] | None = None, **extra) -> str:
        if plan.text:
            choice = {
                "index": 0,
                "text": delta.get("content", ""),
                "logprobs": text_logprobs(logprobs, offset),
                "finish_reason": finish,
            }
        else:
            lps = None if logprobs is None else {"content": [openai_token_logprob(t) for t in logprobs]}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}
        return sse(
            {"id": plan.id, "object": kind, "created": plan.created, "model": model, "choices": [choice], **extra}
        )

    cfg = state.cfg
    m.inflight.inc()
    state.active_chats += 1
    using_engine = True

    def engine_done() -> None:  # the engine's part is over: the client's reading pace no longer holds it
        nonlocal using_engine
        if using_engine:
            using_engine = False
            m.inflight.dec()
            state.active_chats -= 1

    # The engine's events are taken by a task of their own, not at the client's reading pace: once the engine
    # is done the stream stops counting as busy (background compilation resumes) however slowly the client
    # reads. The buffer holds at most one event per generated token plus keep-alives (bounded by max_tokens
    # and stream_idle_s); a client that stops reading altogether is dropped by the write timeout.
    buffered: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump() -> None:
        try:
            async with contextlib.aclosing(engine.astream_events(plan.req)) as events:
                async with contextlib.aclosing(_paced(events, cfg.stream_keepalive_s, cfg.stream_idle_s)) as paced:
                    async for ev in paced:
                        buffered.put_nowait(ev)
        except Exception as e:  # handed to the stream, which reports it
            buffered.put_nowait(_Raised(e))
        finally:
            engine_done()
            buffered.put_nowait(end)

    pumping = asyncio.create_task(pump())
    outcome = "cancelled"
    try:
        # Sources are known before the first token: the page shows citations while the answer streams.
        if not plan.text:
            yield chunk({"role": "assistant", "content": ""}, epic=epic_figures(plan, None))
        gen: Generation | None = None
        try:
            while (ev := await buffered.get()) is not end:
                if isinstance(ev, _Raised):
                    raise ev.error
                if ev is None:
                    yield ": keep-alive\n\n"
                elif isinstance(ev, Generation):
                    gen = ev
                elif isinstance(ev, Delta) and ev.text:
                    yield chunk({"content": ev.text}, logprobs=ev.logprobs)
                    offset += len(ev.text)
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except _StreamIdle as e:
            outcome = "error"
            log.warning("streamed generation %s given up: %s", plan.id, e)
            m.errors.labels("timeout").inc()
            yield sse(
                {
                    "error": {
                        "message": f"{e} (request id {plan.id})",
                        "type": "server_error",
                        "param": None,
                        "code": 504,
                    }
                }
            )
            yield "data: [DONE]\n\n"
            return
        except Exception as e:
            outcome = "error"
            if not isinstance(e, ValueError):
                log.exception("streamed generation failed [%s]", plan.id)
            m.errors.labels("engine" if not isinstance(e, ValueError) else "bad_request").inc()
            yield sse(
                {
                    "error": {  # a ValueError is the client's (what was wrong); anything else stays in the log
                        "message": str(e) if isinstance(e, ValueError) else failure_message(plan.id),
                        "type": "invalid_request_error" if isinstance(e, ValueError) else "server_error",
                        "param": None,
                        "code": 400 if isinstance(e, ValueError) else 500,
                    }
                }
            )
            yield "data: [DONE]\n\n"
            return
        if gen is None:
            outcome = "error"
            yield sse(
                {
                    "error": {
                        "message": "generation ended without a result",
                        "type": "server_error",
                        "param": None,
                        "code": 500,
                    }
                }
            )
            yield "data: [DONE]\n\n"
            return
        outcome = "ok"
        m.observe_generation(gen, stream=True, asked=plan.policy)
        yield chunk({}, gen.finish_reason or "stop", epic=epic_figures(plan, gen))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield sse(
                {
                    "id": plan.id,
                    "object": kind,
                    "created": plan.created,
                    "model": model,
                    "choices": [],
                    "usage": usage(gen),
                }
            )
        yield "data: [DONE]\n\n"
    finally:
        if not pumping.done():  # the client went away first: abort the engine request
            pumping.cancel()
        with contextlib.suppress(BaseException):
            await pumping
        engine_done()
        if outcome != "ok":
            m.chat.labels(m.policy(plan.policy), "true", outcome).inc()
