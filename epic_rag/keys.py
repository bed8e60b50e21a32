"""Chunk keys: content-derived addresses of compiled chunk KV in the store.

A key covers everything a chunk's KV depends on: the model (config + weight bytes), the tokenizer, the KV
dtype (together: the fingerprint), the compile variant and the chunk's tokens. Another model, tokenizer or
dtype can therefore never hit old KV.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def kv_fingerprint(model_fp: str, tokenizer_fp: str, kv_dtype: str) -> str:
    """What a chunk's KV depends on besides its tokens and compile variant."""
    return hashlib.sha256(f"{model_fp}|{tokenizer_fp}|{kv_dtype}".encode()).hexdigest()


def chunk_key(fingerprint: str, token_ids: Sequence[int], variant: str = "plain") -> str:
    """`<variant>-<40 hex>`: sha256 over the fingerprint, the variant and the tokens as int64."""
    h = hashlib.sha256(fingerprint.encode())
    h.update(variant.encode())
    h.update(array("q", token_ids).tobytes())
    return f"{variant}-{h.hexdigest()[:40]}"


def compile_variant(lead: Sequence[int]) -> str:
    """The compile variant of chunks compiled behind `lead` (their keys' prefix): another template or
    instruction never hits these records. The sink alone keeps its historic name, "sink1"."""
    from .policy import SINK_LEN

    digest = hashlib.sha256(array("q", lead).tobytes()).hexdigest()[:8]
    return f"sink{SINK_LEN}" if len(lead) == SINK_LEN else f"lead{digest}"


def rank_key(key: str, rank: int, size: int) -> str:
    """The name a tensor-parallel rank keeps its share of a record under (the key itself on one rank)."""
    return key if size == 1 else f"{key}.tp{size}r{rank}"


def record_key(fingerprint: str, kv) -> str:
    """The key a stored record's own tokens hash to under `fingerprint`: a chunk record (any variant but
    "plain") holds its sink token(s) before the chunk's tokens, which are not part of its key. A tensor-
    parallel rank's record keeps its rank suffix (".tp<size>r<rank>")."""
    from .policy import SINK_LEN

    base, dot, rank = kv.key.partition(".")
    variant = base.partition("-")[0]
    ids = kv.token_ids if variant == "plain" else kv.token_ids[SINK_LEN:]
    return chunk_key(fingerprint, ids, variant) + dot + rank
