"""Every error the demo answers, in OpenAI's error shape; internals stay in the log under a request id."""

from __future__ import annotations

import logging
import uuid

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)


def error_response(status: int, message: str, param: str | None = None, headers=None) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        409: "conflict_error",
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


def internal_error(where: str) -> JSONResponse:
    """A 500 that says nothing about internals: the details go to the log under a request id."""
    rid = f"err-{uuid.uuid4().hex[:16]}"
    log.exception("unhandled error on %s [%s]", where, rid)
    return error_response(500, f"internal error (request id {rid}; details in the server log)")


def failure_message(request_id: str) -> str:
    return f"generation failed (request id {request_id}; details in the server log)"


def refusal_response(status: int, message: str) -> JSONResponse:
    return error_response(status, message, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
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


def install_error_handlers(app: FastAPI) -> None:
    """Validation errors, HTTP errors and anything unhandled, answered in the error shape above."""
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError):
        msg, param = validation_message(exc)
        return error_response(400, msg, param)

    @app.exception_handler(HTTPException)
    async def _on_http(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(StarletteHTTPException)
    async def _on_starlette_http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception):
        return internal_error(request.url.path)
