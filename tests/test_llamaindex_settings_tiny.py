"""The README's LlamaIndex lines: `Settings.tokenizer = engine.tokenizer` makes LlamaIndex count tokens as the
engine does (its packing then agrees with the engine's context window)."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_index.core")


def test_settings_tokenizer_from_the_engine_counts_the_engines_tokens(tiny_engine):
    import llama_index.core
    from llama_index.core import Settings

    before = llama_index.core.global_tokenizer
    try:
        Settings.tokenizer = tiny_engine.tokenizer
        text = "def add(a, b):\n    return a + b\n"
        assert Settings.tokenizer(text) == tiny_engine.tokenizer.encode(text, add_special_tokens=False)
    finally:
        llama_index.core.global_tokenizer = before
