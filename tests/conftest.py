"""Shared fixtures. vLLM keeps process-global state (one KV connector per process), so each pytest
process holds at most one engine: `make test` runs the tiny-model, SmolLM2 and Qwen tests as three sessions
(`-m "not smollm and not qwen"`, `-m smollm`, `-m qwen`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture
def interpreted(monkeypatch):
    """The fused link kernel under Triton's interpreter (CPU tensors); reloaded as it was afterwards."""
    import importlib

    from epic_rag.engine.link import kernels

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    importlib.reload(kernels)
    yield
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    importlib.reload(kernels)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from epic_rag.paths import cache_dir
    from epic_rag.testing.tiny_model import build_tiny_model

    return build_tiny_model(cache_dir() / "test-models" / "tiny-llama-v1")


@pytest.fixture(scope="session")
def tiny_engine(tiny_model_dir):
    from epic_rag import EngineConfig, EpicEngine

    eng = EpicEngine(
        EngineConfig(
            model=str(tiny_model_dir),
            policy="legolink-16",
            max_model_len=2048,
            max_num_seqs=8,
            kv_cache_gib=1,
            dtype="float32",
        )
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def smol_engine():
    from epic_rag import EngineConfig, EpicEngine

    eng = EpicEngine(
        EngineConfig(
            model="smollm2-135m-instruct",
            policy="legolink-16",
            max_model_len=8192,
            max_num_seqs=8,
            kv_cache_gib=2,
            dtype="float32",
        )
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def tiny_serve(tmp_path_factory):
    """One stock `vllm serve` with EpicConnector on the one-layer tiny model for the session's serve tests (each
    test its own tenant namespace): (url, tokenizer, server log)."""
    from _tiny_serve import serve_tiny

    yield from serve_tiny(tmp_path_factory, "serve")


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One loopback redis-server for the session's Redis tests (skipped where the binary is missing)."""
    from epic_rag.testing.localredis import LocalRedis

    with LocalRedis(tmp_path_factory.mktemp("redis")) as r:
        yield r


@pytest.fixture
def url(server, request):
    """The server's URL with a per-test key prefix, so tests never see each other's keys."""
    prefix = f"t{abs(hash(request.node.nodeid)) % 10**10}:"
    return f"{server.url}?prefix={prefix}&timeout=1&retry_s=0.5"
