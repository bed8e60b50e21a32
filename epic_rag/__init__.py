"""epic_rag: position-independent KV caching (EPIC compile + LegoLink link) on an embedded vLLM engine."""

from .config import EngineConfig
from .policy import Policy, parse_policy
from .types import Chunk, ChunkRef, Delta, Generation, RagRequest, Segment

__all__ = [
    "EpicEngine",
    "EngineConfig",
    "RagRequest",
    "Generation",
    "Delta",
    "ChunkRef",
    "Chunk",
    "Segment",
    "Policy",
    "parse_policy",
]


def __getattr__(name: str):
    # Importing vLLM takes ~20 s: load the engine only when it is asked for.
    if name == "EpicEngine":
        from .engine import EpicEngine

        return EpicEngine
    raise AttributeError(name)
