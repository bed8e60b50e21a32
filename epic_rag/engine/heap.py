"""Handing freed heap memory back to the OS while the engine serves (glibc's malloc_trim).

On CPU every step allocates and frees tensors whose sizes follow the batch (tokens scheduled, prompt
lengths). glibc keeps what is freed: sizes below its dynamic mmap threshold (which rises to the largest
block freed so far, up to 32 MiB) come from the heap arenas, and a freed block stays in the process unless
it sits at the very top of its arena. Under varied load the arenas fill with free holes between live blocks,
and RSS creeps up by hundreds of MiB with nothing live behind it (measured on the demo's soak: RSS +495 MiB
after warm-up, still rising, memory tier constant; see docs/reliability.md). `malloc_trim(0)` gives every
whole free page of every arena back to the OS (madvise), so RSS follows what is live again; it takes some
milliseconds per hundred MiB free and holds each arena's lock meanwhile.

The engine's stepping thread calls `HeapTrimmer.after_step` after each step (a trim at most every `every_s`
seconds under continuous load) and `on_idle` when nothing is left to step (one trim after a burst of work,
at most once a second). Elsewhere than glibc (musl, macOS) there is no malloc_trim and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TRIM_EVERY_S = 10.0  # under continuous load: one trim per this many seconds (~0.1-0.5 % of the time)
IDLE_GAP_S = 1.0  # an idle engine trims after work, but not more often than this


def malloc_trim() -> Callable[[], object] | None:
    """glibc's malloc_trim(0) as a callable, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        fn = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: fn(0)


class HeapTrimmer:
    """Decides when the stepping thread trims: `every_s` seconds apart under load, once after work when idle.
    `every_s` 0 turns trimming off. `trim` and `clock` are replaceable (tests)."""

    def __init__(
        self,
        every_s: float = TRIM_EVERY_S,
        trim: Callable[[], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
        idle_gap_s: float = IDLE_GAP_S,
    ) -> None:
        if every_s < 0:
            raise ValueError(f"heap trim interval must be >= 0 seconds, got {every_s!r}")
        self.every_s, self.idle_gap_s, self.clock = every_s, idle_gap_s, clock
        self._trim = (trim if trim is not None else malloc_trim()) if every_s > 0 else None
        self._last = clock()
        self._dirty = False  # steps ran since the last trim
        self.trims = 0
        self.seconds = 0.0  # spent trimming, in total

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def after_step(self) -> None:
        self._dirty = True
        if self._trim is not None and self.clock() - self._last >= self.every_s:
            self._run()

    def on_idle(self) -> None:
        if self._trim is not None and self._dirty and self.clock() - self._last >= self.idle_gap_s:
            self._run()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._trim()
        except Exception:  # never let housekeeping fail the engine thread
            log.warning("malloc_trim failed; heap trimming turned off", exc_info=True)
            self._trim = None
            return
        finally:
            self._last, self._dirty = self.clock(), False
        self.trims += 1
        self.seconds += time.perf_counter() - t0
