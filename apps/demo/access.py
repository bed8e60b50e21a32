"""Who may talk to the demo server: API key, Host (DNS rebinding) and Origin (CSRF) checks.

A pure ASGI middleware, so a refused request is answered from its headers alone: its body is never read
(FastAPI reads a body before any route dependency runs).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable, Iterable

OPEN_PATHS = {"/healthz", "/", "/openapi.json"}  # no work done, nothing private: no key needed
SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}
LOCAL_HOSTS = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    if host.strip("[]") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, insecure_no_key: bool) -> None:
    """ValueError when the server would listen beyond this machine without a key and nobody said so."""
    if not api_key and not is_loopback(host) and not insecure_no_key:
        raise ValueError(
            f"refusing to listen on {host} without an API key: anyone who can reach it could use it. "
            "Set --api-key (or EPIC_RAG_API_KEY), or pass --insecure-no-key to do it anyway."
        )


def _hostname(host_header: str) -> str:
    """'example.com:8000' -> 'example.com', '[::1]:8000' -> '::1' (lower case)."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1 : h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


class AccessGuard:
    """API key (when set) on every path but OPEN_PATHS and /static/; without a key, only requests whose
    Host is the bound address, localhost or an allowed host; state-changing requests only from no Origin
    (non-browser clients), the server's own origin or an allowed origin."""

    def __init__(
        self,
        app,
        api_key: str | None,
        bind_host: str,
        allowed_hosts: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        *,
        respond: Callable[[int, str], Callable],
    ) -> None:
        self.app = app
        self.key = api_key.encode("utf-8") if api_key else None  # clients send header bytes; UTF-8 keys work
        self.hosts = LOCAL_HOSTS | {bind_host.strip("[]").lower()} | {h.lower() for h in allowed_hosts}
        self.origins = {o.rstrip("/").lower() for o in allowed_origins}
        self.respond = respond  # (status, message) -> the ASGI response that refuses

    def _refusal(self, scope) -> tuple[int, str] | None:
        headers = dict(scope.get("headers") or [])
        path, method = scope["path"], scope.get("method", "GET")
        host = headers.get(b"host", b"").decode("latin-1")
        if self.key is None and "*" not in self.hosts and _hostname(host) not in self.hosts:
            return 400, "unknown Host header; start the server with --allowed-hosts to serve this name"
        origin = headers.get(b"origin")
        if method not in SAFE_METHODS:
            if origin is not None:
                o = origin.decode("latin-1").rstrip("/").lower()
                own = {f"http://{host.lower()}", f"https://{host.lower()}"}
                if o not in own and o not in self.origins and "*" not in self.origins:
                    return 403, "cross-site request refused (Origin); allow it with --allowed-origins"
            elif headers.get(b"sec-fetch-site") == b"cross-site":
                return 403, "cross-site request refused"
        if self.key is not None and path not in OPEN_PATHS and not path.startswith("/static/"):
            auth = headers.get(b"authorization", b"")
            got = auth[7:].strip() if auth[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
            if not hmac.compare_digest(got, self.key):
                return 401, "missing or wrong API key (send 'Authorization: Bearer <key>')"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self._refusal(scope)
        if refused is None:
            return await self.app(scope, receive, send)
        await self.respond(*refused)(scope, receive, send)
