"""The demo app served by uvicorn in a daemon thread (the CLI and the tests)."""

from __future__ import annotations

import socket
import threading
import time


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
