"""The embedded vLLM engine with the LegoLink connector."""

__all__ = ["EpicEngine"]


def __getattr__(name: str):
    # EpicEngine pulls in the engine's whole stack: load it only when asked for, so the torch-only
    # modules (rope, layout, linker) import on a machine without vLLM (scripts/device_check.py).
    if name == "EpicEngine":
        from .engine import EpicEngine

        return EpicEngine
    raise AttributeError(name)
