"""One chunk entry as bytes: safetensors with a JSON header, a checksum (an HMAC under a deployment secret)
and optional int8 packing.

Layout (a plain safetensors file, readable by `safetensors.safe_open`):

    tensors   k, v            [L, T, H, D] in the model's KV dtype           (quant "none")
              k_q, v_q        [L, T, H, D] int8                               (quant "int8")
              k_scale, v_scale [L, T, H, 1] float32  (x ~= x_q * scale, per token per head)
              token_ids       [T] int64
    metadata  {"epic": JSON}  format, key, quant, dtype, shape [L, T, H, D], base_pos, lead, tenant,
                              sha256[, hmac]

`lead` and `tenant` are the record's context ids (ChunkKV; hex, empty for none): covered by the checksum and
the HMAC like every header field, and checked against the key by the reader (keys.record_key).

The checksum is sha256 over the canonical JSON header (without the checksums) and every tensor's bytes
in name order, so any flipped byte, in the header or the data, is found. A sha256 stops accidents, not a
writer: anyone who can write the shared folder or Redis can compute one. With a deployment secret
(`secret=` or $EPIC_RAG_KV_SECRET) entries also carry an HMAC-SHA256 over the same bytes, and a reader
holding the secret accepts only entries whose HMAC it can verify (an unsigned or forged entry is corrupt);
a reader without the secret still checks the sha256, so `store verify` run without it deletes nothing sound.
`decode` also checks that the stored key is the requested one, that the quant mode is the tier's, and that
dtypes, shapes and offsets agree with the header, before any tensor is built. Nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import struct
from collections.abc import Callable

import torch
from safetensors.torch import save as st_save

from .base import ChunkKV, ChunkStore, RecordHead, check_quant

FORMAT = "epic-chunk-kv/1"
_MAX_HEADER = 1 << 20
# JSON nesting a header may have: a genuine one is 2 deep (its tensor table) and its epic header 1 deep; a
# deeper one is refused before json.loads, whose recursion a planted 100k-deep header would exhaust.
MAX_JSON_DEPTH = 8
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
SECRET_ENV = "EPIC_RAG_KV_SECRET"
_CHECKSUMS = ("sha256", "hmac")  # header fields the digests leave out
_HEX = re.compile(r"[0-9a-f]{0,64}")  # a context id (keys.lead_id, keys.tenant_id) or none

# safetensors dtype names <-> torch dtypes (the KV dtypes a model may use, plus what int8 packing needs).
_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I8": torch.int8,
    "I64": torch.int64,
}
_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_TORCH_TO_NAME = {v: k for k, v in _KV_DTYPES.items()}


class CorruptEntry(ValueError):
    """Bytes that must not become KV: truncated, flipped, inconsistent, or another key's entry."""


def storage_suffix(quant: str) -> str:
    """Namespace of an entry in a tier: exact and int8 entries of one chunk never share a name."""
    return "" if quant == "none" else f"@{quant}"


def key_in_namespace(stem: str, suffix: str) -> str | None:
    """The chunk key of a stored name stem (suffix included) if it belongs to this namespace, else None."""
    if suffix:
        return stem[: -len(suffix)] if stem.endswith(suffix) else None
    return None if "@" in stem else stem


def deployment_secret(secret: str | bytes | None = None) -> bytes | None:
    """The HMAC key of shared tiers: `secret` when given, else $EPIC_RAG_KV_SECRET; None (sha256 only) when
    neither is set or it is empty."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
    if not secret:
        return None
    return secret.encode() if isinstance(secret, str) else bytes(secret)


# --------------------------------------------------------------------------- int8 packing
def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-per-head absmax: x [L, T, H, D] -> (q int8 [L, T, H, D], scale float32 [L, T, H, 1]).

    |x - q * scale| <= scale / 2 = absmax / 254 elementwise (before casting back to x's dtype)."""
    xf = x.detach().to(torch.float32)
    if not torch.isfinite(xf).all():
        raise ValueError("cannot int8-pack KV holding inf/nan")
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.0  # scale: [L, T, H, 1]
    q = torch.round(xf / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(-127, 127)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.to(torch.float32) * scale).to(dtype)


# --------------------------------------------------------------------------- pack / unpack (no bytes)
def pack(kv: ChunkKV, quant: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The header and tensors of an entry, in the tier's quant mode (tensors contiguous, on CPU)."""
    check_quant(quant)
    dtype = _TORCH_TO_NAME.get(kv.k.dtype)
    if dtype is None:
        raise ValueError(f"unsupported KV dtype {kv.k.dtype}; expected one of {sorted(_KV_DTYPES)}")
    k = kv.k.detach().cpu().contiguous()
    v = kv.v.detach().cpu().contiguous()
    tensors: dict[str, torch.Tensor] = {"token_ids": torch.tensor(kv.token_ids, dtype=torch.int64)}
    if quant == "none":
        tensors["k"], tensors["v"] = k, v
    else:
        tensors["k_q"], tensors["k_scale"] = quantize_int8(k)
        tensors["v_q"], tensors["v_scale"] = quantize_int8(v)
    meta = {
        "format": FORMAT,
        "key": kv.key,
        "quant": quant,
        "dtype": dtype,
        "shape": list(k.shape),
        "base_pos": int(kv.base_pos),
        "lead": kv.lead,
        "tenant": kv.tenant,
    }
    return meta, tensors


def _expected(meta: dict) -> dict[str, tuple[torch.dtype, list[int]]]:
    L, T, H, D = meta["shape"]
    kv_dtype = _KV_DTYPES[meta["dtype"]]
    exp = {"token_ids": (torch.int64, [T])}
    if meta["quant"] == "none":
        exp["k"] = exp["v"] = (kv_dtype, [L, T, H, D])
    else:
        exp["k_q"] = exp["v_q"] = (torch.int8, [L, T, H, D])
        exp["k_scale"] = exp["v_scale"] = (torch.float32, [L, T, H, 1])
    return exp


def _check_meta(meta, key: str, quant: str) -> None:
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptEntry(f"not an {FORMAT} entry")
    if meta.get("key") != key:
        raise CorruptEntry(f"entry holds key {meta.get('key')!r}, not the requested {key!r}")
    if meta.get("quant") != quant:
        raise CorruptEntry(f"entry is quant={meta.get('quant')!r}, this tier reads quant={quant!r}")
    if meta.get("dtype") not in _KV_DTYPES:
        raise CorruptEntry(f"entry has unknown KV dtype {meta.get('dtype')!r}")
    shape = meta.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != 4
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
    ):
        raise CorruptEntry(f"entry has a bad shape {shape!r}")
    if not isinstance(meta.get("base_pos"), int) or meta["base_pos"] < 0:
        raise CorruptEntry("entry has a bad base_pos")
    for name in ("lead", "tenant"):  # absent in entries written before records carried their context
        if not isinstance(meta.get(name, ""), str) or not _HEX.fullmatch(meta.get(name, "")):
            raise CorruptEntry(f"entry has a bad {name} id")


def unpack(meta: dict, tensors: dict[str, torch.Tensor], key: str, quant: str) -> ChunkKV:
    """Rebuild the ChunkKV (dequantized to the model dtype), checking every tensor against the header."""
    _check_meta(meta, key, quant)
    exp = _expected(meta)
    if set(tensors) != set(exp):
        raise CorruptEntry(f"entry tensors {sorted(tensors)} != expected {sorted(exp)}")
    for name, (dt, shape) in exp.items():
        t = tensors[name]
        if t.dtype != dt or list(t.shape) != shape:
            raise CorruptEntry(f"tensor {name} is {t.dtype}{list(t.shape)}, header says {dt}{shape}")
    kv_dtype = _KV_DTYPES[meta["dtype"]]
    if quant == "none":
        k, v = tensors["k"], tensors["v"]
    else:
        k = dequantize_int8(tensors["k_q"], tensors["k_scale"], kv_dtype)
        v = dequantize_int8(tensors["v_q"], tensors["v_scale"], kv_dtype)
    try:
        return ChunkKV(
            key=key,
            token_ids=tensors["token_ids"].tolist(),
            k=k,
            v=v,
            base_pos=meta["base_pos"],
            quant=quant,
            lead=meta.get("lead", ""),
            tenant=meta.get("tenant", ""),
        )
    except ValueError as e:
        raise CorruptEntry(str(e)) from e


def packed_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


# --------------------------------------------------------------------------- bytes
def _tensor_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())


def _digest(meta: dict, chunks, secret: bytes | None = None) -> str:
    """sha256 (or HMAC-SHA256 under `secret`) of the canonical header and the tensors' bytes."""
    head = json.dumps({k: v for k, v in meta.items() if k not in _CHECKSUMS}, sort_keys=True, separators=(",", ":"))
    h = hmac.new(secret, digestmod=hashlib.sha256) if secret else hashlib.sha256()
    h.update(head.encode())
    for name, data in chunks:
        h.update(name.encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def encode(kv: ChunkKV, quant: str = "none", secret: bytes | None = None) -> bytes:
    """An entry's bytes: safetensors whose metadata carries the JSON header and checksum (and, under a
    deployment secret, its HMAC)."""
    meta, tensors = pack(kv, quant)
    meta["sha256"] = _digest(meta, ((n, _tensor_bytes(tensors[n])) for n in sorted(tensors)))
    if secret:
        meta["hmac"] = _digest(meta, ((n, _tensor_bytes(tensors[n])) for n in sorted(tensors)), secret)
    return st_save(tensors, metadata={"epic": json.dumps(meta, sort_keys=True)})


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of the JSON text `raw` nest (brackets inside strings do not count),
    without parsing it: linear time, no recursion."""
    depth = deepest = 0
    for c in _JSON_STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS):
        depth += 1 if c in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def loads_bounded(raw: bytes | str, what: str, max_depth: int = MAX_JSON_DEPTH):
    """json.loads of `raw`, refused (CorruptEntry) when it nests deeper than `max_depth` or does not parse."""
    if not isinstance(raw, (str, bytes, bytearray, memoryview)):
        raise CorruptEntry(f"{what} is not JSON text")
    data = raw.encode() if isinstance(raw, str) else bytes(raw)
    if json_depth(data) > max_depth:
        raise CorruptEntry(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # (RecursionError: the depth check above should make it moot)
        raise CorruptEntry(f"{what} is unreadable ({type(e).__name__}: {e})") from e


def header_length(buf) -> int:
    """The safetensors header's length, from an entry's first 8 bytes; raises CorruptEntry."""
    view = memoryview(buf)
    if len(view) < 8:
        raise CorruptEntry(f"entry is {len(view)} bytes, too short for a header")
    (hlen,) = struct.unpack("<Q", view[:8])
    if hlen > _MAX_HEADER:
        raise CorruptEntry(f"entry header length {hlen} is over the {_MAX_HEADER}-byte limit")
    return hlen


def read_header(buf) -> tuple[dict, dict]:
    """(safetensors tensor table, epic header) of an entry's bytes (its first 8 + header length bytes
    suffice); raises CorruptEntry."""
    view = memoryview(buf)
    hlen = header_length(view)
    if 8 + hlen > len(view):
        raise CorruptEntry(f"entry header length {hlen} does not fit its {len(view)} bytes (truncated?)")
    table = loads_bounded(view[8 : 8 + hlen], "entry header")
    try:
        meta = loads_bounded(table.pop("__metadata__")["epic"], "entry header")
    except (KeyError, TypeError, AttributeError) as e:
        raise CorruptEntry(f"entry header is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(table, dict) or not isinstance(meta, dict):
        raise CorruptEntry("entry header is not a JSON object")
    return table, meta


def decode(buf: bytes | bytearray | memoryview, key: str, quant: str = "none", secret: bytes | None = None) -> ChunkKV:
    """The ChunkKV in `buf`, after checking header, offsets, key, quant, dtypes, shapes and checksum (the
    HMAC under `secret`: an entry without a valid one is refused).

    Raises CorruptEntry for anything else, whatever went wrong (a reader drops the entry and misses: bytes
    that trip an unforeseen error are no better than bytes that fail a check); never builds a tensor from
    unchecked bytes. A writable buffer (bytearray) is used without a copy."""
    try:
        return _decode(buf, key, quant, secret)
    except CorruptEntry:
        raise
    except Exception as e:
        raise CorruptEntry(f"entry does not decode ({type(e).__name__}: {e})") from e


def _decode(buf, key: str, quant: str, secret: bytes | None) -> ChunkKV:
    table, meta = read_header(buf)
    _check_meta(meta, key, quant)
    exp = _expected(meta)
    if set(table) != set(exp):
        raise CorruptEntry(f"entry tensors {sorted(table)} != expected {sorted(exp)}")
    view = memoryview(buf)
    hlen = struct.unpack("<Q", view[:8])[0]
    data = view[8 + hlen :]
    spans, end_max = {}, 0
    inv = {v: k for k, v in _ST_DTYPES.items()}
    for name, (dt, shape) in exp.items():
        info = table[name]
        try:
            begin, end = (int(x) for x in info["data_offsets"])
            st_dtype, st_shape = info["dtype"], list(info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptEntry(f"tensor {name} has a bad header entry") from e
        if st_dtype != inv[dt] or st_shape != shape:
            raise CorruptEntry(f"tensor {name} is {st_dtype}{st_shape}, header says {inv[dt]}{shape}")
        n = dt.itemsize
        for s in shape:
            n *= s
        if not 0 <= begin <= end <= len(data) or end - begin != n:
            raise CorruptEntry(
                f"tensor {name} bytes [{begin}, {end}) do not fit {len(data)} data bytes "
                f"or its {n}-byte size (truncated?)"
            )
        spans[name] = (begin, end)
        end_max = max(end_max, end)
    if end_max != len(data):
        raise CorruptEntry(f"entry has {len(data) - end_max} stray bytes after its tensors")
    field = "hmac" if secret else "sha256"
    want = meta.get(field)
    if secret and not isinstance(want, str):
        raise CorruptEntry("entry is not signed with the deployment secret (no hmac)")
    got = _digest(meta, ((name, data[spans[name][0] : spans[name][1]]) for name in sorted(spans)), secret)
    if not isinstance(want, str) or not hmac.compare_digest(want, got):
        raise CorruptEntry(f"{field} mismatch (stored {str(want)[:12]}..., computed {got[:12]}...)")
    if isinstance(buf, bytes):
        buf = bytearray(buf)  # torch.frombuffer wants writable memory; tensors then own this copy
        data = memoryview(buf)[8 + hlen :]
    tensors = {}
    for name, (dt, shape) in exp.items():
        begin, end = spans[name]
        t = (
            torch.frombuffer(data, dtype=dt, count=(end - begin) // dt.itemsize, offset=begin)
            if end > begin
            else torch.empty(0, dtype=dt)
        )
        tensors[name] = t.view(shape)
    return unpack(meta, tensors, key, quant)


def head_of(header: bytes | bytearray, read: Callable[[int, int], bytes], key: str, quant: str) -> RecordHead:
    """The RecordHead of an entry from its first 8 + header-length bytes and `read(begin, n)`, which returns n
    bytes at offset `begin` of its data (after the header): only the token ids are read. Raises CorruptEntry."""
    table, meta = read_header(header)
    _check_meta(meta, key, quant)
    T = meta["shape"][1]
    info = table.get("token_ids")
    try:
        begin, end = (int(x) for x in info["data_offsets"])
        ok = info["dtype"] == "I64" and list(info["shape"]) == [T] and end - begin == 8 * T and begin >= 0
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptEntry("token_ids has a bad header entry") from e
    if not ok:
        raise CorruptEntry("token_ids disagrees with the header")
    raw = read(begin, 8 * T)
    if len(raw) != 8 * T:
        raise CorruptEntry("token_ids is truncated")
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.int64).tolist() if T else []
    return RecordHead(key, tokens, meta.get("tenant", ""), meta.get("lead", ""), meta["base_pos"])


def encode_for_tier(tier: ChunkStore, kv: ChunkKV, report: Callable[[str], None]) -> bytes | None:
    """kv serialised in `tier.quant` for a shared tier, or None when it must not or cannot go there:
    lossy values never enter an exact tier; a value that cannot be encoded is counted and reported."""
    if kv.quant != "none" and tier.quant == "none":
        return None
    try:
        return encode(kv, tier.quant, tier.secret)
    except ValueError as e:
        with tier._lock:
            tier.stats.errors += 1
        report(f"not storing chunk {kv.key}: {e}")
        return None
