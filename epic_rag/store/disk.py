"""Disk tier: one safetensors file per chunk in a folder that several processes may share.

Writes go to a hidden temporary file in the same folder and are renamed over the final name (atomic on
POSIX), so a reader sees either no entry or a whole one; two processes writing the same chunk leave
one valid file. Every read checks the checksum, key, quant mode, dtypes and shapes (codec.decode); a
bad file is deleted and counted. A hit touches the file's mtime, and a byte budget evicts the least
recently used files. The budget covers the whole folder and is enforced approximately across processes:
each writer rescans the folder when its own count passes the budget, and at least every 30 s.

Tenants (the tenant id in each file's header): a write that takes its tenant over `quota` evicts that tenant's
own least recently used files (the writer rescans the folder after each write while a quota is set); over the
budget, the least recently used files of the tenant holding the most bytes go first, so a tenant filling the
folder evicts itself once it is the largest, never a smaller tenant's. A file's tenant is read from its header
once (a few KiB) and remembered by inode.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
import uuid
from pathlib import Path

from . import codec
from .base import ChunkKV, ChunkStore, RecordHead, TenantQuota, check_key, check_quant, evict_order
from .metrics import QUOTA_EVICTIONS, QUOTA_REFUSALS

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_TMP = ".tmp-"
_RESCAN_S = 30.0
_STALE_TMP_S = 3600.0
_LOW_WATER = 0.9  # eviction frees down to this fraction of the budget
# An entry is opened without following a link and without waiting (a FIFO planted under a key's name would
# block a plain open, inside the engine step), then read only if it is a regular file.
_HEAD_BYTES = 64 << 10
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


class _NotAFile(OSError):
    """A name in the folder that is not a regular file (a symbolic link, a FIFO, a device): never read."""

    def __init__(self, what: str, st: os.stat_result) -> None:
        super().__init__(what)
        self.st = st


def _open_entry(path: Path) -> tuple[int, os.stat_result]:
    """(fd, fstat) of a regular file at `path`; FileNotFoundError, _NotAFile, or another OSError."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise _NotAFile("a symbolic link", os.lstat(path)) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotAFile(f"not a regular file (mode {stat.filemode(st.st_mode)})", st)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _read_header(fd: int) -> bytes:
    """An entry's first 8 + header-length bytes (one read of 64 KiB for any genuine header); CorruptEntry when
    the file is shorter."""
    first = os.pread(fd, _HEAD_BYTES, 0)
    end = 8 + codec.header_length(first)
    head = first[:end] if end <= len(first) else os.pread(fd, end, 0)
    if len(head) != end:
        raise codec.CorruptEntry("entry is shorter than its header")
    return head


def _read_into(fd: int, view: memoryview) -> int:
    got = 0
    while got < len(view):
        n = os.readv(fd, [view[got:]])
        if not n:
            break
        got += n
    return got


class DiskStore(ChunkStore):
    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike,
        max_bytes: int | None = None,
        quant: str = "none",
        fsync: bool = False,
        secret: str | bytes | None = None,
        quota: TenantQuota | None = None,
    ) -> None:
        super().__init__()
        check_quant(quant)
        self.quota = quota or TenantQuota()
        self._tenants: dict[str, tuple[int, int, str]] = {}  # path -> (inode, size, tenant id) read from its header
        self.secret = codec.deployment_secret(secret)
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError("disk store budget must be positive")
        self.root = Path(root).expanduser().absolute()
        self.max_bytes = max_bytes
        self.quant = quant
        self.fsync = fsync
        self._tag = codec.storage_suffix(quant)
        self._approx_bytes = 0
        self._last_scan = 0.0
        self._evict_lock = threading.Lock()
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)  # KV reveals documents: owner-only
        except OSError as e:
            self._log_error(
                "mkdir", f"disk tier {self.root}: cannot create the folder ({e}); it will miss until the folder exists"
            )
        self.refresh()

    def __repr__(self) -> str:
        return f"DiskStore({str(self.root)!r}, max_bytes={self.max_bytes}, quant={self.quant!r})"

    # ------------------------------------------------------------------ helpers
    def _path(self, key: str) -> Path:
        return self.root / f"{key}{self._tag}{SUFFIX}"

    def _key_of(self, name: str) -> str | None:
        if name.startswith(".") or not name.endswith(SUFFIX):
            return None
        return codec.key_in_namespace(name[: -len(SUFFIX)], self._tag)

    # ------------------------------------------------------------------ read
    def get(self, key: str) -> ChunkKV | None:
        return self._load(key, touch=True)

    def verify(self, key: str) -> bool:
        return self._load(key, touch=False) is not None

    def _load(self, key: str, touch: bool) -> ChunkKV | None:
        check_key(key)
        path = self._path(key)
        t0 = time.perf_counter()
        try:
            fd, st = _open_entry(path)
        except FileNotFoundError:
            with self._lock:
                self.stats.misses += 1
            return None
        except _NotAFile as e:
            self._drop(path, e.st, e)
            return None
        except OSError as e:
            with self._lock:
                self.stats.misses += 1
                self.stats.errors += 1
            self._log_error("read", f"disk tier {self.root}: cannot read {path.name}: {e}")
            return None
        try:
            try:
                buf = bytearray(st.st_size)
            except MemoryError:  # no room now: a miss, the entry kept (it may well be sound)
                raise OSError(f"no memory for its {st.st_size} bytes") from None
            got = _read_into(fd, memoryview(buf))
            if got != len(buf):
                raise codec.CorruptEntry(f"file shrank while reading ({got} of {len(buf)} bytes)")
            kv = codec.decode(buf, key, self.quant, self.secret)  # raises only CorruptEntry
            if touch:
                try:
                    os.utime(fd)  # LRU order across processes (atime is unreliable under relatime/noatime)
                except OSError:
                    pass
        except OSError as e:
            with self._lock:
                self.stats.misses += 1
                self.stats.errors += 1
            self._log_error("read", f"disk tier {self.root}: cannot read {path.name}: {e}")
            return None
        except codec.CorruptEntry as e:
            self._drop(path, st, e)
            return None
        finally:
            os.close(fd)
        with self._lock:
            self.stats.record_load(t0)
        return kv

    def peek(self, key: str) -> RecordHead | None:
        """The entry's header and token ids, read without its tensors (a few KiB of a file of megabytes); None
        when missing or unreadable (a full `get` then drops it)."""
        try:
            fd, st = _open_entry(self._path(check_key(key)))
        except OSError:
            return None
        try:
            head = _read_header(fd)
            hlen = len(head) - 8
            return codec.head_of(head, lambda begin, n: os.pread(fd, n, 8 + hlen + begin), key, self.quant)
        except (OSError, codec.CorruptEntry):
            return None
        finally:
            os.close(fd)

    def _drop(self, path: Path, st: os.stat_result, why: Exception) -> None:
        log.warning("disk tier %s: corrupt entry %s dropped (%s); it will be recompiled", self.root, path.name, why)
        with self._lock:
            self.stats.corrupt += 1
            self.stats.misses += 1
        try:
            now = os.lstat(path)  # the name itself (a link is dropped, never what it points to)
            if (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns):  # not replaced meanwhile
                os.unlink(path)
        except OSError:
            pass

    # ------------------------------------------------------------------ write
    def put(self, kv: ChunkKV) -> None:
        check_key(kv.key)
        t0 = time.perf_counter()
        data = codec.encode_for_tier(self, kv, lambda m: self._log_error("encode", f"disk tier {self.root}: {m}"))
        if data is None:
            return
        if self.max_bytes is not None and len(data) > self.max_bytes:
            return  # larger than the whole budget
        if not self.quota.fits(len(data)):
            with self._lock:
                self.stats.quota_refusals += 1
            QUOTA_REFUSALS.labels(self.name).inc()
            self._log_error("quota", f"disk tier {self.root}: chunk {kv.key} is over its tenant's whole quota here")
            return
        path = self._path(kv.key)
        tmp = self.root / f"{_TMP}{path.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                try:
                    old = os.stat(path).st_size
                except OSError:
                    old = 0
                os.replace(tmp, path)
                st = os.lstat(path)
                with self._lock:
                    self._tenants[str(path)] = (st.st_ino, st.st_size, kv.tenant)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as e:
            with self._lock:
                self.stats.errors += 1
            self._log_error(
                f"write-{e.errno}",
                f"disk tier {self.root}: cannot write chunk {kv.key} ({e}); "
                "serving continues without caching it on disk",
            )
            return
        with self._lock:
            self.stats.puts += 1
            self.stats.put_seconds += time.perf_counter() - t0
            self._approx_bytes += len(data) - old
            self.stats.bytes = self._approx_bytes
            self.stats.entries += old == 0
            due = self.quota.active or (
                self.max_bytes is not None
                and (self._approx_bytes > self.max_bytes or time.monotonic() - self._last_scan > _RESCAN_S)
            )
        if due:
            self._evict(kv.tenant, str(path))

    # ------------------------------------------------------------------ budget
    def _stats(self):
        """(entry, stat) for every file in the folder that can still be stat'ed (the folder may be shared)."""
        try:
            it = os.scandir(self.root)
        except OSError:
            return
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)  # a link is no entry (and never read: _open_entry)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    yield e, st

    def _scan(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every entry in the folder (all quant namespaces); removes stale temp files."""
        out = []
        now = time.time()
        for e, st in self._stats():
            if e.name.startswith(_TMP):
                if now - st.st_mtime > _STALE_TMP_S:  # left by a crashed writer
                    try:
                        os.unlink(e.path)
                    except OSError:
                        pass
            elif not e.name.startswith(".") and e.name.endswith(SUFFIX):
                out.append((st.st_mtime, st.st_size, e.path))
        return out

    def refresh(self) -> None:
        entries = self._scan()
        with self._lock:
            self._approx_bytes = self.stats.bytes = sum(s for _, s, _ in entries)
            self.stats.entries = len(entries)
            self._last_scan = time.monotonic()

    def _tenant_of(self, path: str, st: os.stat_result) -> str | None:
        """The tenant id in a file's header (remembered by inode); None when it cannot be read."""
        with self._lock:
            known = self._tenants.get(path)
        if known is not None and known[:2] == (st.st_ino, st.st_size):
            return known[2]
        try:
            fd, _ = _open_entry(Path(path))
        except OSError:
            return None
        try:
            tenant = codec.read_header(_read_header(fd))[1].get("tenant", "")
        except (OSError, codec.CorruptEntry):
            return None
        finally:
            os.close(fd)
        if not isinstance(tenant, str):
            return None
        with self._lock:
            self._tenants[path] = (st.st_ino, st.st_size, tenant)
        return tenant

    def _tenant_at(self, path: str) -> str | None:
        try:
            return self._tenant_of(path, os.lstat(path))
        except OSError:
            return None

    def _evict(self, tenant: str | None = None, keep: str = "") -> None:
        """Bring `tenant` (the writer's) under its quota, then the folder under its budget (module docstring)."""
        if not self._evict_lock.acquire(blocking=False):
            return  # another thread is already evicting
        try:
            entries = sorted(self._scan())  # least recently used first
            total = sum(s for _, s, _ in entries)
            victims: list[str] = []
            quota_victims = 0
            if tenant is not None and self.quota.active:
                own = [(p, size) for _, size, p in entries if self._tenant_at(p) == tenant]
                nbytes, n = sum(size for _, size in own), len(own)
                for p, size in own:
                    if not self.quota.over(nbytes, n):
                        break
                    if p != keep:
                        victims.append(p)
                        nbytes, n = nbytes - size, n - 1
                quota_victims = len(victims)
            if self.max_bytes is not None and total > self.max_bytes:
                gone = set(victims)
                held: dict[str, list[tuple[str, int]]] = {}
                for _, size, p in entries:
                    if p not in gone:
                        t = self._tenant_at(p)
                        held.setdefault("?" if t is None else t, []).append((p, size))
                target = self.max_bytes * _LOW_WATER
                victims += evict_order(held, target, keep)
            sizes = {p: size for _, size, p in entries}
            evicted = 0
            for i, p in enumerate(victims):
                try:
                    os.unlink(p)
                    evicted += 1
                except FileNotFoundError:
                    pass  # another process evicted it
                except OSError as e:
                    self._log_error("evict", f"disk tier {self.root}: cannot evict {p}: {e}")
                    continue
                total -= sizes[p]
                if i < quota_victims:
                    QUOTA_EVICTIONS.labels(self.name).inc()
                    with self._lock:
                        self.stats.quota_evictions += 1
            with self._lock:
                self.stats.evictions += evicted
                self._approx_bytes = self.stats.bytes = total
                self.stats.entries = len(entries) - evicted
                self._last_scan = time.monotonic()
                for p in victims:
                    self._tenants.pop(p, None)
        finally:
            self._evict_lock.release()

    def tenant_usage(self) -> dict[str, tuple[int, int]]:
        """tenant id -> (bytes, files) in the folder (all quant namespaces; "?" for files whose header cannot
        be read)."""
        out: dict[str, tuple[int, int]] = {}
        for _, size, p in self._scan():
            t = self._tenant_at(p)
            b, n = out.get("?" if t is None else t, (0, 0))
            out["?" if t is None else t] = (b + size, n + 1)
        return out

    # ------------------------------------------------------------------ listing
    def usage(self) -> dict[str, int]:
        return {key: st.st_size for e, st in self._stats() if (key := self._key_of(e.name)) is not None}

    def keys(self) -> list[str]:
        return list(self.usage())

    def contains(self, key: str) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self._path(check_key(key))).st_mode)
        except OSError:
            return False

    def delete(self, key: str) -> bool:
        try:
            size = os.lstat(self._path(check_key(key))).st_size
            os.unlink(self._path(key))
        except OSError:
            return False
        with self._lock:
            self._approx_bytes -= size
            self.stats.bytes = self._approx_bytes
            self.stats.entries = max(0, self.stats.entries - 1)
        return True

    def clear(self) -> int:
        """Delete this tier's entries (its quant namespace) and abandoned temporary files."""
        n = 0
        try:
            names = os.listdir(self.root)
        except OSError:
            return 0
        for name in names:
            if name.startswith(_TMP):
                try:  # a temp file younger than a minute may be another process's write in progress
                    if time.time() - os.stat(self.root / name).st_mtime > 60:
                        os.unlink(self.root / name)
                except OSError:
                    pass
            elif self._key_of(name) is not None:
                n += self.delete(self._key_of(name))
        self.refresh()
        return n
