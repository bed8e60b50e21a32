"""A non-streamed completion: waits for the engine's answer (aborting it if the client leaves or the engine
dies) and answers in OpenAI's chat.completion / text_completion shape."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import HTTPException, Request
from fastapi.responses import Response

from epic_rag.integrations import openai_logprobs
from epic_rag.types import Generation

from .errors import failure_message
from .openai_format import epic_figures, text_logprobs, usage
from .plans import Plan
from .state import DemoState

log = logging.getLogger(__name__)


async def complete(state: DemoState, engine, body, plan: Plan, request: Request):
    m = state.metrics

    async def collect() -> Generation:
        async with contextlib.aclosing(engine.astream_events(plan.req)) as events:
            async for ev in events:
                if isinstance(ev, Generation):
                    return ev
        raise RuntimeError("generation ended without a result")

    m.inflight.inc()
    state.active_chats += 1
    task = asyncio.create_task(collect())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                break
            if state.not_ready():  # the engine died under this request: do not wait on it
                raise HTTPException(503, "the engine is not running; the server needs a restart")
            if await request.is_disconnected():  # nobody to answer: abort in the engine
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
                m.chat.labels(m.policy(plan.policy), "false", "cancelled").inc()
                return Response(status_code=499)
        try:
            gen = task.result()
        except ValueError as e:
            m.chat.labels(m.policy(plan.policy), "false", "error").inc()
            raise HTTPException(400, str(e)) from None
        except Exception:
            log.exception("generation failed [%s]", plan.id)
            m.chat.labels(m.policy(plan.policy), "false", "error").inc()
            m.errors.labels("engine").inc()
            raise HTTPException(500, failure_message(plan.id)) from None
    finally:
        if not task.done():
            task.cancel()
        m.inflight.dec()
        state.active_chats -= 1
    m.observe_generation(gen, stream=False, asked=plan.policy)
    finish = gen.finish_reason or "stop"
    if plan.text:
        choice = {"index": 0, "text": gen.text, "logprobs": text_logprobs(gen.logprobs), "finish_reason": finish}
    else:
        message = {"role": "assistant", "content": gen.text}
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": openai_logprobs(gen)}
    return {
        "id": plan.id,
        "object": "text_completion" if plan.text else "chat.completion",
        "created": plan.created,
        "model": state.cfg.served_model,
        "choices": [choice],
        "usage": usage(gen),
        "epic": epic_figures(plan, gen),
    }
