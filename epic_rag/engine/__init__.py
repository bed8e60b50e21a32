"""The embedded vLLM engine with the LegoLink connector."""

from .engine import EpicEngine

__all__ = ["EpicEngine"]
