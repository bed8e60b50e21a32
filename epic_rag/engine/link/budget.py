"""How much of a busy step an asynchronous link may take: a share of that step's forward, on the clock of the
device that runs them.

The connector calls `bound()` when a step's metadata is bound (before its forward) and `start()` after the
forward was issued; the linker asks `more()` after each layer it ran ("may another run in this step?") and
the connector calls `end()` when it stops. A step with nothing scheduled (idle) links to the end.

- HostBudget (CPU): the forward ran on the host between bind and start, so the host clock measures it; the
  link may run until share x that time has passed again.
- DeviceBudget (GPU): the host only queues the forward, so host time says nothing; CUDA events recorded on
  the stream around the forward and around each step's link work are polled (`query()`) in later steps,
  never waited for, and give the forward's device time and a link layer's device time; a step's link may
  run share x forward / layer layers (at least one; one until the first measurements arrive).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

MAX_PENDING = 8  # measurements waiting for their events (older ones are dropped)
SMOOTH = 0.5  # weight of the newest measurement in the running estimates


class HostBudget:
    """The link budget on the host clock (CPU)."""

    def __init__(self, share: float) -> None:
        self.share = share
        self._bound_at = 0.0
        self._deadline: float | None = None

    def bound(self) -> None:
        self._bound_at = time.perf_counter()

    def start(self, idle: bool) -> None:
        now = time.perf_counter()
        self._deadline = None if idle else now + self.share * max(now - self._bound_at, 0.0)

    def more(self) -> bool:
        return self.has_room()

    def has_room(self) -> bool:
        return self._deadline is None or time.perf_counter() < self._deadline

    def end(self) -> None:
        return


class DeviceBudget:
    """The link budget on the device's clock (GPU), from CUDA events polled in later steps."""

    def __init__(
        self,
        share: float,
        new_event: Callable[[], object] | None = None,
        record: Callable[[object], None] | None = None,
    ) -> None:
        self.share = share
        self._new = new_event or (lambda: torch.cuda.Event(enable_timing=True))
        self._record = record or (lambda e: e.record())  # on the current stream
        self.forward_ms: float | None = None  # running estimates, from completed events
        self.layer_ms: float | None = None
        self._fwd: deque = deque(maxlen=MAX_PENDING)  # (start, end) around forwards
        self._link: deque = deque(maxlen=MAX_PENDING)  # (start, end, layers) around link work
        self._fwd_start = None
        self._cur = None  # (start event, layers run) of this step's link work
        self._allowed: int | None = None

    def bound(self) -> None:
        self._fwd_start = self._mark()

    def start(self, idle: bool) -> None:
        if self._fwd_start is not None and not idle:  # an idle step ran no forward: no sample
            self._fwd.append((self._fwd_start, self._mark()))
        self._fwd_start = None
        self._poll()
        if idle:
            self._allowed = None
        elif self.forward_ms is None or self.layer_ms is None:
            self._allowed = 1
        else:
            self._allowed = max(1, int(self.share * self.forward_ms / max(self.layer_ms, 1e-6)))
        self._cur = [self._mark(), 0]

    def more(self) -> bool:
        self._cur[1] += 1
        return self.has_room()

    def has_room(self) -> bool:
        return self._allowed is None or self._cur[1] < self._allowed

    def end(self) -> None:
        if self._cur is not None and self._cur[1] > 0:
            self._link.append((self._cur[0], self._mark(), self._cur[1]))
        self._cur = None

    def _mark(self):
        e = self._new()
        self._record(e)
        return e

    def _poll(self) -> None:
        """Fold in every measurement whose events have completed (query(): never waits)."""
        while self._fwd and self._fwd[0][1].query():
            a, b = self._fwd.popleft()
            self.forward_ms = _blend(self.forward_ms, a.elapsed_time(b))
        while self._link and self._link[0][1].query():
            a, b, n = self._link.popleft()
            self.layer_ms = _blend(self.layer_ms, a.elapsed_time(b) / n)


def _blend(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTH) * old + SMOOTH * new


def link_budget(device: torch.device, share: float) -> HostBudget | DeviceBudget:
    """The budget for links whose layers run on `device`."""
    return DeviceBudget(share) if device.type == "cuda" else HostBudget(share)
