"""The demo's FastAPI app, assembled: shared state, middleware, error handlers, the open routes (health, the
chat page) and the routers that do work (documents.py, openai_api.py).

Every chat request goes through the engine's async path (EpicEngine.astream_events) with no lock
around generation, so vLLM batches concurrent chats. A client that disconnects cancels its stream:
the cancellation reaches the engine's async generator, which aborts the request in vLLM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from .access import AccessGuard
from .config import PAGE_POLICIES, DemoConfig
from .documents import documents_router
from .errors import install_error_handlers, refusal_response
from .middleware import LimitsAndMetrics
from .openai_api import openai_router
from .state import DemoState

STATIC_DIR = Path(__file__).parent / "static"
PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


def create_app(engine=None, config: DemoConfig | None = None, *, encoder=None) -> FastAPI:
    """The demo app. Pass a ready engine (tests share one), or attach one later with
    app.state.demo.attach_engine(engine) (the CLI serves /healthz while the engine loads)."""
    cfg = config or DemoConfig()
    if engine is not None:  # the model actually served is the engine's (the caller's config is left as it is)
        cfg = dataclasses.replace(cfg, model=str(engine.config.model))
    state = DemoState(cfg, encoder)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        state.library.stop()
        state.upload_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="epic-rag demo", version="0.1.0", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.demo = state
    # Starlette runs the last added outermost: limits and metrics see every answer, AccessGuard's too.
    app.add_middleware(
        AccessGuard,
        api_key=cfg.api_key,
        bind_host=cfg.host,
        allowed_hosts=cfg.allowed_hosts,
        allowed_origins=cfg.allowed_origins,
        respond=refusal_response,
    )
    app.add_middleware(LimitsAndMetrics, state=state)
    install_error_handlers(app)

    # ------------------------------------------------------------------ open routes
    @app.get("/healthz")
    async def healthz():
        # 200 only when a chat completion can be served: load balancers and clients may wait on it.
        reason = state.not_ready()
        body = {
            "status": "ok" if reason is None else "loading" if state.engine is None else "failed",
            "reason": reason,
            "model": cfg.served_model,
            "ingest": state.library.progress.state,
            "auth_required": cfg.api_key is not None,
            "default_policy": cfg.policy,
            "policies": PAGE_POLICIES,
            "top_k": cfg.top_k,
            "max_top_k": cfg.max_top_k,
            "default_max_tokens": cfg.default_max_tokens,
            "max_tokens_limit": cfg.max_tokens_limit,
            "max_upload_bytes": cfg.max_upload_bytes,
            "uptime_s": round(time.time() - state.started, 1),
        }
        return body if reason is None else JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.get("/", include_in_schema=False)
    async def page():
        return FileResponse(
            STATIC_DIR / "index.html",
            media_type="text/html",
            headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"},
        )

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    # ------------------------------------------------------------------ routes that do work
    # (the API key is checked by AccessGuard, before a body is read)
    metrics = APIRouter()

    @metrics.get("/metrics")
    async def prometheus_metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.include_router(metrics)
    app.include_router(openai_router(state))
    app.include_router(documents_router(state))
    if engine is not None:
        state.attach_engine(engine)
    return app
