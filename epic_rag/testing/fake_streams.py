"""CUDA streams and events replayed on a CPU (epic_rag.streams' interface): the calls are logged per stream,
in issue order, as a GPU receives them, and `replay` then runs the logs in an order a GPU may run them: any
interleaving of the streams in which a `wait` runs only after the record it waits for (CUDA's semantics).
Tests check invariants at every step of several orders (the copy stream as far ahead as allowed, the compute
stream as far ahead as allowed, random ones). The copies themselves run at once on the host (CPU tensors),
so the data a test compares is the in-order result; the replay judges the ordering alone.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class FakeEvent:
    """An event. Each record is a new version at a place in one stream's log; a wait waits for the version
    recorded last when the wait was issued (none: no wait), as CUDA's do; `ran` is the last version the
    replay (or a test) has run."""

    api: FakeStreams
    name: str
    recorded: int = 0  # versions issued
    ran: int = 0  # versions run

    def record(self, stream: FakeStream | None = None) -> None:
        self.recorded += 1
        (stream or self.api.current()).log.append(("record", (self, self.recorded)))

    def query(self) -> bool:
        return self.ran >= self.recorded

    def synchronize(self) -> None:
        self.api.host_waits.append(self)

    def __repr__(self) -> str:
        return f"<event {self.name}>"


@dataclass(eq=False)
class FakeStream:
    """A stream's log of work, in issue order: ("copy", tag), ("kernel", tag), ("record", (event, version)),
    ("wait", (event, version))."""

    name: str
    log: list[tuple[str, object]] = field(default_factory=list)

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait", (event, event.recorded)))

    def synchronize(self) -> None:
        raise AssertionError(f"a full synchronisation of stream {self.name} (waits for everything queued on it)")

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeStreams:
    """epic_rag.streams.Streams on fakes. `tag_copy(dst, src)` names each copy in the log (default: the
    destination's address); kernels are logged by tests through `launch(tag)`."""

    def __init__(self, tag_copy: Callable[[torch.Tensor, torch.Tensor], object] | None = None) -> None:
        self.compute = FakeStream("compute")
        self.streams = [self.compute]
        self._stack = [self.compute]
        self.events: list[FakeEvent] = []
        self.host_waits: list[FakeEvent] = []
        self.kept: list[tuple[torch.Tensor, FakeStream]] = []
        self.tag_copy = tag_copy or (lambda dst, src: dst.data_ptr())

    def stream(self) -> FakeStream:
        s = FakeStream(f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    def event(self) -> FakeEvent:
        e = FakeEvent(self, f"e{len(self.events)}")
        self.events.append(e)
        return e

    def current(self) -> FakeStream:
        return self._stack[-1]

    @contextlib.contextmanager
    def on(self, stream: FakeStream) -> Iterator[None]:
        self._stack.append(stream)
        try:
            yield
        finally:
            self._stack.pop()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.current().log.append(("copy", self.tag_copy(dst, src)))

    def keep(self, t: torch.Tensor, stream: FakeStream) -> None:
        self.kept.append((t, stream))

    def launch(self, tag: object) -> None:
        self.current().log.append(("kernel", tag))


def replay(
    api: FakeStreams, pick: Callable[[list[FakeStream]], FakeStream], check: Callable[[str, object], None]
) -> list[tuple[str, str, object]]:
    """Run every stream's log in one order a GPU may: at each step `pick` chooses among the streams whose next
    work may run (a wait whose record has not run yet blocks its stream); `check(kind, tag)` is called as each
    copy or kernel runs. Returns the order run: (stream, kind, tag). Raises if the streams deadlock."""
    pos = {s.name: 0 for s in api.streams}
    for e in api.events:
        e.ran = 0
    order = []
    while True:
        ready = []
        for s in api.streams:
            i = pos[s.name]
            if i < len(s.log):
                kind, x = s.log[i]
                if kind != "wait" or x[0].ran >= x[1]:
                    ready.append(s)
        if not ready:
            left = {s.name: s.log[pos[s.name] :] for s in api.streams if pos[s.name] < len(s.log)}
            assert not left, f"the streams deadlock: {left}"
            return order
        s = pick(ready)
        kind, x = s.log[pos[s.name]]
        pos[s.name] += 1
        if kind == "record":
            x[0].ran = max(x[0].ran, x[1])
        elif kind in ("copy", "kernel"):
            check(kind, x)
        order.append((s.name, kind, x))


def ahead(name_prefix: str) -> Callable[[list[FakeStream]], FakeStream]:
    """An order that runs streams named `name_prefix...` as far ahead as their waits allow."""

    def pick(ready: list[FakeStream]) -> FakeStream:
        first = [s for s in ready if s.name.startswith(name_prefix)]
        return (first or ready)[0]

    return pick


def shuffled(seed: int) -> Callable[[list[FakeStream]], FakeStream]:
    rng = random.Random(seed)
    return lambda ready: rng.choice(ready)
