"""Memory tier: an LRU dict of ChunkKV under a byte budget (optionally int8-packed)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

import torch

from . import codec
from .base import ChunkKV, ChunkStore, check_key, check_quant

log = logging.getLogger(__name__)


class MemoryStore(ChunkStore):
    """Process-private LRU. With quant="int8" entries are held packed and dequantized on every get.
    With pin (default: where a CUDA device exists) exact entries are held in page-locked memory, copied
    there once when they enter the tier, so every link copies them to the GPU asynchronously and at full
    speed (a pageable copy is ~3x slower and stalls the host)."""

    name = "memory"

    def __init__(self, max_bytes: int = 4 << 30, quant: str = "none", pin: bool | None = None) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError("memory store budget must be positive")
        check_quant(quant)
        self.max_bytes = max_bytes
        self.quant = quant
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        # key -> ChunkKV (exact) or (header, packed tensors) (int8); sizes in _sizes
        self._items: OrderedDict[str, ChunkKV | tuple[dict, dict[str, torch.Tensor]]] = OrderedDict()
        self._sizes: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"MemoryStore(max_bytes={self.max_bytes}, quant={self.quant!r}, pin={self.pin})"

    def _hold(self, kv: ChunkKV) -> ChunkKV:
        """The entry as this tier keeps it (page-locked where asked)."""
        if not self.pin or kv.k.device.type != "cpu" or (kv.k.is_pinned() and kv.v.is_pinned()):
            return kv
        k, v = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t) for t in (kv.k, kv.v))
        return dataclasses.replace(kv, k=k, v=v)

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        t0 = time.perf_counter()
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
        if isinstance(item, tuple):
            kv = codec.unpack(item[0], item[1], key, self.quant)
        else:
            kv = item
        with self._lock:
            self.stats.record_load(t0)
        return kv

    def put(self, kv: ChunkKV) -> None:
        check_key(kv.key)
        t0 = time.perf_counter()
        if self.quant == "none":
            item = self._hold(kv)
            size = item.nbytes
        else:
            try:
                meta, tensors = codec.pack(kv, self.quant)
            except ValueError as e:
                with self._lock:
                    self.stats.errors += 1
                log.error("memory tier: not storing chunk %s: %s", kv.key, e)
                return
            item, size = (meta, tensors), codec.packed_nbytes(tensors)
        if size > self.max_bytes:
            return  # larger than the whole budget: lower tiers keep it
        with self._lock:
            old = self._items.pop(kv.key, None)
            if old is not None:
                self.stats.bytes -= self._sizes.pop(kv.key)
            self._items[kv.key] = item
            self._sizes[kv.key] = size
            self.stats.bytes += size
            self.stats.puts += 1
            while self.stats.bytes > self.max_bytes:
                evicted, _ = self._items.popitem(last=False)
                self.stats.bytes -= self._sizes.pop(evicted)
                self.stats.evictions += 1
            self.stats.entries = len(self._items)
            self.stats.put_seconds += time.perf_counter() - t0

    def delete(self, key: str) -> bool:
        with self._lock:
            if self._items.pop(key, None) is None:
                return False
            self.stats.bytes -= self._sizes.pop(key)
            self.stats.entries = len(self._items)
            return True

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._items)

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._items

    def usage(self) -> dict[str, int]:
        with self._lock:
            return dict(self._sizes)

    def clear(self) -> int:
        with self._lock:
            n = len(self._items)
            self._items.clear()
            self._sizes.clear()
            self.stats.bytes = self.stats.entries = 0
            return n


class DeviceStore(MemoryStore):
    """GPU tier: hot records resident in device memory, LRU under a byte budget (taken out of the share of
    the GPU's memory vLLM is given, see link_memory.gpu_memory_share), so a hot chunk links with no host-to-device
    copy at all. Process-private, exact only; the top tier of a stack (hits below are promoted into it)."""

    name = "gpu"

    def __init__(self, max_bytes: int, device: str | torch.device = "cuda") -> None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("the gpu tier needs a CUDA device (none is available here)")
        super().__init__(max_bytes=max_bytes, pin=False)
        self.device = device

    def __repr__(self) -> str:
        return f"DeviceStore(max_bytes={self.max_bytes}, device={str(self.device)!r})"

    def _hold(self, kv: ChunkKV) -> ChunkKV:
        if kv.k.device == self.device and kv.v.device == self.device:
            return kv
        k, v = (t.to(self.device, non_blocking=t.is_pinned()) for t in (kv.k, kv.v))
        return dataclasses.replace(kv, k=k, v=v)

    def put(self, kv: ChunkKV) -> None:
        if kv.quant != "none":
            return  # exact records only: lossy ones stay in the tiers that made them
        if kv.nbytes <= self.max_bytes:  # larger than the whole budget: never copied over
            super().put(kv)
