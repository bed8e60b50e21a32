"""One EpicEngine per process, shared by every framework wrapper.

vLLM keeps process-global state, so a process can hold one engine. Wrappers built without an engine get
the shared one, created on first use (not at construction: building a wrapper stays cheap). A wrapper
given an engine explicitly makes it the shared one when none is registered yet.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import EngineConfig
from ..types import Generation, Sampling

if TYPE_CHECKING:
    from ..engine import EpicEngine

_lock = threading.Lock()
_shared: "EpicEngine | None" = None

# Figures every framework response carries (LlamaIndex additional_kwargs / Response.metadata,
# LangChain response_metadata).
STAT_KEYS = (
    "ttft_s",
    "total_s",
    "prompt_tokens",
    "linked_tokens",
    "recomputed_tokens",
    "chunk_hits",
    "chunk_misses",
    "policy",
)


def model_label(engine: "EpicEngine") -> str:
    """The model name an engine serves, as given to its EngineConfig (a packaged name or a directory)."""
    return str(engine.config.model)


def _same_model(engine: "EpicEngine", model: str) -> bool:
    if model == engine.config.model:
        return True
    try:
        return Path(model).expanduser().resolve() == Path(engine.model_dir).resolve()
    except (OSError, ValueError):
        return False


def set_shared_engine(engine: "EpicEngine | None") -> None:
    """Register `engine` as the process's shared engine (None forgets it; the engine is not shut down)."""
    global _shared
    with _lock:
        _shared = engine


def adopt_engine(engine: "EpicEngine") -> "EpicEngine":
    """Make an explicitly given engine the shared one if none is registered yet."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = engine
    return engine


def shared_engine(model: str | None = None, config: EngineConfig | None = None) -> "EpicEngine":
    """The shared engine, created on first call from `config` (or EngineConfig(model=model))."""
    global _shared
    with _lock:
        if _shared is None:
            from ..engine import EpicEngine

            if config is None:
                config = EngineConfig(model=model) if model else EngineConfig()
            _shared = EpicEngine(config)
        elif model and not _same_model(_shared, model):
            raise ValueError(
                f"this process's engine serves {model_label(_shared)!r}, not {model!r} "
                "(vLLM allows one engine per process)"
            )
        return _shared


def peek_shared_engine() -> "EpicEngine | None":
    return _shared


def sampling_of(wrapper: Any, kwargs: dict[str, Any], stop: list[str] | None = None) -> Sampling:
    """A call's sampling keywords over a wrapper's defaults (its max_tokens, temperature, policy, stop)."""
    stop = stop or kwargs.get("stop") or wrapper.stop
    return Sampling(
        max_tokens=int(kwargs.get("max_tokens") or wrapper.max_tokens),
        temperature=float(kwargs.get("temperature", wrapper.temperature)),
        policy=kwargs.get("policy", wrapper.policy),
        stop=list(stop) if stop else None,
    )


def generation_stats(g: Generation) -> dict[str, Any]:
    """The linking figures of one Generation, as a plain dict."""
    out = {k: getattr(g, k) for k in STAT_KEYS}
    out["finish_reason"] = g.finish_reason
    out["completion_tokens"] = len(g.token_ids)
    out["chunk_keys"] = list(g.chunk_keys)
    return out
