"""support.check_supported: each configuration the linker does not handle is refused at start-up, naming the
setting; a plain configuration (SmolLM2 on CPU) passes. Fake vLLM modules, no engine (and no vLLM import)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epic_rag.engine.connector.support import LinkUnsupported, check_supported

LAYERS, HKV, D, BLOCK = 4, 3, 64, 128  # SmolLM2-135M on CPU: 3 KV heads of 64, 128-token blocks (30 layers)


class RotaryEmbedding:
    """Stands in for vLLM's rotary module: what check_supported reads (class, rotary_dim, is_neox_style and
    the cos||sin table from `_compute_cos_sin_cache`)."""

    def __init__(self, rotary_dim: int = D, is_neox_style: bool = True, base: float = 10000.0) -> None:
        self.rotary_dim, self.is_neox_style, self.base = rotary_dim, is_neox_style, base

    def _compute_cos_sin_cache(self) -> torch.Tensor:
        inv = 1.0 / self.base ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32) / self.rotary_dim)
        ang = torch.outer(torch.arange(256, dtype=torch.float32), inv)  # [P, rot/2]
        return torch.cat((ang.cos(), ang.sin()), dim=-1)  # [P, rot]


class Llama3RotaryEmbedding(RotaryEmbedding):
    pass


def _attn(i: int, **over) -> SimpleNamespace:
    """vLLM's Attention as the CPU backend sets it up for a plain decoder layer; `impl_*` keys go to impl."""
    impl = dict(logits_soft_cap=0, alibi_slopes=None, sinks=None, sliding_window=-1, kv_sharing_target_layer_name=None)
    impl.update({k[5:]: over.pop(k) for k in list(over) if k.startswith("impl_")})
    fields = dict(
        layer_name=f"model.layers.{i}.self_attn.attn",
        num_heads=9,
        num_kv_heads=HKV,
        head_size=D,
        head_size_v=D,
        kv_cache_dtype="auto",
        sliding_window=None,
        has_sink=False,
        kv_sharing_target_layer_name=None,
        impl=SimpleNamespace(**impl),
    )
    fields.update(over)
    return SimpleNamespace(**fields)


def _cache(hkv: int = HKV, block: int = BLOCK, d: int = D, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.zeros((2, hkv, block, 2 * d), dtype=dtype)  # [num_blocks, num_kv_heads, block_size, 2 * head_size]


def _config(layer: int = 2, attn: dict | None = None, cache: dict | None = None, rotary=None):
    """SmolLM2's CPU configuration, with layer `layer` changed: its Attention fields, its cache or its rotary."""
    attns = [_attn(i, **(attn if i == layer and attn else {})) for i in range(LAYERS)]
    caches = {a.layer_name: _cache(**(cache if i == layer and cache else {})) for i, a in enumerate(attns)}
    shared = RotaryEmbedding()
    rotaries = [rotary if i == layer and rotary is not None else shared for i in range(LAYERS)]
    return attns, caches, rotaries


def _refused(match: str, attns, caches, rotaries, block_size: int = BLOCK) -> str:
    with pytest.raises(LinkUnsupported, match=match) as e:
        check_supported(attns, caches, rotaries, block_size)
    return str(e.value)


def test_smollm2_cpu_configuration_is_supported():
    # kv_cache_dtype "auto", an fp32 cache, no soft-cap/ALiBi/sinks/window, one rotary module for all layers
    check_supported(*_config(), BLOCK)


def test_float16_and_bfloat16_caches_and_an_explicit_float_kv_cache_dtype_are_supported():
    for dtype, name in ((torch.bfloat16, "bfloat16"), (torch.float16, "auto")):
        attns = [_attn(i, kv_cache_dtype=name) for i in range(LAYERS)]
        caches = {a.layer_name: _cache(dtype=dtype) for a in attns}
        check_supported(attns, caches, [RotaryEmbedding()] * LAYERS, BLOCK)


def test_separate_but_identical_rotary_modules_per_layer_are_supported():
    attns, caches, _ = _config()
    check_supported(attns, caches, [RotaryEmbedding() for _ in range(LAYERS)], BLOCK)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "nvfp4"])
def test_a_quantized_kv_cache_dtype_is_refused_naming_kv_cache_dtype(kv_dtype):
    msg = _refused("kv_cache_dtype", *_config(attn={"kv_cache_dtype": kv_dtype}, cache={"dtype": torch.uint8}))
    assert repr(kv_dtype) in msg and "model.layers.2.self_attn.attn" in msg


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn, torch.float64], ids=lambda d: str(d).split(".")[-1]
)
def test_a_cache_tensor_that_is_not_float16_bfloat16_or_float32_is_refused(dtype):
    # e.g. fp8 stored as uint8 with kv_cache_dtype left "auto" (a checkpoint's KV scheme): a plain cast is garbage
    _refused(f"stored as {dtype}", *_config(cache={"dtype": dtype}))


def test_logits_soft_capping_is_refused_naming_logits_soft_cap():
    _refused(r"logits_soft_cap=30\.0", *_config(attn={"impl_logits_soft_cap": 30.0}))


def test_a_soft_cap_of_none_means_no_soft_capping_and_is_supported():
    check_supported(*_config(attn={"impl_logits_soft_cap": None}), BLOCK)


def test_alibi_is_refused_naming_alibi_slopes():
    _refused("alibi_slopes", *_config(attn={"impl_alibi_slopes": torch.ones(9)}))


def test_attention_sinks_are_refused_naming_sinks():
    _refused("sinks", *_config(attn={"impl_sinks": torch.zeros(9)}))


@pytest.mark.parametrize(
    "where", [{"sliding_window": 4096}, {"impl_sliding_window": 4096}], ids=["attention", "backend_impl"]
)
def test_sliding_window_attention_is_refused_naming_sliding_window(where):
    _refused("sliding_window=4096", *_config(attn=where))


def test_flash_attention_no_window_marker_is_supported():
    check_supported(*_config(attn={"impl_sliding_window": (-1, -1)}), BLOCK)


def test_kv_sharing_between_layers_is_refused_naming_the_setting():
    _refused("kv_sharing_target_layer_name", *_config(attn={"kv_sharing_target_layer_name": "model.layers.0"}))


def test_a_value_head_size_other_than_the_key_head_size_is_refused_naming_head_size_v():
    _refused("head_size_v=128 differs from head_size=64", *_config(attn={"head_size_v": 128}))


def test_a_layer_with_other_kv_heads_than_the_first_is_refused():
    msg = _refused("num_kv_heads=1", *_config(attn={"num_kv_heads": 1}, cache={"hkv": 1}))
    assert "num_kv_heads=3" in msg


def test_a_layer_with_another_head_size_than_the_first_is_refused():
    _refused("head_size=128", *_config(attn={"head_size": 128, "head_size_v": 128}, cache={"d": 128}))


def test_a_manager_block_split_into_smaller_kernel_blocks_is_refused_naming_block_size():
    # The KV cache manager counts 128-token blocks; a backend supporting only 64 makes vLLM split each in two.
    attns, _, rotaries = _config()
    caches = {a.layer_name: _cache(block=64) for a in attns}
    msg = _refused("block_size is 128", attns, caches, rotaries)
    assert "kernel blocks of 64 tokens" in msg


def test_one_layer_whose_cache_block_differs_is_refused():
    _refused("kernel blocks of 16 tokens", *_config(layer=3, cache={"block": 16}))


def test_a_cache_not_shaped_blocks_heads_tokens_two_head_sizes_is_refused():
    attns, caches, rotaries = _config()
    caches[attns[1].layer_name] = torch.zeros((2, 2, BLOCK, HKV, D))  # the old [2, B, N, H, D] form
    _refused(r"shaped \(2, 2, 128, 3, 64\)", attns, caches, rotaries)


def test_layers_whose_caches_differ_in_dtype_are_refused():
    # the layout's read-back self-check runs on the first layer's cache only
    _refused("differs from layer", *_config(layer=1, cache={"dtype": torch.bfloat16}))


def test_a_layer_without_a_registered_cache_is_refused():
    attns, caches, rotaries = _config()
    del caches[attns[3].layer_name]
    _refused("model.layers.3.self_attn.attn has no KV cache", attns, caches, rotaries)


def test_a_model_without_rotary_embedding_is_refused():
    attns, caches, _ = _config()
    _refused("needs RoPE", attns, caches, [None] * LAYERS)


def test_a_nope_layer_among_rope_layers_is_refused():
    attns, caches, rotaries = _config()
    rotaries[3] = None
    _refused("decoder layer 3 has no rotary embedding", attns, caches, rotaries)


@pytest.mark.parametrize(
    "other",
    [
        Llama3RotaryEmbedding(),  # another class, same table
        RotaryEmbedding(rotary_dim=32),  # partial rotary on one layer
        RotaryEmbedding(is_neox_style=False),  # GPT-J pairing
        RotaryEmbedding(base=1_000_000.0),  # another rope theta: same class and settings, another table
    ],
    ids=["class", "rotary_dim", "is_neox_style", "cos_sin_table"],
)
def test_a_layer_whose_rotary_differs_from_the_first_layers_is_refused(other):
    _refused("decoder layer 2's rotary embedding", *_config(rotary=other))


def test_no_attention_layer_is_refused():
    _refused("no decoder layer", [], {}, [])


@pytest.mark.parametrize(
    "path, cls, attrs",
    [
        (
            "model_executor/layers/attention/attention.py",
            "Attention",
            ["kv_cache_dtype", "head_size_v", "sliding_window", "has_sink", "kv_sharing_target_layer_name"],
        ),
        (
            "v1/attention/backends/cpu_attn.py",
            "CPUAttentionBackendImpl",
            ["logits_soft_cap", "alibi_slopes", "sinks", "sliding_window"],
        ),
        ("v1/attention/backends/flash_attn.py", "FlashAttentionImpl", ["logits_soft_cap", "alibi_slopes", "sinks"]),
    ],
)
def test_the_vllm_attributes_the_checks_read_still_exist(path, cls, attrs):
    # check_supported reads these with getattr defaults (fakes above): if a vLLM upgrade renamed one, the check
    # would read "not set" and let the configuration through. Read from vLLM's source, without importing it.
    import importlib.util
    import re
    from pathlib import Path

    root = Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
    src = (root / path).read_text()
    start = src.index(f"\nclass {cls}(")
    body = src[start : src.find("\nclass ", start + 1)]
    missing = [a for a in attrs if not re.search(rf"self\.{a}\s*(:[^=]+)?=", body)]
    assert not missing, f"{cls} no longer sets {missing}"


@pytest.mark.parametrize("tp, pp", [(1, 2), (4, 2)])
def test_pipeline_parallelism_is_refused_a_link_runs_every_layer_in_one_pass(tp, pp):
    from types import SimpleNamespace

    from epic_rag.engine.connector.support import check_parallelism

    with pytest.raises(LinkUnsupported, match=f"pipeline_parallel_size={pp}"):
        check_parallelism(SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    check_parallelism(SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1))
