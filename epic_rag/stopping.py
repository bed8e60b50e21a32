"""Ctrl-C and SIGTERM as a clean stop for the command-line tools (`epic-rag ask`, `epic-rag demo`).

Python's default SIGTERM ends the process at once, and a KeyboardInterrupt that escapes leaves the engine's
threads running into interpreter exit, where native code still at work aborts the process ("terminate called
without an active exception"). Inside `StopSignals` the first SIGINT or SIGTERM raises KeyboardInterrupt in
the main thread, so the tool's `finally` tears everything down in order; later ones are ignored while it does.
"""

from __future__ import annotations

import signal
import sys

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Installs the handlers on entry (main thread only) and restores the previous ones on exit."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.received is not None:  # already stopping: the teardown must not be cut short
            print("epic-rag: stopping, please wait", file=sys.stderr)
            return
        self.received = signum
        raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        """130 after Ctrl-C (the shell's convention for SIGINT), 0 after SIGTERM (a requested stop, done) or
        none."""
        return 130 if self.received == signal.SIGINT else 0
