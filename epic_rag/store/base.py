"""The chunk KV store contract: what a tier must do, and the KV record it holds."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class ChunkKV:
    """Compiled KV of one chunk, for every layer.

    Keys are post-RoPE at positions base_pos .. base_pos+T-1 (as the engine computed them), so
    linking at real position p rotates them by p - base_pos.
    """

    key: str
    token_ids: list[int]
    k: torch.Tensor          # k: [L, T, Hkv, D]
    v: torch.Tensor          # v: [L, T, Hkv, D]
    base_pos: int = 0

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"k/v must both be [L, T, Hkv, D], got {tuple(self.k.shape)} / {tuple(self.v.shape)}")
        if self.k.shape[1] != len(self.token_ids):
            raise ValueError(f"KV holds {self.k.shape[1]} tokens but token_ids has {len(self.token_ids)}")
        if self.k.dtype != self.v.dtype:
            raise ValueError("k and v must share a dtype")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


@dataclass(slots=True)
class TierStats:
    """Counters one tier keeps; read by the CLI and the server's metrics."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    errors: int = 0
    bytes: int = 0
    entries: int = 0
    load_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in self.__slots__}


class ChunkStore(ABC):
    """One tier (or a stack of tiers) mapping chunk keys to ChunkKV.

    `get` never mutates stored data (a tier may update its LRU order); `put` overwrites an entry
    with the same key, which is safe because keys are content-derived. Implementations are
    thread-safe.
    """

    name: str = "store"

    def __init__(self) -> None:
        self.stats = TierStats()
        self._lock = threading.RLock()

    @abstractmethod
    def get(self, key: str) -> ChunkKV | None:
        """The entry, or None when missing or unreadable (a corrupt entry is dropped and counted)."""

    @abstractmethod
    def put(self, kv: ChunkKV) -> None:
        """Store an entry (write-through in stacks)."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove an entry; True when one was removed."""

    @abstractmethod
    def keys(self) -> list[str]:
        """All keys held (for `store ls`)."""

    def contains(self, key: str) -> bool:
        return key in set(self.keys())

    def clear(self) -> int:
        n = 0
        for key in self.keys():
            n += self.delete(key)
        return n

    def tier_stats(self) -> dict[str, dict[str, float]]:
        return {self.name: self.stats.as_dict()}

    def close(self) -> None:
        """Release connections/files."""
