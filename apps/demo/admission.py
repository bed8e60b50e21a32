"""Admission control for chat and text completions: a bounded number run, a bounded number wait, the rest
are refused (429) before any work is queued."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


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
