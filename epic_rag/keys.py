"""Chunk keys: content-derived addresses of compiled chunk KV in the store.

A key covers everything a record's KV depends on: the model (config + weight bytes), the tokenizer, the KV
dtype (together: the fingerprint), the whole compile lead the chunk was computed behind (its full sha256),
the tenant namespace it belongs to and the record's tokens. Another model, tokenizer, dtype, lead or tenant
can therefore never hit a record. A record carries its lead's and tenant's ids, so a reader recomputes its
key from the record alone (`record_key`) and refuses one filed under another key.

Keys read `<variant>-<40 hex>`: the variant is a label for people ("plain" for a bare compile, "sink1" for a
chunk behind the sink alone, "lead<first 8 hex of the lead's hash>" otherwise); the 40 hex digits (160 bits
of sha256) commit to all of the above, the lead's hash in full.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DEFAULT_TENANT = ""  # the namespace of requests that name none


def kv_fingerprint(model_fp: str, tokenizer_fp: str, kv_dtype: str) -> str:
    """What a chunk's KV depends on besides its tokens, lead and tenant."""
    return hashlib.sha256(f"{model_fp}|{tokenizer_fp}|{kv_dtype}".encode()).hexdigest()


def tenant_id(namespace: str) -> str:
    """A tenant namespace as keys and records carry it: its sha256 (a namespace may be a tenant's secret, a
    vLLM cache_salt: never stored or logged as it is)."""
    return hashlib.sha256(b"epic-rag tenant\0" + namespace.encode()).hexdigest()


def lead_id(lead: Sequence[int]) -> str:
    """A compile lead's whole sha256 over its tokens as int64; "" for none (a bare compile)."""
    return hashlib.sha256(array("q", lead).tobytes()).hexdigest() if len(lead) else ""


def compile_variant(lead: Sequence[int]) -> str:
    """The label of keys of chunks compiled behind `lead`: "plain" without one, "sink1" behind the sink alone,
    else "lead" and the first 8 hex digits of the lead's hash."""
    from .policy import SINK_LEN

    if not len(lead):
        return "plain"
    return f"sink{SINK_LEN}" if len(lead) == SINK_LEN else f"lead{lead_id(lead)[:8]}"


def _variant(lead: str, record_tokens: Sequence[int]) -> str:
    """compile_variant, from a lead's id and the record's tokens (whose first token is the lead's first)."""
    from .policy import SINK_LEN

    if not lead:
        return "plain"
    return f"sink{SINK_LEN}" if lead == lead_id(record_tokens[:SINK_LEN]) else f"lead{lead[:8]}"


def key_of(fingerprint: str, tenant: str, lead: str, record_tokens: Sequence[int]) -> str:
    """The key of a record: `tenant` and `lead` are ids (tenant_id, lead_id), `record_tokens` the record's
    own tokens (a chunk record: the lead's sink token(s), then the chunk; a bare compile: its prompt)."""
    h = hashlib.sha256(fingerprint.encode())
    h.update(b"\0" + tenant.encode() + b"\0" + lead.encode() + b"\0")
    h.update(array("q", record_tokens).tobytes())
    return f"{_variant(lead, record_tokens)}-{h.hexdigest()[:40]}"


def record_tokens_of(chunk: Sequence[int], lead: Sequence[int]) -> list[int]:
    """A record's tokens: the lead's sink token(s) and the chunk; a bare compile's chunk as it is."""
    from .policy import SINK_LEN

    return list(lead[:SINK_LEN]) + list(chunk)


def chunk_key(
    fingerprint: str, token_ids: Sequence[int], lead: Sequence[int] = (), tenant: str = DEFAULT_TENANT
) -> str:
    """The key of chunk `token_ids` compiled behind `lead` (none: a bare compile) for tenant namespace `tenant`."""
    return key_of(fingerprint, tenant_id(tenant), lead_id(lead), record_tokens_of(token_ids, lead))


def rank_key(key: str, rank: int, size: int) -> str:
    """The name a tensor-parallel rank keeps its share of a record under (the key itself on one rank)."""
    return key if size == 1 else f"{key}.tp{size}r{rank}"


def record_key(fingerprint: str, kv) -> str:
    """The key a stored record hashes to under `fingerprint`, from its own tenant, lead and tokens (a
    tensor-parallel rank's record keeps its rank suffix, ".tp<size>r<rank>")."""
    _, dot, rank = kv.key.partition(".")
    return key_of(fingerprint, kv.tenant, kv.lead, kv.token_ids) + dot + rank
