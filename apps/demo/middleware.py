"""ASGI middleware: request body limits (413 before a route reads past them), upload admission, and the
request counters by route."""

from __future__ import annotations

from fastapi import HTTPException

from .errors import error_response, internal_error
from .state import DemoState

# The method label of the request counter: any other method a client invents counts as "other" (no new series).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


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
            resp = error_response(429, "too many uploads in progress; retry shortly", headers={"Retry-After": "2"})
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
                resp = error_response(
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
                await internal_error(scope["path"])(scope, receive, send_wrapper)
        finally:
            state.uploads -= upload
            route = scope.get("route")
            label = getattr(route, "path", None) or ("/static" if scope["path"].startswith("/static/") else "other")
            method = scope.get("method", "")
            m = self.state.metrics
            m.requests.labels(label, method if method in HTTP_METHODS else "other", str(status["code"])).inc()
            if status["code"] >= 400:
                m.errors.labels(f"http_{status['code']}").inc()
