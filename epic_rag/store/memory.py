"""Memory tier: an LRU dict of ChunkKV under a byte budget (optionally int8-packed); the gpu tier, the same on a
device."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict

import torch

from ..streams import Streams, streams_for
from . import codec
from .base import ChunkKV, ChunkStore, RecordHead, TenantQuota, check_key, check_quant, evict_order
from .metrics import QUOTA_EVICTIONS, QUOTA_REFUSALS

log = logging.getLogger(__name__)


class MemoryStore(ChunkStore):
    """Process-private LRU. With quant="int8" entries are held packed and dequantized on every get.
    With pin (default: where a CUDA device exists) exact entries are held in page-locked memory, copied
    there once when they enter the tier, so every link copies them to the GPU asynchronously and at full
    speed (a pageable copy is ~3x slower and stalls the host). Page-locked entries count the blocks torch's
    host allocator reserves for them (host_block_bytes: a power of two each), so the budget bounds the
    memory pinned, not half of it.

    Tenants (ChunkKV.tenant): a write that takes its tenant over `quota` evicts that tenant's own least recently
    used entries; one over the whole budget evicts the least recently used entry of the tenant holding the
    most, so a tenant filling the tier evicts itself once it is the largest, never a smaller tenant's."""

    name = "memory"

    def __init__(
        self, max_bytes: int = 4 << 30, quant: str = "none", pin: bool | None = None, quota: TenantQuota | None = None
    ) -> None:
        super().__init__()
        if max_bytes <= 0:
            raise ValueError("memory store budget must be positive")
        check_quant(quant)
        self.max_bytes = max_bytes
        self.quant = quant
        self.quota = quota or TenantQuota()
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        # key -> ChunkKV (exact) or (header, packed tensors) (int8); sizes in _sizes
        self._items: OrderedDict[str, ChunkKV | tuple[dict, dict[str, torch.Tensor]]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._tenant: dict[str, str] = {}  # key -> its record's tenant id
        self._held: dict[str, OrderedDict[str, None]] = {}  # tenant -> its keys, least recently used first
        self._held_bytes: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"MemoryStore(max_bytes={self.max_bytes}, quant={self.quant!r}, pin={self.pin})"

    def _hold(self, kv: ChunkKV) -> ChunkKV:
        """The entry as this tier keeps it (page-locked where asked)."""
        if not self.pin or kv.k.device.type != "cpu" or (kv.k.is_pinned() and kv.v.is_pinned()):
            return kv
        return dataclasses.replace(kv, k=_pinned_copy(kv.k), v=_pinned_copy(kv.v))

    def _size(self, kv: ChunkKV) -> int:
        """Bytes an exact entry takes from the budget: the host allocator's blocks where it is page-locked."""
        if self.pin and kv.k.device.type == "cpu":
            return host_block_bytes(kv.k.nbytes) + host_block_bytes(kv.v.nbytes)
        return kv.nbytes

    def get(self, key: str) -> ChunkKV | None:
        check_key(key)
        t0 = time.perf_counter()
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._held[self._tenant[key]].move_to_end(key)
        if isinstance(item, tuple):
            try:
                kv = codec.unpack(item[0], item[1], key, self.quant)
            except Exception as e:  # (packed here, so never expected): dropped, a miss, as in every tier
                log.error("memory tier: entry %s does not unpack (%s); dropped", key, e)
                with self._lock:
                    if self._items.get(key) is item:
                        self._forget(key)
                    self.stats.corrupt += 1
                    self.stats.misses += 1
                return None
        else:
            kv = item
        with self._lock:
            self.stats.record_load(t0)
        return kv

    def peek(self, key: str) -> RecordHead | None:
        check_key(key)
        with self._lock:
            item = self._items.get(key)
        if isinstance(item, tuple):
            meta, tensors = item
            return RecordHead(key, tensors["token_ids"].tolist(), meta["tenant"], meta["lead"], meta["base_pos"])
        return None if item is None else RecordHead.of(item)

    def put(self, kv: ChunkKV) -> None:
        self._put(kv)

    def promote(self, kv: ChunkKV) -> ChunkKV:
        held = self._put(kv)
        return held if held is not None else kv

    def _put(self, kv: ChunkKV) -> ChunkKV | None:
        """Store an entry; the record held (None: packed, or not kept)."""
        check_key(kv.key)
        t0 = time.perf_counter()
        if self.quant == "none":
            item = self._hold(kv)
            size = self._size(item)
        else:
            try:
                meta, tensors = codec.pack(kv, self.quant)
            except ValueError as e:
                with self._lock:
                    self.stats.errors += 1
                log.error("memory tier: not storing chunk %s: %s", kv.key, e)
                return None
            item, size = (meta, tensors), codec.packed_nbytes(tensors)
        if size > self.max_bytes:
            return None  # larger than the whole budget: lower tiers keep it
        if not self.quota.fits(size):
            self._refused(kv.key, size)
            return None
        tenant = kv.tenant
        with self._lock:
            if kv.key in self._items:
                self._forget(kv.key)
            self._items[kv.key] = item
            self._sizes[kv.key] = size
            self._tenant[kv.key] = tenant
            self._held.setdefault(tenant, OrderedDict())[kv.key] = None
            self._held_bytes[tenant] = self._held_bytes.get(tenant, 0) + size
            self.stats.bytes += size
            self.stats.entries = len(self._items)
            self.stats.puts += 1
            own = self._held[tenant]
            while self.quota.over(self._held_bytes[tenant], len(own)):  # its own oldest (never this one: it fits)
                self._forget(next(iter(own)))
                self.stats.evictions += 1
                self.stats.quota_evictions += 1
                QUOTA_EVICTIONS.labels(self.name).inc()
            if self.stats.bytes > self.max_bytes:
                held = {t: [(k, self._sizes[k]) for k in keys] for t, keys in self._held.items()}
                for k in evict_order(held, self.max_bytes, keep=kv.key):
                    self._forget(k)
                    self.stats.evictions += 1
            self.stats.put_seconds += time.perf_counter() - t0
        return item if isinstance(item, ChunkKV) else None

    def _forget(self, key: str) -> None:
        """Remove a held entry (under the lock)."""
        del self._items[key]
        size = self._sizes.pop(key)
        self.stats.bytes -= size
        self.stats.entries = len(self._items)
        tenant = self._tenant.pop(key)
        del self._held[tenant][key]
        self._held_bytes[tenant] -= size
        if not self._held[tenant]:
            del self._held[tenant], self._held_bytes[tenant]

    def _refused(self, key: str, size: int) -> None:
        with self._lock:
            self.stats.quota_refusals += 1
        QUOTA_REFUSALS.labels(self.name).inc()
        self._log_error(
            "quota",
            "%s tier: chunk %s (%d bytes) is over its tenant's whole quota here; not stored",
            self.name,
            key,
            size,
        )

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """tenant id -> (bytes, entries) held."""
        with self._lock:
            return {t: (self._held_bytes[t], len(keys)) for t, keys in self._held.items()}

    def delete(self, key: str) -> bool:
        with self._lock:
            if key not in self._items:
                return False
            self._forget(key)
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
            self._tenant.clear()
            self._held.clear()
            self._held_bytes.clear()
            self.stats.bytes = self.stats.entries = 0
            return n


class DeviceStore(MemoryStore):
    """GPU tier: hot records resident in device memory, LRU under a byte budget (taken out of the share of
    the GPU's memory vLLM is given, see link/memory.gpu_memory_share), so a hot chunk links with no
    host-to-device copy at all. Process-private, exact only; the top tier of a stack (hits below are promoted
    into it, and the link gets this tier's copy). A promotion copies on a side stream: the compute stream (the
    link's kernels) waits for it on the device, the host never does."""

    name = "gpu"

    def __init__(self, max_bytes: int, device: str | torch.device = "cuda", streams: Streams | None = None) -> None:
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("the gpu tier needs a CUDA device (none is available here)")
        super().__init__(max_bytes=max_bytes, pin=False)
        self.device = device
        self.streams = streams if streams is not None else streams_for(device)
        self._side = None  # the copy stream, made at the first promotion

    def __repr__(self) -> str:
        return f"DeviceStore(max_bytes={self.max_bytes}, device={str(self.device)!r})"

    def _hold(self, kv: ChunkKV) -> ChunkKV:
        if kv.k.device == self.device and kv.v.device == self.device:
            return kv
        st = self.streams
        if st is None:
            k, v = (t.to(self.device) for t in (kv.k, kv.v))
            return dataclasses.replace(kv, k=k, v=v)
        compute = st.current()
        if self._side is None:
            self._side = st.stream()
        with st.on(self._side):  # allocated from, and copied on, the side stream: work queued on compute runs on
            k, v = (torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in (kv.k, kv.v))
            st.copy(k, kv.k)
            st.copy(v, kv.v)
            landed = st.event()
            landed.record(self._side)
        compute.wait_event(landed)  # what the compute stream runs next (the link's fill) sees the whole record
        for t in (k, v):  # its memory goes back to the side stream's pool only after the compute stream's uses
            st.keep(t, compute)
        return dataclasses.replace(kv, k=k, v=v)

    def _size(self, kv: ChunkKV) -> int:
        return kv.nbytes

    def _put(self, kv: ChunkKV) -> ChunkKV | None:
        if kv.quant != "none":
            return None  # exact records only: lossy ones stay in the tiers that made them
        if kv.nbytes > self.max_bytes:  # larger than the whole budget: never copied over
            return None
        return super()._put(kv)


def host_block_bytes(nbytes: int) -> int:
    """Bytes torch's page-locked host allocator reserves for a tensor of `nbytes` (CachingHostAllocator: every
    block rounded up to a power of two, kept cached for blocks of that size once freed)."""
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
