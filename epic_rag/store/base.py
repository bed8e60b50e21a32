"""The chunk KV store contract: what a tier must do, and the KV record it holds."""

from __future__ import annotations

import logging
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

# Keys are content hashes made by the engine ("plain-<hex>", "lead<hash>-<hex>"). Tiers use them as file
# names and Redis keys, so they are restricted to a safe alphabet ('@' is reserved for tier namespaces).
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
QUANTS = ("none", "int8")
# A process waiting for another's compile polls the store this often (growing from MIN to MAX).
POLL_MIN_S, POLL_MAX_S = 0.01, 0.2

log = logging.getLogger(__name__)


def check_quant(quant: str) -> str:
    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, got {quant!r}")
    return quant


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise ValueError(
            f"invalid chunk key {key!r}: expected 1-200 characters of [A-Za-z0-9._-], starting with a letter or digit"
        )
    return key


@dataclass(slots=True)
class ChunkKV:
    """Compiled KV of one chunk, for every layer.

    Keys are post-RoPE at positions base_pos .. base_pos+T-1 (as the engine computed them), so
    linking at real position p rotates them by p - base_pos. `quant` says whether the values went
    through a lossy tier ("int8"): shared exact tiers never store such an entry. `lead` and `tenant` are
    the ids (keys.lead_id, keys.tenant_id) of the compile lead the KV was computed behind and of the tenant
    namespace the record belongs to: its key commits to both (keys.record_key), so a reader refuses a record
    computed in another context or filed for another tenant. Empty: none (a test's or an old record).
    """

    key: str
    token_ids: list[int]
    k: torch.Tensor  # k: [L, T, Hkv, D]
    v: torch.Tensor  # v: [L, T, Hkv, D]
    base_pos: int = 0
    quant: str = "none"
    lead: str = ""
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"k/v must both be [L, T, Hkv, D], got {tuple(self.k.shape)} / {tuple(self.v.shape)}")
        if self.k.shape[1] != len(self.token_ids):
            raise ValueError(f"KV holds {self.k.shape[1]} tokens but token_ids has {len(self.token_ids)}")
        if self.k.dtype != self.v.dtype:
            raise ValueError("k and v must share a dtype")
        check_quant(self.quant)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def slice(self, start: int, stop: int | None = None) -> "ChunkKV":
        """Tokens [start, stop) as views; keys keep their compile positions, so base_pos moves with start."""
        stop = self.num_tokens if stop is None else min(stop, self.num_tokens)
        if start == 0 and stop == self.num_tokens:
            return self
        return ChunkKV(
            self.key,
            self.token_ids[start:stop],
            self.k[:, start:stop],
            self.v[:, start:stop],
            self.base_pos + start,
            self.quant,
            self.lead,
            self.tenant,
        )


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """What one tenant may hold in one tier (spec options tenant_max_bytes, tenant_max_entries; None: no
    bound). A tenant's write that takes it over its quota evicts that tenant's own least recently used entries,
    never another's; an entry larger than the whole quota is not stored in that tier."""

    max_bytes: int | None = None
    max_entries: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_entries"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ValueError(f"tenant_{name} must be a whole number >= 1, got {n!r}")

    @property
    def active(self) -> bool:
        return self.max_bytes is not None or self.max_entries is not None

    def fits(self, size: int) -> bool:
        """Whether one entry of `size` bytes may be held at all."""
        return self.max_bytes is None or size <= self.max_bytes

    def over(self, nbytes: int, entries: int) -> bool:
        return (self.max_bytes is not None and nbytes > self.max_bytes) or (
            self.max_entries is not None and entries > self.max_entries
        )


def evict_order(held: dict[str, list[tuple[str, int]]], limit: float, keep: str) -> list[str]:
    """The entries to evict, in order, from `held` (tenant -> [(name, size)], least recently used first) until
    they total at most `limit` bytes: always the oldest entry of the tenant holding the most bytes (so a tenant
    filling a tier evicts itself once it is the largest, never a smaller tenant's), never `keep` (the entry
    just written)."""
    queues = {t: [e for e in es if e[0] != keep] for t, es in held.items()}
    sizes = {t: sum(n for _, n in es) for t, es in held.items()}
    total = sum(sizes.values())
    out = []
    while total > limit:
        t = max((t for t in queues if queues[t]), key=lambda t: sizes[t], default=None)
        if t is None:
            break
        name, n = queues[t].pop(0)
        sizes[t] -= n
        total -= n
        out.append(name)
    return out


@dataclass(frozen=True, slots=True)
class RecordHead:
    """What a reader learns of a stored record without its tensors (`ChunkStore.peek`): enough to refuse a
    record that cannot serve a span (another tenant's, other tokens) before reading and decoding its KV. Not
    verified (the checksum covers the whole entry): only ever a reason to skip a record, never to use one."""

    key: str
    token_ids: list[int]
    tenant: str = ""
    lead: str = ""
    base_pos: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def of(cls, kv: ChunkKV) -> "RecordHead":
        return cls(kv.key, kv.token_ids, kv.tenant, kv.lead, kv.base_pos)


@dataclass(slots=True)
class TierStats:
    """Counters one tier keeps; read by the CLI and the server's metrics (`ChunkStore.tier_stats`).

    hits/misses/puts/evictions/corrupt/errors count events in this process. bytes/entries are exact
    for the memory tier; for shared tiers (disk, Redis) they are as of the last scan (`refresh()`).
    load_seconds sums the time of successful loads (read + verify + decode); mean = load_seconds / hits.
    fleet_waits counts compiles this process did not do because another process sharing the tier held the
    chunk's compile lock and published the entry (`ChunkStore.compile_lock`); fleet_takeovers counts waits
    that ended with this process compiling after all (the holder died or gave up without publishing, or
    the wait ran out). Only a tier that provides the lock (Redis) counts them.
    """

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes: int = 0
    entries: int = 0
    load_seconds: float = 0.0
    load_seconds_max: float = 0.0
    put_seconds: float = 0.0
    fleet_waits: int = 0
    fleet_takeovers: int = 0
    quota_evictions: int = 0  # evicted because their tenant went over its quota here (also in `evictions`)
    quota_refusals: int = 0  # not stored: one entry over its tenant's whole quota
    available: int = 1  # 0 while a remote tier is unreachable

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def record_load(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.hits += 1
        self.load_seconds += dt
        self.load_seconds_max = max(self.load_seconds_max, dt)


class ChunkStore(ABC):
    """One tier (or a stack of tiers) mapping chunk keys to ChunkKV.

    `get` never mutates stored data (a tier may update its LRU order, and drops an entry it finds
    corrupt); `put` overwrites an entry with the same key, which is safe because keys are
    content-derived. Implementations are thread-safe, and never raise on I/O trouble in get/put:
    a tier that cannot read answers None, a tier that cannot write logs and skips.
    """

    name: str = "store"
    secret: bytes | None = None  # a shared tier's HMAC key (codec.deployment_secret); never logged

    def __init__(self) -> None:
        self.stats = TierStats()
        self._lock = threading.RLock()
        self._last_log: dict[str, float] = {}

    def _log_error(self, kind: str, msg: str, *args) -> None:
        """Log an error at most once a minute per kind (a full disk or a read-only replica must not flood
        the log); repeats go to DEBUG. Logged under the tier's own module."""
        now = time.monotonic()
        with self._lock:
            last = self._last_log.get(kind)
            loud = last is None or now - last > 60.0
            if loud:
                self._last_log[kind] = now
        logging.getLogger(type(self).__module__).log(logging.ERROR if loud else logging.DEBUG, msg, *args)

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None:
        """The entry, or None when missing or unreadable (a corrupt entry is dropped and counted)."""

    def peek(self, key: str) -> RecordHead | None:
        """The entry's tokens and context ids without its KV, where a tier can read them cheaply (a file's or a
        value's header and token ids); None when missing or unreadable. Counts nothing, drops nothing, moves
        no LRU order: a caller that wants the entry then calls `get`, which checks it whole. This default
        reads the whole entry."""
        kv = self.get(key)
        return None if kv is None else RecordHead.of(kv)

    @abstractmethod
    def put(self, kv: ChunkKV) -> None:
        """Store an entry (write-through in stacks)."""

    def promote(self, kv: ChunkKV) -> ChunkKV:
        """Take a hit from a tier below (TieredStore.get): stored like a put; returns the record as this tier
        holds it where that is another copy (page-locked, on the GPU), so the caller links from the fastest
        copy, else `kv`."""
        self.put(kv)
        return kv

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove an entry; True when one was removed."""

    @abstractmethod
    def keys(self) -> list[str]:
        """All keys held (for `store ls`)."""

    def contains(self, key: str) -> bool:
        return key in set(self.keys())

    def verify(self, key: str) -> bool:
        """Check one entry's integrity (dropping it when corrupt); True when present and sound."""
        return self.get(key) is not None

    def usage(self) -> dict[str, int]:
        """Stored size in bytes of every entry (for `store ls`)."""
        return {k: 0 for k in self.keys()}

    def refresh(self) -> None:
        """Recount entries/bytes of shared tiers (a scan); cheap tiers need nothing."""

    def clear(self) -> int:
        n = 0
        for key in self.keys():
            n += self.delete(key)
        return n

    def tier_stats(self) -> dict[str, dict[str, float]]:
        return {self.name: self.stats.as_dict()}

    def compile_lock(self, key: str) -> "CompileLock":
        """The right to compile chunk `key` once among every process sharing this store (see CompileLock).

        Backed by the first tier that is shared between processes and can lock (Redis); for a store without
        one (memory, disk) it is always granted at once and waits for nothing. Looks for a published entry
        through this store (`contains`, then `get`)."""
        check_key(key)
        return CompileLock(key, self.fleet_lock(key), lambda: self.contains(key), lambda: self.get(key))

    def fleet_lock(self, key: str) -> "FleetLock | None":
        """This tier's lock on compiling `key` across processes, or None when it has none (the default)."""
        return None

    def close(self) -> None:
        """Release connections/files."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FleetLock(ABC):
    """A shared tier's lock on compiling one chunk: held by one process at a time, for at most `ttl` seconds
    (so a holder that dies frees it), and released only by its holder."""

    ttl: float
    tier: ChunkStore  # whose stats count the waits

    @abstractmethod
    def try_acquire(self) -> bool | None:
        """Take it without waiting: True when taken here, False when another process holds it, None when the
        tier cannot say (unreachable): the caller then goes ahead as if it held it."""

    @abstractmethod
    def release(self) -> None:
        """Give it back if this process still holds it (never someone else's after it expired)."""


class CompileLock:
    """The right to compile one chunk among every process sharing a store (`ChunkStore.compile_lock`).

    The protocol the engine follows (chunks.py), after a store miss::

        lock = store.compile_lock(key)
        if lock.acquire():      # never blocks; always True for a process-private store
            compile; store.put(kv); lock.release()
        else:
            kv = lock.wait()    # the entry another process published, or None: compile here after all
            if kv is None:
                compile; store.put(kv)
            lock.release()

    or, for one chunk, ``with store.compile_lock(key) as lock:`` (entering acquires, else waits) and compile
    only when `lock.found` is None. `acquire` also looks once more for the entry after taking the lock: a
    process that missed just before another published must not compile it again.

    `wait` polls the store for the entry and the lock for its release, and is bounded by the lock's ttl (plus
    a second): when the holder dies its lock expires and the waiter takes it; when the holder releases it
    without publishing (its compile or its write failed), the waiter takes it; when the bound runs out (the
    lock was taken again by a third process), the waiter compiles without it. A compile that outlasts the
    ttl loses its exclusivity and may be done twice: harmless (entries are content-addressed), just work.
    """

    def __init__(
        self,
        key: str,
        backend: FleetLock | None,
        exists: Callable[[], bool],
        load: Callable[[], ChunkKV | None],
    ) -> None:
        self.key, self._backend, self._exists, self._load = key, backend, exists, load
        self.held = False  # this process holds the shared lock (release it)
        self.found: ChunkKV | None = None  # the entry another process published while this one waited

    def __repr__(self) -> str:
        return f"CompileLock({self.key!r}, shared={self.shared}, held={self.held})"

    @property
    def shared(self) -> bool:
        return self._backend is not None

    def _count(self, name: str) -> None:
        tier = self._backend.tier  # type: ignore[union-attr]
        with tier._lock:
            setattr(tier.stats, name, getattr(tier.stats, name) + 1)

    def _published(self) -> bool:
        """True when another process's entry is in the store: it is kept in `found`, the lock (if taken
        here) given back and the avoided compile counted."""
        if not self._exists():
            return False
        kv = self._load()
        if kv is None:  # gone again, or unreadable (dropped): compile
            return False
        self.found = kv
        self.release()
        self._count("fleet_waits")
        return True

    def acquire(self) -> bool:
        """Take the lock without waiting: True when this process should compile the chunk now; False when
        another process holds it or just published the entry (then call `wait`)."""
        if self._backend is None:
            return True
        got = self._backend.try_acquire()
        if got is None:
            return True
        if not got:
            return False
        self.held = True
        return not self._published()

    def wait(self, timeout: float | None = None) -> ChunkKV | None:
        """Wait while another process compiles: its entry once published (also in `found`), or None when
        this process should compile after all (it now holds the lock, or the lock is unreachable, or
        `timeout`, default the lock's ttl + 1 s, ran out). Never raises for the store's trouble."""
        if self.found is not None or self._backend is None:
            return self.found
        limit = self._backend.ttl + 1.0 if timeout is None else timeout
        deadline = time.monotonic() + limit
        delay = POLL_MIN_S
        while True:
            if self._published():
                return self.found
            got = self._backend.try_acquire()
            if got is None or got:
                self.held = bool(got)
                if self._published():
                    return self.found
                self._count("fleet_takeovers")
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning(
                    "chunk %s: another process has held its compile lock for over %.0f s; compiling it here too",
                    self.key,
                    limit,
                )
                self._count("fleet_takeovers")
                return None
            time.sleep(min(delay, left))
            delay = min(delay * 1.5, POLL_MAX_S)

    def release(self) -> None:
        if self.held:
            self.held = False
            self._backend.release()  # type: ignore[union-attr]

    def __enter__(self) -> "CompileLock":
        if not self.acquire():
            self.wait()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
