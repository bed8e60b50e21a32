"""epic_rag: position-independent KV caching for RAG (EPIC: chunks compiled once and linked in any order) on vLLM."""

__version__ = "0.1.0"  # the package version (pyproject.toml reads it from here)

from .config import EngineConfig
from .policy import Policy, parse_policy
from .types import Chunk, ChunkRef, Delta, Generation, RagRequest, Segment

__all__ = [
    "__version__",
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
