"""The CUDA stream and event calls of epic_rag's asynchronous copies (the link's staging ring, the gpu tier's
promotions, the compile captures), behind one small interface: CudaStreams on a GPU; CPU tests replay the
same calls with fakes (testing/fake_streams.py) in the orders a GPU may run them.

The contract is CUDA's: work issued on a stream runs in issue order; `stream.wait_event(e)` makes the work
issued on `stream` after it wait for the work issued before `e.record(...)` on e's stream (a no-op for an
event never recorded); nothing here blocks the host except `event.synchronize()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch


class Streams(Protocol):
    """Side streams, events and asynchronous copies on one device."""

    def stream(self):
        """A new side stream."""

    def event(self):
        """A new event (`record(stream)`, `query()`, `synchronize()`)."""

    def current(self):
        """The stream work is issued on now (the compute stream, outside `on`)."""

    def on(self, stream) -> contextlib.AbstractContextManager:
        """Within: work (copies, kernels) is issued on `stream`."""

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst <- src on the current stream, not waiting for it on the host (page-locked host memory)."""

    def keep(self, t: torch.Tensor, stream) -> None:
        """The caching allocator reuses t's memory only once the work `stream` has queued on it is done."""


class CudaStreams:
    """Streams on a CUDA device (torch.cuda)."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def stream(self):
        return torch.cuda.Stream(self.device)

    def event(self):
        return torch.cuda.Event()

    def current(self):
        return torch.cuda.current_stream(self.device)

    @contextlib.contextmanager
    def on(self, stream) -> Iterator[None]:
        with torch.cuda.stream(stream):
            yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src, non_blocking=True)

    def keep(self, t: torch.Tensor, stream) -> None:
        t.record_stream(stream)


def streams_for(device: torch.device | str) -> CudaStreams | None:
    """The device's streams, or None where work runs in issue order on the host (a CPU)."""
    device = torch.device(device)
    return CudaStreams(device) if device.type == "cuda" else None
