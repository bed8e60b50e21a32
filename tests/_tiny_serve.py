"""Stock `vllm serve` with EpicConnector on the one-layer tiny model, for the serve and red-team tests."""

from __future__ import annotations

from collections.abc import Iterator

from _engine_process import ROOT

# three small functions, each a chunk of its own
CHUNKS = [
    f"def scale_{i}(values, k={i}):\n    out = []\n    for v in values:\n        out.append(v * k + {i * i})\n"
    f"    return out\n"
    for i in range(3)
]


def serve_tiny(
    tmp_path_factory,
    label: str,
    args: list[str] | None = None,
    env: dict | None = None,
    layers: int = 1,
    extra: dict | None = None,
) -> Iterator:
    """Start stock `vllm serve` with EpicConnector on the tiny model (one layer unless `layers`; store in memory,
    the finder on for every request with legolink-0, unless `extra` sets other connector options) as the serve
    benchmark starts it; yields (url, tokenizer, server log)."""
    from transformers import AutoTokenizer

    from epic_rag.bench.serve import start_server, stop_server
    from epic_rag.paths import cache_dir
    from epic_rag.testing.tiny_model import build_tiny_model

    name = "tiny-llama-1layer" if layers == 1 else f"tiny-llama-{layers}layer"
    model = build_tiny_model(cache_dir() / "test-models" / name, layers=layers)
    log = tmp_path_factory.mktemp(label) / "server.log"
    proc, url = start_server(
        str(model),
        2048,
        {"store": "memory", "find_chunks": "legolink-0", **(extra or {})},
        served_name="tiny",
        args=args or [],
        env={"PYTHONPATH": str(ROOT), **(env or {})},
        kv_cache_gib=1,
        log_path=log,
        timeout_s=600,
    )
    try:
        yield url, AutoTokenizer.from_pretrained(model), log
    finally:
        stop_server(proc)
