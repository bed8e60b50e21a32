"""Where epic_rag keeps its files (the cache root) and where installed data packages live."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path


def cache_dir() -> Path:
    """Root of converted models, fingerprints, test models and the demo's data (EPIC_RAG_CACHE overrides)."""
    root = os.environ.get("EPIC_RAG_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "epic_rag")
    return Path(root)


def package_dir(package: str, needed_for: str, pip_args: str = "") -> Path:
    """Folder of an installed data package, located without importing it (some pull heavy imports).
    Raises ValueError naming the pip command when it is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ValueError(f"{needed_for} needs the package {dist} (pip install {pip_args}{dist})")
    return Path(spec.submodule_search_locations[0])
