"""The OpenAI-compatible routes: /v1/models, /v1/chat/completions (retrieval over the library, then the
engine) and /v1/completions (a prompt string as given). Each completion holds one admission slot until its
answer, or its stream, ends."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request

from .answers import complete
from .plans import plan_chat, plan_text
from .schemas import ChatCompletionRequest, CompletionRequest
from .state import DemoState
from .streaming import event_stream


def openai_router(state: DemoState) -> APIRouter:
    cfg = state.cfg
    api = APIRouter()

    @api.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": cfg.served_model,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "epic-rag",
                    "max_model_len": state.engine.max_model_len if state.engine is not None else cfg.max_model_len,
                }
            ],
        }

    async def serve(body, request: Request, plan_for):
        """Both completion endpoints: one admission slot, a plan (`plan_for`), then a stream or an answer."""
        engine = state.ready_engine()
        release = await state.admission.enter()
        if release is None:
            state.metrics.errors.labels("overloaded").inc()
            raise HTTPException(429, "too many requests in flight; retry shortly", headers={"Retry-After": "1"})
        try:
            plan = await plan_for(state, body, engine)
            if body.stream:
                resp = event_stream(state, engine, body, plan, release)
                release = None  # the response releases the slot when it ends
                return resp
            return await complete(state, engine, body, plan, request)
        finally:
            if release is not None:
                release()

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serve(body, request, plan_chat)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serve(body, request, plan_text)

    return api
