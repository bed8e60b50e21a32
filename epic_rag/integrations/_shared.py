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
from ..sampling import CORE_OPTIONS, SAMPLING_OPTIONS, check_sampling_options
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
    "escalated",
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


# Options the wrappers take per call and as fields: the engine's, plus OpenAI's `top_logprobs` (with
# `logprobs=True`, as ChatOpenAI / LlamaIndex's OpenAI take them; an integer `logprobs` is vLLM's form).
WRAPPER_OPTIONS = CORE_OPTIONS + SAMPLING_OPTIONS + ("top_logprobs",)


def option_defaults(wrapper: Any, extra: dict[str, Any] | None) -> dict[str, Any]:
    """A wrapper's sampling-option fields (None: vLLM's default) merged over its extra-options dict
    (ChatEpic.model_kwargs, EpicLLM.additional_kwargs); an unknown key there is an error naming it."""
    extra = dict(extra or {})
    unknown = [k for k in extra if k not in SAMPLING_OPTIONS + ("top_logprobs",)]
    if unknown:
        raise ValueError(
            f"unsupported sampling option {unknown[0]!r} (supported: {', '.join(SAMPLING_OPTIONS)}, top_logprobs)"
        )
    fields = {k: getattr(wrapper, k, None) for k in SAMPLING_OPTIONS + ("top_logprobs",)}
    return {**extra, **{k: v for k, v in fields.items() if v is not None}}


def _engine_logprobs(logprobs: Any, top: Any) -> int | None:
    """OpenAI's (logprobs: bool, top_logprobs: int) or vLLM's (logprobs: int) as the engine's logprobs."""
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        raise ValueError(f"top_logprobs must be an integer, got {top!r}")
    if logprobs is False:
        if top:
            raise ValueError("top_logprobs needs logprobs=True")
        return None
    if logprobs is True:
        return top or 0
    if logprobs is None:
        return top  # top_logprobs alone asks for them
    if top is not None:
        raise ValueError("give top_logprobs with logprobs=True, or an integer logprobs alone")
    return logprobs  # vLLM's form (checked by the engine)


def sampling_of(
    wrapper: Any,
    kwargs: dict[str, Any],
    stop: list[str] | None = None,
    *,
    defaults: dict[str, Any] | None = None,
    passthrough: tuple[str, ...] = (),
) -> Sampling:
    """A call's sampling keywords over a wrapper's defaults (its max_tokens, temperature, policy, stop and
    the further options in `defaults`). A keyword that is neither a sampling option nor in `passthrough` (the
    wrapper's own, e.g. LangChain's `chunks`) is an error naming it: nothing is dropped silently."""
    unknown = [k for k in kwargs if k not in WRAPPER_OPTIONS and k not in passthrough]
    if unknown:
        raise ValueError(
            f"{type(wrapper).__name__}: unsupported option {unknown[0]!r} "
            f"(supported: {', '.join(WRAPPER_OPTIONS + passthrough)})"
        )
    stop = stop or kwargs.get("stop") or wrapper.stop
    options = {**(defaults or {}), **{k: kwargs[k] for k in SAMPLING_OPTIONS + ("top_logprobs",) if k in kwargs}}
    top = options.pop("top_logprobs", None)
    options["logprobs"] = _engine_logprobs(options.get("logprobs"), top)
    out = Sampling(
        max_tokens=int(kwargs.get("max_tokens") or wrapper.max_tokens),
        temperature=float(kwargs.get("temperature", wrapper.temperature)),
        policy=kwargs.get("policy", wrapper.policy),
        stop=list(stop) if stop else None,
    )
    out.update(check_sampling_options(options))  # type: ignore[typeddict-item]
    return out


def usage_of(g: Generation) -> dict[str, Any]:
    """OpenAI-shaped token usage of one Generation; linked prompt tokens count as cached."""
    n = len(g.token_ids)
    return {
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": g.prompt_tokens + n,
        "prompt_tokens_details": {"cached_tokens": g.linked_tokens},
    }


def openai_logprobs(g: Generation) -> dict[str, Any] | None:
    """A Generation's logprobs in OpenAI's chat shape: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if g.logprobs is None:
        return None
    return {"content": [openai_token_logprob(t) for t in g.logprobs]}


def openai_token_logprob(t: dict[str, Any], top: bool = True) -> dict[str, Any]:
    out = {"token": t["token"], "logprob": t["logprob"], "bytes": list(t["token"].encode("utf-8"))}
    if top:
        out["top_logprobs"] = [openai_token_logprob(a, top=False) for a in t["top_logprobs"]]
    return out


def generation_stats(g: Generation) -> dict[str, Any]:
    """The linking figures of one Generation, as a plain dict."""
    out = {k: getattr(g, k) for k in STAT_KEYS}
    out["finish_reason"] = g.finish_reason
    out["completion_tokens"] = len(g.token_ids)
    out["chunk_keys"] = list(g.chunk_keys)
    return out
