"""Redis tier: chunk entries (the same bytes as a disk file) shared by any number of engines.

Layout. An entry of at most `max_part_bytes` (default 256 MiB) is one value, PREFIX<key>, exactly the bytes a
disk file holds. A larger one (an 8B model's 4k-token chunk is ~537 MB in bf16; Redis refuses values over
512 MB) is split: its bytes go to parts PREFIX<key>@part.<id>.<i>, each at most `max_part_bytes`, under an id
unique to that write, and PREFIX<key> then holds a small manifest (`MANIFEST` + JSON: key, quant, id, parts,
part_bytes, size and the entry's own sha256) naming them. Publishing is atomic for readers: the parts are
written first, with a provisional expiry (PART_PENDING_S, so a writer that dies leaves nothing for good),
then one MULTI/EXEC sets the manifest and gives the parts the entry's ttl; a reader reads the manifest, then
exactly the parts it names, checks their lengths, that they hold the entry the manifest names, and the
entry itself (codec.decode: checksum or HMAC, key, quant, dtypes, shapes). So it gets the old entry, the new
one or a miss, never a mix. Parts of a replaced entry expire PART_GRACE_S later, so a reader that is still
reading them finishes; a part gone missing (expired or evicted) is a miss, and the dead manifest is dropped.
Single values written before parts existed are read as before. A reader older than parts refuses a
manifest as corrupt, so the replicas of a fleet are upgraded together (entries under max_part_bytes are
unchanged and readable by both).

Compile lock. `fleet_lock` gives `ChunkStore.compile_lock` its shared lock: PREFIX<key>@compile set with
SET NX PX lock_ttl (default 120 s; lock_ttl=0 turns it off) to a token of the holder, released by a
compare-and-delete script, so one process of the fleet compiles a chunk while the others wait for its entry.

Tenant quotas (`quota`, TenantQuota): each tenant's entries are listed in Redis and a tenant over its quota
loses its own least recently used entries; the bookkeeping is redis_quota.TenantLedger's.

Every command runs under socket timeouts with no client-side retries, so a dead or unreachable server
costs at most one timeout, after which the tier is marked down for `retry_s` seconds: gets miss and puts
are skipped without touching the network, and the first call after the back-off probes again (logging
when service returns). A missing key (expired by TTL or evicted under maxmemory) is just a miss; a write
refused by the server (e.g. OOM under `maxmemory-policy noeviction`) is logged and skipped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
import uuid
from urllib.parse import urlsplit, urlunsplit

from . import codec
from .base import ChunkKV, ChunkStore, FleetLock, RecordHead, TenantQuota, check_key, check_quant
from .metrics import QUOTA_REFUSALS
from .redis_quota import TenantLedger

log = logging.getLogger(__name__)

_SKIP = object()
# Delete a corrupt value only if it is still the same bytes (another engine may have rewritten it).
_DEL_IF_SAME = (
    "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)
# Release a compile lock only if it still holds this holder's token (after its ttl it may be another's).
_DEL_IF_EQ = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

MAX_VALUE_BYTES = 512 << 20  # Redis refuses larger values (proto-max-bulk-len)
# The largest entry a parts manifest may announce: far above any record (a 32k-token chunk of a 7B model's fp16
# KV is 4 GiB), so only a planted manifest reaches it; the reader never allocates before the parts arrive.
MAX_ENTRY_BYTES = 16 << 30
DEFAULT_PART_BYTES = 256 << 20
MIN_PART_BYTES = 1 << 10  # (a manifest is a few hundred bytes: every value stays under max_part_bytes)
DEFAULT_LOCK_TTL = 120.0
MANIFEST = b"epic-chunk-parts/1\n"
_MANIFEST_MAX = 4096  # read back atomically with an overwrite (a manifest is far smaller)
PART_PENDING_S = 600.0  # parts not (yet) named by a manifest expire after this: a writer that died
PART_GRACE_S = 60.0  # parts of a replaced or deleted entry stay this long for readers already reading them
_BATCH_BYTES = 64 << 20  # parts sent or fetched per round trip
_PEEK_BYTES = 64 << 10  # read first by `peek`: a record's header and the token ids of a chunk of up to ~7k tokens
_ID = re.compile(r"[0-9a-f]{32}")


def safe_url(url: str) -> str:
    """The URL without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))


def part_key(rkey: str, wid: str, i: int) -> str:
    return f"{rkey}@part.{wid}.{i}"


def make_manifest(key: str, quant: str, wid: str, parts: int, part_bytes: int, size: int, sha256: str) -> bytes:
    body = {
        "key": key,
        "quant": quant,
        "id": wid,
        "parts": parts,
        "part_bytes": part_bytes,
        "size": size,
        "sha256": sha256,
    }
    return MANIFEST + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def parse_manifest(data: bytes, key: str, quant: str) -> dict:
    """The manifest in `data` (which starts with MANIFEST), checked for `key` and `quant`; raises CorruptEntry."""
    if len(data) > _MANIFEST_MAX:
        raise codec.CorruptEntry(f"parts manifest is {len(data)} bytes, over {_MANIFEST_MAX}")
    m = codec.loads_bounded(data[len(MANIFEST) :], "parts manifest", max_depth=1)  # a flat object
    if not isinstance(m, dict):
        raise codec.CorruptEntry("parts manifest is not a JSON object")
    if m.get("key") != key or m.get("quant") != quant:
        raise codec.CorruptEntry(f"parts manifest is for {m.get('key')!r} quant={m.get('quant')!r}")
    ints = [m.get(f) for f in ("parts", "part_bytes", "size")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in ints):
        raise codec.CorruptEntry(f"parts manifest has bad sizes {ints}")
    parts, part_bytes, size = ints
    if size > MAX_ENTRY_BYTES:
        raise codec.CorruptEntry(f"parts manifest announces {size} bytes, over the {MAX_ENTRY_BYTES}-byte limit")
    if part_bytes > MAX_VALUE_BYTES or not (parts - 1) * part_bytes < size <= parts * part_bytes:
        raise codec.CorruptEntry(f"parts manifest: {size} bytes do not make {parts} parts of {part_bytes}")
    if not isinstance(m.get("id"), str) or not _ID.fullmatch(m["id"]) or not isinstance(m.get("sha256"), str):
        raise codec.CorruptEntry("parts manifest has a bad id or checksum")
    return m


class _PastFirstPart(Exception):
    """peek: the token ids lie beyond an entry's first part."""


class _RedisLock(FleetLock):
    """PREFIX<key>@compile = a token of this holder, SET NX with a ttl; deleted only while it holds that token."""

    def __init__(self, tier: "RedisStore", name: str, ttl: float) -> None:
        self.tier, self.name, self.ttl = tier, name, ttl
        self._token: str | None = None

    def try_acquire(self) -> bool | None:
        token = uuid.uuid4().hex
        px = max(1, int(self.ttl * 1000))
        got = self.tier._call(lambda c: c.set(self.name, token, nx=True, px=px), write=True)
        if got is _SKIP:
            return None
        if got:
            self._token = token
            return True
        return False

    def release(self) -> None:
        token, self._token = self._token, None
        if token is None:
            return
        if self.tier._call(lambda c: c.eval(_DEL_IF_EQ, 1, self.name, token)) is _SKIP:
            # scripting disabled: check then delete (a lock that expired in between is deleted: one more compile)
            self.tier._call(lambda c: c.get(self.name) == token.encode() and c.delete(self.name))


class RedisStore(ChunkStore):
    name = "redis"

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        ttl: float | None = None,
        prefix: str = "epic:kv:",
        timeout: float = 2.0,
        retry_s: float = 5.0,
        quant: str = "none",
        db: int | None = None,
        secret: str | bytes | None = None,
        max_part_bytes: int = DEFAULT_PART_BYTES,
        lock_ttl: float = DEFAULT_LOCK_TTL,
        quota: TenantQuota | None = None,
    ) -> None:
        super().__init__()
        self.quota = quota or TenantQuota()
        self.secret = codec.deployment_secret(secret)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        check_quant(quant)
        if ttl is not None and ttl <= 0:
            raise ValueError("redis ttl must be positive (seconds)")
        if timeout <= 0 or retry_s < 0:
            raise ValueError("redis timeout must be positive and retry_s non-negative")
        if not MIN_PART_BYTES <= max_part_bytes <= MAX_VALUE_BYTES:
            raise ValueError(
                f"redis max_part_bytes must be between {MIN_PART_BYTES} (1K) and {MAX_VALUE_BYTES} (512M), "
                f"got {max_part_bytes}"
            )
        if not lock_ttl >= 0 or lock_ttl == float("inf"):
            raise ValueError(f"redis lock_ttl must be a finite number of seconds >= 0 (0: no lock), got {lock_ttl}")
        # A refused command (OOM under noeviction, a disabled command) leaves the tier up; any other
        # failure (refused/dropped connection, timeout, a peer that does not speak RESP) marks it down.
        self._refused = redis.exceptions.ResponseError
        self._errors = (redis.exceptions.RedisError, OSError)
        self.url, self.ttl, self.prefix, self.quant, self.retry_s = url, ttl, prefix, quant, retry_s
        self.max_part_bytes, self.lock_ttl = int(max_part_bytes), float(lock_ttl)
        self._tag = codec.storage_suffix(quant)
        kwargs = {"db": db} if db is not None else {}
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
            **kwargs,
        )
        self._down_until: float | None = None  # monotonic time of the next probe while down
        self._ledger = TenantLedger(self, _SKIP)
        self._call(lambda c: c.ping())  # logs a warning if the server is not there yet

    def __repr__(self) -> str:
        return (
            f"RedisStore({safe_url(self.url)!r}, ttl={self.ttl}, prefix={self.prefix!r}, quant={self.quant!r}, "
            f"max_part_bytes={self.max_part_bytes}, lock_ttl={self.lock_ttl})"
        )

    @property
    def available(self) -> bool:
        with self._lock:
            return self._down_until is None

    # ------------------------------------------------------------------ connection handling
    def _call(self, fn, write: bool = False):
        """fn(client), or _SKIP while the server is down or when it fails/refuses."""
        with self._lock:
            if self._down_until is not None:
                if time.monotonic() < self._down_until:
                    return _SKIP
                self._down_until = time.monotonic() + self.retry_s  # this caller probes; others skip
        try:
            result = fn(self._client)
        except self._refused as e:
            with self._lock:
                self.stats.errors += 1
                if self._down_until is not None:  # it answered: reachable again
                    self._down_until = None
                    self.stats.available = 1
            self._log_error(
                "refused", "redis tier %s refused a %s: %s", safe_url(self.url), "write" if write else "command", e
            )
            return _SKIP
        except self._errors as e:
            with self._lock:
                self.stats.errors += 1
                was_up = self._down_until is None
                self._down_until = time.monotonic() + self.retry_s
                self.stats.available = 0
            if was_up:
                log.warning(
                    "redis tier %s unreachable (%s: %s); serving from the other tiers, retrying every %gs",
                    safe_url(self.url),
                    type(e).__name__,
                    e,
                    self.retry_s,
                )
            return _SKIP
        with self._lock:
            if self._down_until is not None:
                self._down_until = None
                self.stats.available = 1
                log.warning("redis tier %s reachable again", safe_url(self.url))
        return result

    def _rkey(self, key: str) -> str:
        return f"{self.prefix}{check_key(key)}{self._tag}"

    def _key_of(self, rkey: bytes) -> str | None:
        return codec.key_in_namespace(rkey.decode("utf-8", "replace")[len(self.prefix) :], self._tag)

    def _scan_raw(self) -> list[bytes]:
        pattern = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in self.prefix) + "*"
        found = self._call(lambda c: list(c.scan_iter(match=pattern, count=1000)))
        return [] if found is _SKIP else found

    def _scan(self) -> list[bytes]:
        """This tier's entries (manifests or single values; not parts, locks or other namespaces)."""
        return [k for k in self._scan_raw() if self._key_of(k) is not None]

    def fleet_lock(self, key: str) -> FleetLock | None:
        if not self.lock_ttl:
            return None
        return _RedisLock(self, f"{self.prefix}{check_key(key)}@compile", self.lock_ttl)

    # ------------------------------------------------------------------ parts
    def _read_parts(self, rkey: str, m: dict):
        """The entry's bytes from the parts manifest `m` names; None when a part is gone (expired, evicted,
        replaced), _SKIP when the server failed; raises CorruptEntry for a part of the wrong length."""
        n, pb, size = m["parts"], m["part_bytes"], m["size"]
        buf = bytearray()  # grows with the parts read: a manifest's size alone never allocates anything
        per = max(1, _BATCH_BYTES // pb)
        for start in range(0, n, per):
            idx = range(start, min(n, start + per))

            def fetch(c, idx=idx):
                pipe = c.pipeline(transaction=False)
                for i in idx:
                    pipe.get(part_key(rkey, m["id"], i))
                return pipe.execute()

            values = self._call(fetch)
            if values is _SKIP:
                return _SKIP
            for i, value in zip(idx, values):
                if value is None:
                    return None
                want = min(pb, size - i * pb)
                if len(value) != want:
                    raise codec.CorruptEntry(f"part {i} holds {len(value)} bytes, its manifest says {want}")
                buf += value
        return buf

    def _retire(self, key: str, head, grace: bool) -> None:
        """Expire (grace: after PART_GRACE_S) or delete the parts of a replaced or deleted entry whose value
        began with `head`; nothing when it was a single value."""
        if not isinstance(head, bytes) or not head.startswith(MANIFEST):
            return
        try:
            m = parse_manifest(head, key, self.quant)
        except codec.CorruptEntry:
            return
        names = [part_key(self._rkey(key), m["id"], i) for i in range(m["parts"])]

        def retire(c):
            pipe = c.pipeline(transaction=False)
            for name in names:
                if grace:
                    pipe.pexpire(name, int(PART_GRACE_S * 1000))
                else:
                    pipe.unlink(name)
            return pipe.execute()

        self._call(retire, write=True)

    def _drop(self, key: str, rkey: str, value: bytes) -> None:
        """Delete an unusable entry if it is still `value` (another engine may have rewritten it), and the
        parts its manifest named."""
        sha1 = hashlib.sha1(value).hexdigest()
        if self._call(lambda c: c.eval(_DEL_IF_SAME, 1, rkey, sha1)) is _SKIP:
            self._call(lambda c: c.delete(rkey))  # scripting disabled: plain delete
        self._retire(key, value, grace=False)

    def _write(self, key: str, rkey: str, data: bytes) -> bool:
        """Publish an entry: one value, or parts then their manifest (see the module docstring)."""
        px = int(self.ttl * 1000) if self.ttl else None
        pb, size = self.max_part_bytes, len(data)
        names: list[str] = []
        value = data
        if size > pb:
            view, wid = memoryview(data), uuid.uuid4().hex
            n = -(-size // pb)
            names = [part_key(rkey, wid, i) for i in range(n)]
            per = max(1, _BATCH_BYTES // pb)
            for start in range(0, n, per):

                def send(c, start=start):
                    pipe = c.pipeline(transaction=False)
                    for i in range(start, min(n, start + per)):
                        pipe.set(names[i], view[i * pb : (i + 1) * pb], px=int(PART_PENDING_S * 1000))
                    return pipe.execute()

                if self._call(send, write=True) is _SKIP:
                    self._call(lambda c: c.unlink(*names))  # (they would expire anyway)
                    return False
            digest = codec.read_header(data)[1]["sha256"]
            value = make_manifest(key, self.quant, wid, n, pb, size, digest)

        def commit(c):
            pipe = c.pipeline(transaction=True)
            pipe.getrange(rkey, 0, _MANIFEST_MAX - 1)
            pipe.set(rkey, value, px=px)
            for name in names:  # published: the parts now live as long as their manifest
                if px:
                    pipe.pexpire(name, px)
                else:
                    pipe.persist(name)
            return pipe.execute()

        res = self._call(commit, write=True)
        if res is _SKIP:
            if names:
                self._call(lambda c: c.unlink(*names))
            return False
        self._retire(key, res[0], grace=True)
        if not all(res[2:]):  # a part expired before its manifest was set (a writer slower than PART_PENDING_S)
            self._drop(key, rkey, value)
            self._log_error("slow", "redis tier %s: chunk %s took too long to write; dropped", safe_url(self.url), key)
            return False
        return True

    # ------------------------------------------------------------------ store
    def get(self, key: str) -> ChunkKV | None:
        rkey = self._rkey(key)
        t0 = time.perf_counter()
        data = self._call(lambda c: c.get(rkey))
        if data is _SKIP or data is None:
            with self._lock:
                self.stats.misses += 1
            return None
        try:
            entry = data
            if data.startswith(MANIFEST):
                m = parse_manifest(data, key, self.quant)
                entry = self._read_parts(rkey, m)
                if entry is None or entry is _SKIP:
                    if entry is None:  # a part expired or was evicted: the entry is gone
                        log.info("redis tier %s: entry %s lost a part; it will be recompiled", safe_url(self.url), rkey)
                        self._drop(key, rkey, data)
                    with self._lock:
                        self.stats.misses += 1
                    return None
                if codec.read_header(entry)[1].get("sha256") != m["sha256"]:
                    raise codec.CorruptEntry("its parts do not hold the entry its manifest names")
            kv = codec.decode(entry, key, self.quant, self.secret)
        except Exception as e:  # any of it (CorruptEntry, or what unforeseen bytes trip): dropped, a miss
            log.warning(
                "redis tier %s: corrupt entry %s dropped (%s); it will be recompiled", safe_url(self.url), rkey, e
            )
            with self._lock:
                self.stats.corrupt += 1
                self.stats.misses += 1
            self._drop(key, rkey, data)
            return None
        if self.quota.active:
            self._ledger.touch(kv.tenant, key)
        with self._lock:
            self.stats.record_load(t0)
        return kv

    def peek(self, key: str) -> RecordHead | None:
        """The entry's header and token ids by GETRANGE (of its first part where it has parts), not its KV."""
        rkey = self._rkey(key)
        try:
            name = rkey
            first = self._call(lambda c: c.getrange(rkey, 0, _PEEK_BYTES - 1))
            if not isinstance(first, bytes) or not first:
                return None
            if first.startswith(MANIFEST):
                m = parse_manifest(first, key, self.quant)
                name = part_key(rkey, m["id"], 0)
                first = self._call(lambda c: c.getrange(name, 0, _PEEK_BYTES - 1))
                if not isinstance(first, bytes):
                    return None
            hlen = codec.header_length(first)
            if 8 + hlen > len(first):
                head = self._call(lambda c: c.getrange(name, 0, 8 + hlen - 1))
                if not isinstance(head, bytes) or len(head) != 8 + hlen:
                    return None
            else:
                head = first[: 8 + hlen]

            def read(begin: int, n: int) -> bytes:
                at = 8 + hlen + begin
                if at + n <= len(first):
                    return first[at : at + n]
                if name != rkey and at + n > m["part_bytes"]:
                    raise _PastFirstPart  # (tiny parts only: the token ids are stored right after the header)
                got = self._call(lambda c: c.getrange(name, at, at + n - 1))
                return got if isinstance(got, bytes) else b""

            return codec.head_of(head, read, key, self.quant)
        except _PastFirstPart:
            kv = self.get(key)
            return None if kv is None else RecordHead.of(kv)
        except codec.CorruptEntry:
            return None  # `get` drops it

    def put(self, kv: ChunkKV) -> None:
        rkey = self._rkey(kv.key)
        with self._lock:
            down = self._down_until is not None and time.monotonic() < self._down_until
        if down:
            return  # skipped while down: do not even encode
        t0 = time.perf_counter()
        data = codec.encode_for_tier(self, kv, lambda m: log.error("redis tier: %s", m))
        if data is None:
            return
        if not self.quota.fits(len(data)):
            with self._lock:
                self.stats.quota_refusals += 1
            QUOTA_REFUSALS.labels(self.name).inc()
            self._log_error("quota", "redis tier: chunk %s is over its tenant's whole quota here; not stored", kv.key)
            return
        if not self._write(kv.key, rkey, data):
            return
        with self._lock:
            self.stats.puts += 1
            self.stats.put_seconds += time.perf_counter() - t0
        if self.quota.active:
            self._ledger.enforce(kv.tenant, kv.key, len(data))

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """tenant id -> (bytes, entries) as listed (only while a quota is set; "" is the default tenant)."""
        return self._ledger.usage(self._scan_raw())

    def delete(self, key: str) -> bool:
        rkey = self._rkey(key)

        def delete(c):
            pipe = c.pipeline(transaction=True)
            pipe.getrange(rkey, 0, _MANIFEST_MAX - 1)
            pipe.delete(rkey)
            return pipe.execute()

        res = self._call(delete, write=True)
        if res is _SKIP:
            return False
        self._retire(key, res[0], grace=False)
        return bool(res[1])

    def contains(self, key: str) -> bool:
        rkey = self._rkey(key)
        n = self._call(lambda c: c.exists(rkey))
        return n is not _SKIP and bool(n)

    def keys(self) -> list[str]:
        return [self._key_of(k) for k in self._scan()]  # type: ignore[misc]

    def usage(self) -> dict[str, int]:
        """Bytes of every entry: a single value's length, or the size its parts manifest names."""
        rkeys = self._scan()

        def heads(c):
            pipe = c.pipeline(transaction=False)
            for k in rkeys:
                pipe.strlen(k)
                pipe.getrange(k, 0, len(MANIFEST) - 1)
            return pipe.execute()

        found = self._call(heads) if rkeys else []
        if found is _SKIP:
            return {}
        sizes = dict(zip(rkeys, found[0::2]))
        manifests = [k for k, head in zip(rkeys, found[1::2]) if head == MANIFEST]
        if manifests:
            values = self._call(lambda c: c.mget(manifests))
            for k, value in zip(manifests, [] if values is _SKIP else values):
                try:
                    sizes[k] = parse_manifest(value, self._key_of(k), self.quant)["size"]  # type: ignore[arg-type]
                except (codec.CorruptEntry, TypeError):
                    pass
        return {self._key_of(k): int(n) for k, n in sizes.items() if n}  # type: ignore[misc]

    def refresh(self) -> None:
        u = self.usage()
        with self._lock:
            self.stats.entries = len(u)
            self.stats.bytes = sum(u.values())

    def clear(self) -> int:
        """Delete this tier's entries and their parts; returns how many entries."""
        raw = self._scan_raw()
        ledgers = [k for k in raw if k.startswith(self._ledger.head.encode())]
        entries = [k for k in raw if self._key_of(k) is not None]
        parts = [k for k in raw if b"@part." in k and self._key_of(k.rsplit(b"@part.", 1)[0]) is not None]
        n = 0
        for names, counted in ((entries, True), (parts, False), (ledgers, False)):
            for i in range(0, len(names), 500):
                batch = names[i : i + 500]
                r = self._call(lambda c: c.unlink(*batch))
                n += 0 if r is _SKIP or not counted else int(r)
        return n

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # pragma: no cover - closing a dead connection
            pass
