"""Redis tier: one binary value per chunk (the same bytes as a disk file), shared by any number of engines.

Every command runs under socket timeouts with no client-side retries, so a dead or unreachable server
costs at most one timeout, after which the tier is marked down for `retry_s` seconds: gets miss and puts
are skipped without touching the network, and the first call after the back-off probes again (logging
when service returns). A missing key (expired by TTL or evicted under maxmemory) is just a miss; a write
refused by the server (e.g. OOM under `maxmemory-policy noeviction`) is logged and skipped.
"""

from __future__ import annotations

import hashlib
import logging
import time
from urllib.parse import urlsplit, urlunsplit

from . import codec
from .base import ChunkKV, ChunkStore, check_key, check_quant

log = logging.getLogger(__name__)

_SKIP = object()
# Delete a corrupt value only if it is still the same bytes (another engine may have rewritten it).
_DEL_IF_SAME = (
    "if redis.sha1hex(redis.call('GET', KEYS[1]) or '') == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
)


def safe_url(url: str) -> str:
    """The URL without its password (for logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else "***@"
    return urlunsplit((parts.scheme, user + netloc, parts.path, parts.query, parts.fragment))


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
    ) -> None:
        super().__init__()
        self.secret = codec.deployment_secret(secret)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        check_quant(quant)
        if ttl is not None and ttl <= 0:
            raise ValueError("redis ttl must be positive (seconds)")
        if timeout <= 0 or retry_s < 0:
            raise ValueError("redis timeout must be positive and retry_s non-negative")
        # A refused command (OOM under noeviction, a disabled command) leaves the tier up; any other
        # failure (refused/dropped connection, timeout, a peer that does not speak RESP) marks it down.
        self._refused = redis.exceptions.ResponseError
        self._errors = (redis.exceptions.RedisError, OSError)
        self.url, self.ttl, self.prefix, self.quant, self.retry_s = url, ttl, prefix, quant, retry_s
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
        self._call(lambda c: c.ping())  # logs a warning if the server is not there yet

    def __repr__(self) -> str:
        return f"RedisStore({safe_url(self.url)!r}, ttl={self.ttl}, prefix={self.prefix!r}, quant={self.quant!r})"

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

    def _scan(self) -> list[bytes]:
        pattern = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in self.prefix) + "*"
        found = self._call(lambda c: list(c.scan_iter(match=pattern, count=1000)))
        if found is _SKIP:
            return []
        return [k for k in found if self._key_of(k) is not None]

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
            kv = codec.decode(data, key, self.quant, self.secret)
        except codec.CorruptEntry as e:
            log.warning(
                "redis tier %s: corrupt entry %s dropped (%s); it will be recompiled", safe_url(self.url), rkey, e
            )
            with self._lock:
                self.stats.corrupt += 1
                self.stats.misses += 1
            sha1 = hashlib.sha1(data).hexdigest()
            if self._call(lambda c: c.eval(_DEL_IF_SAME, 1, rkey, sha1)) is _SKIP:
                self._call(lambda c: c.delete(rkey))  # scripting disabled: plain delete
            return None
        with self._lock:
            self.stats.record_load(t0)
        return kv

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
        px = int(self.ttl * 1000) if self.ttl else None
        if self._call(lambda c: c.set(rkey, data, px=px), write=True) is _SKIP:
            return
        with self._lock:
            self.stats.puts += 1
            self.stats.put_seconds += time.perf_counter() - t0

    def delete(self, key: str) -> bool:
        rkey = self._rkey(key)
        n = self._call(lambda c: c.delete(rkey))
        return n is not _SKIP and bool(n)

    def contains(self, key: str) -> bool:
        rkey = self._rkey(key)
        n = self._call(lambda c: c.exists(rkey))
        return n is not _SKIP and bool(n)

    def keys(self) -> list[str]:
        return [self._key_of(k) for k in self._scan()]  # type: ignore[misc]

    def usage(self) -> dict[str, int]:
        rkeys = self._scan()

        def lengths(c):
            pipe = c.pipeline(transaction=False)
            for k in rkeys:
                pipe.strlen(k)
            return pipe.execute()

        sizes = self._call(lengths) if rkeys else []
        if sizes is _SKIP:
            return {}
        return {self._key_of(k): int(n) for k, n in zip(rkeys, sizes) if n}  # type: ignore[misc]

    def refresh(self) -> None:
        u = self.usage()
        with self._lock:
            self.stats.entries = len(u)
            self.stats.bytes = sum(u.values())

    def clear(self) -> int:
        rkeys = self._scan()
        n = 0
        for i in range(0, len(rkeys), 500):
            batch = rkeys[i : i + 500]
            r = self._call(lambda c: c.unlink(*batch))
            n += 0 if r is _SKIP else int(r)
        return n

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:  # pragma: no cover - closing a dead connection
            pass
