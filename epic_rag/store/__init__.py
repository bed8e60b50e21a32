"""Chunk KV store: tiers behind one interface, opened from a spec string."""
from .base import ChunkKV, ChunkStore, TierStats
from .memory import MemoryStore


def open_store(spec: str | ChunkStore) -> ChunkStore:
    """Open a store from a spec: "memory" or "memory:<bytes>" (more tiers: see epic_rag.store.spec)."""
    if isinstance(spec, ChunkStore):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("store spec must be a non-empty string such as 'memory'")
    head, _, arg = spec.strip().partition(":")
    if head == "memory":
        return MemoryStore(int(arg)) if arg else MemoryStore()
    raise ValueError(f"unknown store spec {spec!r}; expected 'memory' or 'memory:<bytes>'")


__all__ = ["ChunkKV", "ChunkStore", "TierStats", "MemoryStore", "open_store"]
