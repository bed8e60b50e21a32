"""Store specs: "memory+disk:/path?max_bytes=20G+redis://host:6379/0?ttl=86400" -> tiers.

See `epic_rag.store.open_store` for the grammar.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit

from .base import QUANTS, ChunkStore, TenantQuota

# '+' starts a new tier only where a tier scheme follows, so paths may contain '+' elsewhere.
_SPLIT = re.compile(r"\+(?=(?:memory(?:$|[?:+])|gpu(?:$|[?+])|disk:|redis://|rediss://|unix://))")
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?", re.IGNORECASE)
_QUOTA = {"tenant_max_bytes", "tenant_max_entries"}  # per tenant, in the tier that names them (TenantQuota)
_ARGS = {
    "memory": {"max_bytes", "quant", "pin"} | _QUOTA,
    "gpu": {"max_bytes", "device"},
    "disk": {"max_bytes", "quant", "fsync", "secret"} | _QUOTA,
    "redis": {"ttl", "prefix", "timeout", "retry_s", "quant", "db", "secret", "max_part_bytes", "lock_ttl"} | _QUOTA,
}


@dataclass(slots=True)
class TierSpec:
    kind: str  # gpu | memory | disk | redis
    target: str = ""  # disk folder or Redis URL (without our query args)
    args: dict[str, str] = field(default_factory=dict)


def parse_size(text: str, what: str = "size") -> int:
    """'1073741824', '512M', '4G', '4GiB', '1.5g' -> bytes (K/M/G/T are powers of 1024)."""
    m = _SIZE.fullmatch(text.strip())
    if not m or (m.group(3) or "").lower() == "ib" and not m.group(2):
        raise ValueError(f"{what} must be a byte count such as 1073741824, 512M or 4GiB, got {text!r}")
    unit = m.group(2).lower()
    n = float(m.group(1)) * (1024 ** ("kmgt".index(unit) + 1) if unit else 1)
    if n < 1:
        raise ValueError(f"{what} must be at least one byte, got {text!r}")
    return int(n)


def _number(text: str, what: str, minimum: float = 0.0) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number, got {text!r}") from None
    if not x >= minimum or x != x or x == float("inf"):
        raise ValueError(f"{what} must be a finite number >= {minimum:g}, got {text!r}")
    return x


def _split_args(part: str, kind: str, spec: str) -> tuple[str, dict[str, str]]:
    target, sep, query = part.partition("?")
    if not sep:
        return target, {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        raise ValueError(
            f"store spec {spec!r}: bad query {query!r} for the {kind} tier (expected name=value&name=value)"
        ) from None
    args: dict[str, str] = {}
    for name, value in pairs:
        if name not in _ARGS[kind]:
            raise ValueError(
                f"store spec {spec!r}: unknown {kind} option {name!r}; known: {', '.join(sorted(_ARGS[kind]))}"
            )
        if name in args:
            raise ValueError(f"store spec {spec!r}: option {name!r} given twice")
        args[name] = value
    if args.get("quant", "none") not in QUANTS:
        raise ValueError(f"store spec {spec!r}: quant must be one of {', '.join(QUANTS)}, got {args['quant']!r}")
    return target, args


def parse_spec(spec: str) -> list[TierSpec]:
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("store spec must be a non-empty string such as 'memory' or 'memory+disk:/var/cache/epic'")
    spec = spec.strip()
    if spec.startswith("+") or spec.endswith("+"):
        raise ValueError(f"store spec {spec!r} has an empty tier (stray '+')")
    tiers = []
    for part in _SPLIT.split(spec):
        if not part:
            raise ValueError(f"store spec {spec!r} has an empty tier (stray '+')")
        if part == "memory" or part.startswith(("memory?", "memory:")):
            target, args = _split_args(part, "memory", spec)
            if target != "memory":  # legacy form memory:<bytes>
                if "max_bytes" in args:
                    raise ValueError(f"store spec {spec!r}: give the memory budget once")
                args["max_bytes"] = target[len("memory:") :]
            tiers.append(TierSpec("memory", "", args))
        elif part == "gpu" or part.startswith("gpu?"):
            _, args = _split_args(part, "gpu", spec)
            if "max_bytes" not in args:
                raise ValueError(f"store spec {spec!r}: the gpu tier needs max_bytes (the device memory it may hold)")
            tiers.append(TierSpec("gpu", "", args))
        elif part.startswith("disk:"):
            target, args = _split_args(part, "disk", spec)
            path = target[len("disk:") :]
            if not path.strip():
                raise ValueError(f"store spec {spec!r}: disk tier needs a folder, e.g. disk:/var/cache/epic-rag")
            tiers.append(TierSpec("disk", path, args))
        elif part.startswith(("redis://", "rediss://", "unix://")):
            target, args = _split_args(part, "redis", spec)
            _check_redis_url(target, spec, args)
            tiers.append(TierSpec("redis", target, args))
        else:
            raise ValueError(
                f"store spec {spec!r}: unknown tier {part!r}; expected gpu, memory, disk:<folder>, "
                "redis://host:port/db (or rediss://, unix://), joined with '+'"
            )
    kinds = [t.kind for t in tiers]
    if kinds.count("memory") > 1:
        raise ValueError(f"store spec {spec!r}: more than one memory tier")
    if "gpu" in kinds[1:]:
        raise ValueError(f"store spec {spec!r}: the gpu tier must be the first (fastest) tier, and only one")
    return tiers


def gpu_tier_bytes(spec: "str | object") -> int:
    """The device memory a spec's gpu tier may hold (0 without one, or for an open store)."""
    if not isinstance(spec, str):
        return 0
    return sum(parse_size(t.args["max_bytes"], "gpu max_bytes") for t in parse_spec(spec) if t.kind == "gpu")


def _check_redis_url(url: str, spec: str, args: dict[str, str]) -> None:
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"store spec {spec!r}: unix socket URL needs a path, e.g. unix:///run/redis.sock")
        return
    if "db" in args:
        raise ValueError(f"store spec {spec!r}: give the Redis db in the URL path (redis://host:port/<db>)")
    if not parts.hostname:
        raise ValueError(f"store spec {spec!r}: Redis URL {url!r} has no host (e.g. redis://127.0.0.1:6379/0)")
    try:
        _ = parts.port
    except ValueError:
        raise ValueError(f"store spec {spec!r}: Redis URL {url!r} has a bad port") from None
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"store spec {spec!r}: Redis db must be a number (redis://host:port/<db>), got {db!r}")


def _quota(a: dict[str, str], kind: str) -> TenantQuota:
    n = a.get("tenant_max_entries")
    if n is not None and not n.isdigit():
        raise ValueError(f"{kind} tenant_max_entries must be a whole number >= 1, got {n!r}")
    mb = a.get("tenant_max_bytes")
    return TenantQuota(
        parse_size(mb, f"{kind} tenant_max_bytes") if mb is not None else None, int(n) if n is not None else None
    )


def build_tier(t: TierSpec) -> ChunkStore:
    a = t.args
    quant = a.get("quant", "none")
    quota = _quota(a, t.kind)
    if t.kind == "gpu":
        from .memory import DeviceStore

        return DeviceStore(parse_size(a["max_bytes"], "gpu max_bytes"), a.get("device", "cuda"))
    if t.kind == "memory":
        from .memory import MemoryStore

        kw: dict = {"max_bytes": parse_size(a["max_bytes"], "memory max_bytes")} if "max_bytes" in a else {}
        pin = a.get("pin", "auto")
        if pin not in ("auto", "0", "1"):
            raise ValueError(f"memory pin must be auto, 0 or 1, got {pin!r}")
        return MemoryStore(quant=quant, pin=None if pin == "auto" else pin == "1", quota=quota, **kw)
    if t.kind == "disk":
        from .disk import DiskStore

        fsync = a.get("fsync", "0")
        if fsync not in ("0", "1", "true", "false"):
            raise ValueError(f"disk fsync must be 0 or 1, got {fsync!r}")
        mb = parse_size(a["max_bytes"], "disk max_bytes") if "max_bytes" in a else None
        return DiskStore(
            t.target, max_bytes=mb, quant=quant, fsync=fsync in ("1", "true"), secret=a.get("secret"), quota=quota
        )
    from .redis_tier import RedisStore

    kw: dict = {"quant": quant, "secret": a.get("secret"), "quota": quota}
    if "ttl" in a:
        kw["ttl"] = _number(a["ttl"], "redis ttl", 0.001)
    if "timeout" in a:
        kw["timeout"] = _number(a["timeout"], "redis timeout", 0.001)
    if "retry_s" in a:
        kw["retry_s"] = _number(a["retry_s"], "redis retry_s")
    if "prefix" in a:
        kw["prefix"] = a["prefix"]
    if "db" in a:
        kw["db"] = int(_number(a["db"], "redis db"))
    if "max_part_bytes" in a:
        kw["max_part_bytes"] = parse_size(a["max_part_bytes"], "redis max_part_bytes")
    if "lock_ttl" in a:
        kw["lock_ttl"] = _number(a["lock_ttl"], "redis lock_ttl")
    return RedisStore(t.target, **kw)
