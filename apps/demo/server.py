"""The demo's FastAPI app: chat page, document routes, OpenAI-compatible API, health and metrics.

Every chat request goes through the engine's async path (EpicEngine.astream_events) with no lock
around generation, so vLLM batches concurrent chats. A client that disconnects cancels its stream:
the cancellation reaches the engine's async generator, which aborts the request in vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import anyio
from fastapi import APIRouter, FastAPI, File, HTTPException, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from epic_rag.integrations import openai_logprobs, openai_token_logprob, usage_of
from epic_rag.policy import parse_policy
from epic_rag.types import Delta, Generation, RagRequest

from .access import AccessGuard
from .config import PAGE_POLICIES, DemoConfig
from .library import ChunkRecord, Library, QuotaExceeded, private_dir
from .metrics import DemoMetrics
from .schemas import ChatCompletionRequest, CompletionRequest

log = logging.getLogger(__name__)
STATIC_DIR = Path(__file__).parent / "static"
# The method label of the request counter: any other method a client invents counts as "other" (no new series).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})
PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)


class DemoState:
    """What the routes share: config, engine (None while it loads), library, metrics."""

    def __init__(self, config: DemoConfig, encoder=None) -> None:
        self.cfg = config
        self.engine = None
        private_dir(config.data_dir)  # the demo's data (KV, uploads, embeddings) is its owner's only
        self.library = Library(config, encoder)
        self.metrics = DemoMetrics(lambda: self.engine, self.library, frozenset(PAGE_POLICIES) | {config.policy})
        self.admission = Admission(config.max_inflight, config.max_queued)
        self.uploads = 0  # upload requests being received, waiting or parsed (LimitsAndMetrics admits them)
        self.started = time.time()
        self.active_chats = 0  # chat completions in flight (ingestion yields to them)
        self.library.busy = lambda: self.active_chats > 0
        # Uploads wait on their parser process here, not in the default pool that chat requests need.
        self.upload_pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="epic-demo-upload")

    def not_ready(self) -> str | None:
        """None when a chat completion can be served now; otherwise why not (loading, engine dead)."""
        if self.engine is None:
            return "the engine is still loading"
        runtime = getattr(self.engine, "runtime", None)
        return runtime.health() if runtime is not None else None

    def attach_engine(self, engine) -> None:
        """Hand over a ready engine: the corpus starts loading in the background."""
        self.engine = engine
        self.library.start(engine)


class Admission:
    """At most `limit` chat completions run and `queue` more wait; the caller answers 429 beyond that, so
    a burst of clients cannot queue unbounded work (and its KV) in the engine."""

    def __init__(self, limit: int, queue: int) -> None:
        self.limit, self.queue = limit, queue
        self.running = self.waiting = 0
        self._sem = asyncio.Semaphore(limit)

    async def enter(self) -> Callable[[], None] | None:
        """A release function once a slot is held, or None when the queue is full (nothing held)."""
        if self.running + self.waiting >= self.limit + self.queue:
            return None
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.running -= 1
                self._sem.release()

        return release


# ---------------------------------------------------------------------- ASGI middleware
class _BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body exceeds the limit of {limit} bytes")


class LimitsAndMetrics:
    """Caps request bodies (413 before the route reads past the limit), counts requests by route."""

    def __init__(self, app, state: DemoState) -> None:
        self.app = app
        self.state = state

    def _limit(self, path: str) -> int:
        cfg = self.state.cfg
        return cfg.max_upload_bytes + (64 << 10) if path == "/api/documents" else cfg.max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self._limit(scope["path"])
        status = {"code": 500, "started": False}
        cfg, state = self.state.cfg, self.state
        # Uploads are admitted before their body is read: at most max_upload_inflight + max_upload_queued at
        # once (each holds its body, and a parse keeps a core busy), then 429, so uploads cannot queue without
        # bound behind the two parser threads.
        upload = scope["path"] == "/api/documents" and scope.get("method") == "POST"
        if upload and state.uploads >= cfg.max_upload_inflight + cfg.max_upload_queued:
            state.metrics.errors.labels("uploads_overloaded").inc()
            resp = _error_response(429, "too many uploads in progress; retry shortly", headers={"Retry-After": "2"})
            await resp(scope, receive, send)
            state.metrics.requests.labels("/api/documents", "POST", "429").inc()
            return
        state.uploads += upload

        async def send_wrapper(msg):
            if msg["type"] == "http.response.start":
                status["code"], status["started"] = msg["status"], True
                headers = list(msg.get("headers", []))
                headers.append((b"x-content-type-options", b"nosniff"))
                msg = {**msg, "headers": headers}
            await send(msg)

        try:
            declared = dict(scope.get("headers") or []).get(b"content-length")
            if declared is not None and (not declared.isdigit() or int(declared) > limit):
                resp = _error_response(
                    413 if declared.isdigit() else 400,
                    f"request body exceeds the limit of {limit} bytes"
                    if declared.isdigit()
                    else "bad Content-Length header",
                )
                await resp(scope, receive, send_wrapper)
                return
            seen = 0

            async def limited_receive():
                nonlocal seen
                msg = await receive()
                if msg["type"] == "http.request":
                    seen += len(msg.get("body", b""))
                    if seen > limit:
                        raise _BodyTooLarge(limit)
                return msg

            try:
                await self.app(scope, limited_receive, send_wrapper)
            except Exception:
                if status["started"]:
                    raise
                # Answered here rather than by Starlette's ServerErrorMiddleware, which re-raises: uvicorn
                # would then close the keep-alive connection, failing the client's next request on it.
                await _internal_error(scope["path"])(scope, receive, send_wrapper)
        finally:
            state.uploads -= upload
            route = scope.get("route")
            label = getattr(route, "path", None) or ("/static" if scope["path"].startswith("/static/") else "other")
            method = scope.get("method", "")
            m = self.state.metrics
            m.requests.labels(label, method if method in HTTP_METHODS else "other", str(status["code"])).inc()
            if status["code"] >= 400:
                m.errors.labels(f"http_{status['code']}").inc()


def _error_response(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        503: "service_unavailable",
        507: "quota_exceeded",
    }.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status_code=status,
        headers=headers,
    )


def _internal_error(where: str) -> JSONResponse:
    """A 500 that says nothing about internals: the details go to the log under a request id."""
    rid = f"err-{uuid.uuid4().hex[:16]}"
    log.exception("unhandled error on %s [%s]", where, rid)
    return _error_response(500, f"internal error (request id {rid}; details in the server log)")


def _failure_message(request_id: str) -> str:
    return f"generation failed (request id {request_id}; details in the server log)"


def _refusal_response(status: int, message: str) -> JSONResponse:
    return _error_response(status, message, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errs = exc.errors()
    if not errs:
        return "invalid request", None
    e = errs[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
    if e.get("type") == "model_attributes_type" and not loc:
        return "request body must be a JSON object", None
    where = ".".join(loc) or "body"
    more = f" (and {len(errs) - 1} more problems)" if len(errs) > 1 else ""
    return f"{where}: {e.get('msg', 'invalid value')}{more}", where


# ---------------------------------------------------------------------- streaming response
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


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------- app
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
        respond=_refusal_response,
    )
    app.add_middleware(LimitsAndMetrics, state=state)

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        msg, param = _validation_message(exc)
        return _error_response(400, msg, param)

    @app.exception_handler(HTTPException)
    async def _on_http(request: Request, exc: HTTPException):
        return _error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(StarletteHTTPException)
    async def _on_starlette_http(request: Request, exc: StarletteHTTPException):
        return _error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception):
        return _internal_error(request.url.path)

    def need_engine():
        if state.engine is None:
            raise HTTPException(
                503, "the engine is still loading; retry in a few seconds", headers={"Retry-After": "5"}
            )
        if state.not_ready():  # the engine thread died: restart the server
            raise HTTPException(503, "the engine is not running; the server needs a restart")
        return state.engine

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
    api = APIRouter()  # the API key is checked by AccessGuard, before a body is read

    @api.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

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

    @api.get("/api/status")
    async def status():
        return {**state.library.status(), "engine": state.engine is not None}

    @api.get("/api/documents")
    async def list_documents():
        return {"documents": state.library.list_documents(), "status": state.library.status()}

    @api.post("/api/documents", status_code=202)
    async def upload_document(file: UploadFile = File(...)):
        data = await file.read(cfg.max_upload_bytes + 1)
        if len(data) > cfg.max_upload_bytes:
            raise HTTPException(413, f"document exceeds the upload limit of {cfg.max_upload_bytes} bytes")
        try:
            add = functools.partial(state.library.add_upload, file.filename or "", data)
            info = await asyncio.get_running_loop().run_in_executor(state.upload_pool, add)
        except QuotaExceeded as e:
            raise HTTPException(507, str(e)) from None
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return {"document": info.as_dict()}

    @api.delete("/api/documents/{name:path}")
    async def delete_document(name: str):
        info = await asyncio.to_thread(state.library.delete, name)
        if info is None:
            raise HTTPException(404, f"no document named {name!r}")
        return {"deleted": info.name, "file_removed": info.path is not None}

    async def serve(body, request: Request, plan_for):
        """Both completion endpoints: one admission slot, a plan (`plan_for`), then a stream or an answer."""
        engine = need_engine()
        release = await state.admission.enter()
        if release is None:
            state.metrics.errors.labels("overloaded").inc()
            raise HTTPException(429, "too many requests in flight; retry shortly", headers={"Retry-After": "1"})
        try:
            plan = await plan_for(state, body, engine)
            if body.stream:
                resp = _event_stream(state, engine, body, plan, release)
                release = None  # the response releases the slot when it ends
                return resp
            return await _complete(state, engine, body, plan, request)
        finally:
            if release is not None:
                release()

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serve(body, request, _plan)

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await serve(body, request, _plan_text)

    app.include_router(api)
    if engine is not None:
        state.attach_engine(engine)
    return app


def _event_stream(state: DemoState, engine, body, plan, release: Callable[[], None]) -> EventStreamResponse:
    return EventStreamResponse(
        _stream(state, engine, body, plan),
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        on_close=release,
        write_timeout_s=state.cfg.stream_write_timeout_s,
        on_stall=lambda: state.metrics.errors.labels("stalled_reader").inc(),
    )


# ---------------------------------------------------------------------- chat completions
class _Plan:
    """One request resolved: engine request, sources, sampling settings; `text`: a /v1/completions request."""

    def __init__(
        self,
        req,
        sources: list[dict],
        policy: str,
        max_tokens: int,
        temperature: float,
        retrieval_s: float,
        text: bool = False,
    ) -> None:
        self.req = req
        self.sources = sources
        self.policy = policy
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.retrieval_s = retrieval_s
        self.text = text
        self.id = f"{'cmpl' if text else 'chatcmpl'}-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())


def _check_model_and_sampling(cfg: DemoConfig, body, max_tokens: int) -> str:
    """The checks both endpoints share; returns the policy's name."""
    if body.model and body.model not in (cfg.served_model, cfg.model, "epic-rag", "default"):
        raise HTTPException(404, f"model {body.model!r} not found; this server serves {cfg.served_model!r}")
    if max_tokens > cfg.max_tokens_limit:
        raise HTTPException(400, f"max_tokens must be at most {cfg.max_tokens_limit}, got {max_tokens}")
    try:
        return parse_policy(body.policy or cfg.policy).name
    except ValueError as e:
        raise HTTPException(400, f"policy: {e}") from None


async def _prepare(engine, req, body, max_tokens: int, temperature: float, policy: str, too_long_hint: str = ""):
    """Validated and tokenized once, off the event loop; the engine's own checks decide what fits."""
    try:
        prepare = functools.partial(
            engine.prepare,
            req,
            max_tokens=max_tokens,
            temperature=temperature,
            policy=policy,
            stop=body.stop_list,
            **body.sampling_options(),
        )
        return await asyncio.to_thread(prepare)
    except ValueError as e:
        if "context window" in str(e):
            raise HTTPException(400, f"prompt too long: {e}{too_long_hint}") from None
        raise HTTPException(400, f"invalid request: {e}") from None


async def _plan_text(state: DemoState, body: CompletionRequest, engine) -> _Plan:
    """/v1/completions: the prompt as given; compiled chunk texts found in it are linked."""
    cfg = state.cfg
    max_tokens = body.max_tokens or cfg.default_max_tokens
    policy = _check_model_and_sampling(cfg, body, max_tokens)
    if len(body.prompt) > cfg.max_prompt_chars:
        raise HTTPException(400, f"prompt too long: {len(body.prompt)} characters, limit {cfg.max_prompt_chars}")
    temperature = 0.0 if body.temperature is None else float(body.temperature)
    req = await _prepare(engine, body.prompt, body, max_tokens, temperature, policy)
    return _Plan(req, [], policy, max_tokens, temperature, 0.0, text=True)


async def _plan(state: DemoState, body: ChatCompletionRequest, engine) -> _Plan:
    cfg = state.cfg
    max_tokens = body.max_completion_tokens or body.max_tokens or cfg.default_max_tokens
    policy = _check_model_and_sampling(cfg, body, max_tokens)
    if len(body.messages) > cfg.max_messages:
        raise HTTPException(400, f"messages: at most {cfg.max_messages} messages per request")
    chars = sum(len(m.text) for m in body.messages)
    if chars > cfg.max_prompt_chars:
        raise HTTPException(400, f"prompt too long: {chars} characters of messages, limit {cfg.max_prompt_chars}")
    last = body.messages[-1]
    if last.role != "user" or not last.text.strip():
        raise HTTPException(400, "messages: the last message must be a non-empty user message")
    top_k = cfg.top_k if body.top_k is None else body.top_k
    if top_k > cfg.max_top_k:
        raise HTTPException(400, f"top_k must be at most {cfg.max_top_k}, got {top_k}")
    temperature = 0.0 if body.temperature is None else float(body.temperature)

    system = "\n".join(m.text for m in body.messages if m.role in ("system", "developer") and m.text) or None
    dialog = [m for m in body.messages if m.role in ("user", "assistant")]
    question = last.text.strip()

    t0 = time.perf_counter()
    picked: list[tuple[ChunkRecord, float | None]] = []
    if body.chunk_ids:
        found, missing = state.library.get_chunks(list(dict.fromkeys(body.chunk_ids)))
        if missing:
            raise HTTPException(400, f"chunk_ids: unknown chunk ids {missing[:5]} (ids look like 'doc.txt#0')")
        picked = [(c, None) for c in found]
    elif body.use_retrieval and top_k > 0:
        picked = await asyncio.to_thread(state.library.search, question, top_k)
    retrieval_s = time.perf_counter() - t0
    if not body.chunk_ids and body.use_retrieval and top_k > 0:
        state.metrics.retrieval.observe(retrieval_s)

    if picked:
        earlier = dialog[:-1][-cfg.history_messages :]
        if earlier:
            lines = "\n".join(f"{m.role.capitalize()}: {m.text.strip()}" for m in earlier)
            question = f"{question}\n\n(Earlier in this conversation:\n{lines})"
        chunks = [c.ref if c.ref is not None and c.ref.key else c.text for c, _ in picked]
        req = RagRequest(question=question, chunks=chunks, system=system)
    else:
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": m.role, "content": m.text} for m in dialog[-(cfg.history_messages + 1) :]
        ]
        req = engine.render_messages(msgs)
    req = await _prepare(engine, req, body, max_tokens, temperature, policy, " (lower top_k or shorten messages)")
    sources = [
        {
            "n": i + 1,
            "id": c.id,
            "doc": c.doc,
            "index": c.index,
            "score": None if s is None else round(s, 4),
            "tokens": c.ref.num_tokens if c.ref is not None and c.ref.key else None,
            "compiled": c.ref is not None and bool(c.ref.key),
            "text": c.text,
        }
        for i, (c, s) in enumerate(picked)
    ]
    return _Plan(req, sources, policy, max_tokens, temperature, retrieval_s)


def _epic(plan: _Plan, gen: Generation | None) -> dict:
    out = {"policy": plan.policy, "retrieval_s": round(plan.retrieval_s, 4), "sources": plan.sources}
    if gen is not None:
        out.update(
            ttft_s=round(gen.ttft_s, 4),
            total_s=round(gen.total_s, 4),
            prompt_tokens=gen.prompt_tokens,
            linked_tokens=gen.linked_tokens,
            recomputed_tokens=gen.recomputed_tokens,
            chunk_hits=gen.chunk_hits,
            chunk_misses=gen.chunk_misses,
        )
    return out


def _usage(gen: Generation) -> dict:
    """OpenAI usage; prompt_tokens_details.cached_tokens: the prompt tokens linked from compiled chunks (or, for
    the `prefix` policy, served by vLLM's prefix cache), i.e. not recomputed."""
    return usage_of(gen)


def _text_logprobs(entries: list[dict] | None, offset: int = 0) -> dict | None:
    """Logprobs in the legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    if entries is None:
        return None
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in entries:
        out["tokens"].append(t["token"])
        out["token_logprobs"].append(t["logprob"])
        out["top_logprobs"].append({a["token"]: a["logprob"] for a in t["top_logprobs"]})
        out["text_offset"].append(offset)
        offset += len(t["token"])
    return out


async def _complete(state: DemoState, engine, body, plan: _Plan, request: Request):
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
            raise HTTPException(500, _failure_message(plan.id)) from None
    finally:
        if not task.done():
            task.cancel()
        m.inflight.dec()
        state.active_chats -= 1
    m.observe_generation(gen, stream=False)
    finish = gen.finish_reason or "stop"
    if plan.text:
        choice = {"index": 0, "text": gen.text, "logprobs": _text_logprobs(gen.logprobs), "finish_reason": finish}
    else:
        message = {"role": "assistant", "content": gen.text}
        choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": openai_logprobs(gen)}
    return {
        "id": plan.id,
        "object": "text_completion" if plan.text else "chat.completion",
        "created": plan.created,
        "model": state.cfg.served_model,
        "choices": [choice],
        "usage": _usage(gen),
        "epic": _epic(plan, gen),
    }


async def _stream(state: DemoState, engine, body, plan: _Plan):
    m = state.metrics
    model = state.cfg.served_model
    kind = "text_completion" if plan.text else "chat.completion.chunk"
    offset = 0  # characters streamed so far (legacy logprobs' text_offset)

    def chunk(delta: dict, finish: str | None = None, logprobs: list[dict] | None = None, **extra) -> str:
        if plan.text:
            choice = {
                "index": 0,
                "text": delta.get("content", ""),
                "logprobs": _text_logprobs(logprobs, offset),
                "finish_reason": finish,
            }
        else:
            lps = None if logprobs is None else {"content": [openai_token_logprob(t) for t in logprobs]}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lps}
        return _sse(
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
            yield chunk({"role": "assistant", "content": ""}, epic=_epic(plan, None))
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
            yield _sse(
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
            yield _sse(
                {
                    "error": {  # a ValueError is the client's (what was wrong); anything else stays in the log
                        "message": str(e) if isinstance(e, ValueError) else _failure_message(plan.id),
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
            yield _sse(
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
        m.observe_generation(gen, stream=True)
        yield chunk({}, gen.finish_reason or "stop", epic=_epic(plan, gen))
        if body.stream_options is not None and body.stream_options.include_usage:
            yield _sse(
                {
                    "id": plan.id,
                    "object": kind,
                    "created": plan.created,
                    "model": model,
                    "choices": [],
                    "usage": _usage(gen),
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


# ---------------------------------------------------------------------- serving in a thread
class BackgroundServer:
    """uvicorn in a daemon thread on an already bound socket (port 0 picks a free port)."""

    def __init__(
        self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning", access_log: bool = False
    ) -> None:
        import uvicorn

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=access_log, timeout_graceful_shutdown=5)
        )
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="epic-demo-http", daemon=True
        )

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        end = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > end:
                raise RuntimeError("the demo server did not start")
            time.sleep(0.05)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()
