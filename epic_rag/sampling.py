"""Sampling options beyond max_tokens/temperature/stop/policy: checked here, passed to vLLM's SamplingParams
(cache_salt: to the request's prompt, under the engine's tenant).

Every option is named in SAMPLING_OPTIONS; anything else is an error that names it (nothing is dropped).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

# vLLM's own default cap on logprobs per token (ModelConfig.max_logprobs).
MAX_LOGPROBS = 20
# Seeds are torch generator seeds (a signed 64-bit integer).
SEED_RANGE = (-(2**63), 2**63 - 1)

# The core keywords every generate/stream method takes (see types.Sampling).
CORE_OPTIONS = ("max_tokens", "temperature", "policy", "stop")
# Further options, passed to vLLM as they are once checked.
SAMPLING_OPTIONS = (
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "response_format",
    "min_tokens",
    "ignore_eos",
    "skip_special_tokens",
    "cache_salt",
)
MAX_SALT = 256


def _number(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number, got {v!r}")
    return float(v)


def _integer(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return v


def check_response_format(v: Any) -> dict[str, Any] | None:
    """OpenAI's `response_format`: {"type": "text"} (None: unconstrained), {"type": "json_object"} (any JSON
    object) or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}; vLLM
    constrains decoding to it (its structured outputs, request_inputs)."""
    if not isinstance(v, Mapping) or not isinstance(v.get("type"), str):
        raise ValueError(f"response_format must be a dict with a 'type', got {v!r}")
    kind = v["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = v.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, Mapping):
            raise ValueError("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}")
        return {"type": "json_schema", "json_schema": {**spec, "schema": dict(schema)}}
    raise ValueError(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def check_sampling_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options given (None values left out), checked; raises ValueError naming an unknown option or a
    bad value."""
    out: dict[str, Any] = {}
    for name, v in options.items():
        if name not in SAMPLING_OPTIONS:
            known = ", ".join(CORE_OPTIONS + SAMPLING_OPTIONS)
            raise ValueError(f"unsupported sampling option {name!r} (supported: {known})")
        if v is None:
            continue
        if name == "top_p":
            if not 0.0 < _number(name, v) <= 1.0:
                raise ValueError(f"top_p must be in (0, 1], got {v!r}")
        elif name == "top_k":
            if _integer(name, v) < -1:
                raise ValueError(f"top_k must be 0 or -1 (off) or at least 1, got {v!r}")
        elif name == "min_p":
            if not 0.0 <= _number(name, v) <= 1.0:
                raise ValueError(f"min_p must be in [0, 1], got {v!r}")
        elif name == "seed":
            if not SEED_RANGE[0] <= _integer(name, v) <= SEED_RANGE[1]:
                raise ValueError(f"seed must be a 64-bit signed integer, got {v!r}")
        elif name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= _number(name, v) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        elif name == "repetition_penalty":
            if _number(name, v) <= 0.0:
                raise ValueError(f"repetition_penalty must be greater than 0, got {v!r}")
        elif name == "logprobs":
            if not 0 <= _integer(name, v) <= MAX_LOGPROBS:
                raise ValueError(f"logprobs (top alternatives per token) must be in [0, {MAX_LOGPROBS}], got {v!r}")
        elif name == "min_tokens":
            if _integer(name, v) < 0:
                raise ValueError(f"min_tokens must be an integer >= 0, got {v!r}")
        elif name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be true or false, got {v!r}")
        elif name == "cache_salt":  # vLLM refuses salts with these characters; the engine adds its tenant
            if not isinstance(v, str) or not 0 < len(v) <= MAX_SALT or any(c in v for c in "/@\\"):
                raise ValueError(f"cache_salt must be 1-{MAX_SALT} characters without '/', '@' or '\\', got {v!r}")
        elif name == "response_format":
            v = check_response_format(v)
            if v is None:
                continue
        out[name] = v
    return out
