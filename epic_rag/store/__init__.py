"""Chunk KV store: tiers behind one interface, opened from a spec string."""

import contextlib

from ..redact import redact
from .base import ChunkKV, ChunkStore, CompileLock, FleetLock, RecordHead, TierStats
from .checked import KeyCheckedStore
from .codec import CorruptEntry
from .disk import DiskStore
from .memory import DeviceStore, MemoryStore
from .stack import TieredStore


def open_store(spec: "str | ChunkStore") -> ChunkStore:
    """Open a chunk store from a spec string (or pass a ChunkStore through).

    A spec is one tier or several joined by '+', fastest first. Look-ups go down the tiers and a hit is
    copied into the tiers above it; writes go to every tier. Options follow a tier as a URL query::

        gpu?max_bytes=SIZE[&device=cuda:N]            process-private LRU in GPU memory (first tier only; its
                                                      budget is taken out of vLLM's share of the GPU): a hot
                                                      chunk links with no host-to-device copy
        memory[?max_bytes=SIZE&quant=int8&pin=auto]  process-private LRU (default budget 4GiB); pin=1 keeps
                                                      entries in page-locked memory (auto: where CUDA exists)
        memory:SIZE                                   same, older form of the budget
        disk:FOLDER[?max_bytes=SIZE&quant=int8&fsync=1&secret=S]
                                                      one safetensors file per chunk; LRU by mtime under
                                                      max_bytes (default: unbounded); several processes may
                                                      share FOLDER; fsync=1 syncs each file before its rename
        redis://[user:password@]HOST[:PORT][/DB][?ttl=SECONDS&prefix=P&timeout=SECONDS&retry_s=SECONDS&quant=int8&secret=S
                 &max_part_bytes=SIZE&lock_ttl=SECONDS]
        rediss://...  (TLS)     unix://SOCKET_PATH[?db=N&...]
                                                      shared Redis; keys are PREFIX<chunk key> (default
                                                      prefix "epic:kv:"); ttl sets an expiry on each write;
                                                      timeout bounds every socket operation (default 2 s);
                                                      while the server is unreachable the tier is skipped and
                                                      probed again every retry_s seconds (default 5); an entry
                                                      over max_part_bytes (default 256M, at most 512M: Redis'
                                                      value limit) is stored as parts behind a manifest set
                                                      last, so readers never see half an entry; a chunk is
                                                      compiled by one process of those sharing the Redis at a
                                                      time, the others waiting for its entry (a lock that
                                                      expires after lock_ttl seconds, default 120, if its
                                                      holder dies; 0 turns it off)

    A FOLDER may contain '+' except right before a tier scheme (memory, disk:, redis://, rediss://, unix://)
    and at the end of the spec; it may not contain '?'.
    SIZE is a byte count with an optional binary unit: 1073741824, 512M, 4G, 4GiB.
    quant=int8 stores K and V as int8 with a float32 scale per token and head (about 3.8x smaller than
    fp32, 1.9x smaller than bf16) and dequantizes on read to the model dtype; it is lossy. Its entries
    live under a separate name ("<key>@int8"), so exact and int8 entries never collide, and KV that went
    through an int8 tier is never written into an exact disk or Redis tier.

    Shared tiers (disk, redis) take secret=S, a deployment secret (default: $EPIC_RAG_KV_SECRET): entries
    are then signed with an HMAC, and entries without a valid one (written without the secret, or planted by
    anyone who can write the folder or Redis but lacks the secret) are refused and dropped. Prefer the
    environment variable: a spec string may end up in logs.

    Examples: "memory", "memory?max_bytes=2G+disk:/var/cache/epic-rag?max_bytes=50G",
    "memory+disk:/tmp/kv+redis://127.0.0.1:6379/0?ttl=86400", "redis://cache:6379/1?quant=int8".
    Raises ValueError (with the reason) for a malformed spec. A disk folder that cannot be created or an
    unreachable Redis does not raise: it is logged and that tier misses until it works.
    """
    from .spec import build_tier, parse_spec

    if isinstance(spec, ChunkStore):
        return spec
    with redacted_errors():
        tiers = [build_tier(t) for t in parse_spec(spec)]
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


def open_shared_tiers(spec: str) -> ChunkStore:
    """The spec's shared tiers only (disk, Redis), for a process that looks entries up but does not keep them
    (memory and gpu tiers belong to the process that links); a memory store that holds nothing when the spec
    has none."""
    from .spec import build_tier, parse_spec

    with redacted_errors():
        tiers = [build_tier(t) for t in parse_spec(spec) if t.kind not in ("memory", "gpu")]
    if not tiers:
        return MemoryStore(max_bytes=1)  # holds nothing: every record is larger
    return tiers[0] if len(tiers) == 1 else TieredStore(tiers)


@contextlib.contextmanager
def redacted_errors():
    """A spec's ValueError re-raised with its secrets masked (redact): its text, which quotes the spec, reaches
    logs and clients."""
    try:
        yield
    except ValueError as e:
        raise ValueError(redact(e)) from None


def __getattr__(name: str):
    if name == "RedisStore":  # imports redis-py only when asked for
        from .redis_tier import RedisStore

        return RedisStore
    raise AttributeError(name)


__all__ = [
    "ChunkKV",
    "ChunkStore",
    "RecordHead",
    "CompileLock",
    "FleetLock",
    "TierStats",
    "CorruptEntry",
    "MemoryStore",
    "DeviceStore",
    "DiskStore",
    "RedisStore",
    "TieredStore",
    "KeyCheckedStore",
    "open_store",
    "open_shared_tiers",
]
