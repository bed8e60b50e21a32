"""A throwaway redis-server on 127.0.0.1 for tests and benchmarks: no persistence, its own folder."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    """redis-server --save '' --appendonly no, on a free port; stop()/start() keep the port (restarts)."""

    def __init__(
        self,
        workdir: str | os.PathLike,
        port: int | None = None,
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.binary = binary or shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(self.binary):
            raise FileNotFoundError("redis-server not found (apt-get install redis-server)")
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.extra_args = extra_args or []
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 15.0) -> "LocalRedis":
        if self.proc is not None and self.proc.poll() is None:
            return self
        log = self.workdir / "redis.log"
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--daemonize",
                "no",
                "--logfile",
                str(log),
                *self.extra_args,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()  # like a crash: no shutdown handshake
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "LocalRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
