"""The demo's on-disk embedding cache: one .npy per document chunk, keyed by the encoder and the text (another
encoder's vectors are never read back), owner-only, bounded in bytes (beyond the budget nothing more is kept:
embeddings are computed again when needed)."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import numpy as np

from .uploads import private_dir

log = logging.getLogger(__name__)


class EmbeddingCache:
    def __init__(self, data_dir: Path, max_bytes: int) -> None:
        self.data_dir, self.dir, self.max_bytes = data_dir, data_dir / "embeddings", max_bytes
        self._bytes: int | None = None  # the cache's size, scanned at its first write

    @staticmethod
    def key(encoder_id: str, text: str) -> str:
        return hashlib.sha256(encoder_id.encode() + b"\0" + text.encode()).hexdigest()[:32]

    def load(self, key: str) -> np.ndarray | None:
        try:
            return np.load(self.dir / f"{key}.npy")
        except (OSError, ValueError):
            return None

    def save(self, key: str, vec: np.ndarray) -> None:
        """Cache one embedding (owner-only folder and file), while the cache is under its byte budget."""
        try:
            if self._bytes is None:
                private_dir(self.data_dir)
                private_dir(self.dir)
                self._bytes = sum(p.stat().st_size for p in self.dir.glob("*.npy"))
            if self._bytes >= self.max_bytes:
                return
            tmp = self.dir / f".{key}.{threading.get_ident()}.npy"
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                np.save(f, vec)
            size = tmp.stat().st_size
            os.replace(tmp, self.dir / f"{key}.npy")
            self._bytes += size
        except OSError as e:
            log.debug("embedding cache write failed: %s", e)
