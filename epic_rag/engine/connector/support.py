"""What the linker does not handle, refused at start-up with the setting named.

The linker, the KV layouts and the key rotator rest on assumptions about the model and vLLM's cache that
nothing re-checks while serving; breaking one does not raise, it links wrong KV and the model answers
garbage. `check_supported` (called once by `EpicConnector.attach`, before any self-check) refuses every
such configuration with a `LinkUnsupported` naming the setting, the layer and why. The checks that need
numbers stay where the code they check lives: RoPE shiftability and re-rotation (rope.py), the cache
layout's write/read-back (layout.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .. import vllm_api

# kv_cache_dtype values that store K/V as plain floats ("auto": the model's dtype). Everything else vLLM
# offers (fp8*, int8/int4 per token-head, nvfp4*, turboquant*, ultraquant*) is quantized with scales.
FLOAT_KV_CACHE_DTYPES = frozenset({"auto", "float32", "float", "float16", "half", "bfloat16"})
# Cache tensor dtypes the linker writes with a plain cast (vLLM stores fp8 caches as uint8).
FLOAT_CACHE_TENSOR_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
_NO_WINDOW = (None, -1, (-1, -1))  # no sliding window: Attention (None), CPU_ATTN (-1), FlashAttention (-1, -1)


class LinkUnsupported(RuntimeError):
    """The model or the engine's configuration is one the linker does not handle: refuse to serve."""


def check_supported(
    attns: Sequence[torch.nn.Module],
    kv_caches: Mapping[str, torch.Tensor],
    rotaries: Sequence[torch.nn.Module | None],
    block_size: int,
) -> None:
    """Raise LinkUnsupported unless the linker handles this model and cache configuration.

    attns: vLLM's Attention module of each decoder layer, in layer order; kv_caches: layer name -> paged
    cache tensor, logical shape [num_blocks, num_kv_heads, block_size, 2 * head_size]; rotaries: each
    decoder layer's rotary module (None where it has none); block_size: the KV cache manager's block size
    (vllm_config.cache_config.block_size), in which the scheduler's block ids count.
    """
    if not attns:
        raise LinkUnsupported("the model has no decoder layer with a vLLM Attention module")
    if len(rotaries) != len(attns):
        raise ValueError(f"{len(rotaries)} rotary modules for {len(attns)} attention layers")
    for attn in attns:
        _check_kv_dtype(attn, kv_caches)
        _check_attention_features(attn)
        _check_head_sizes(attn, attns[0])
    _check_caches(attns, kv_caches, block_size)
    _check_rotaries(rotaries)


def _name(attn: torch.nn.Module) -> str:
    return str(getattr(attn, "layer_name", "?"))


def _check_kv_dtype(attn: torch.nn.Module, kv_caches: Mapping[str, torch.Tensor]) -> None:
    """A quantized KV cache (fp8, int8, nvfp4, ...) holds codes plus per-layer scales (`_k_scale`,
    `_v_scale`); the linker writes chunk KV into the pages, and reads it back when compiling, with a plain
    numeric cast, so every linked value would be garbage."""
    kv_dtype = str(getattr(attn, "kv_cache_dtype", "auto"))
    if kv_dtype not in FLOAT_KV_CACHE_DTYPES:
        raise LinkUnsupported(
            f"kv_cache_dtype={kv_dtype!r} (layer {_name(attn)}): a quantized KV cache is not supported, the linker "
            f"writes chunk KV with a plain cast and no scales; serve with kv_cache_dtype='auto'"
        )
    cache = kv_caches.get(_name(attn))
    if cache is not None and cache.dtype not in FLOAT_CACHE_TENSOR_DTYPES:
        raise LinkUnsupported(
            f"the KV cache of layer {_name(attn)} is stored as {cache.dtype} (quantized or packed): the linker "
            f"writes chunk KV with a plain cast; serve with kv_cache_dtype='auto' and a float16/bfloat16/float32 "
            f"model dtype"
        )


def _check_attention_features(attn: torch.nn.Module) -> None:
    """Attention terms beyond softmax(q.k * scale) and causal masking. Where the linker attends over its own
    buffers (FlashAttention, CacheBlend's scattered picks) it computes exactly that, so logits soft-capping,
    ALiBi biases and attention sinks would be silently dropped from the recomputed tokens; a sliding window
    would let recomputed tokens see keys the model never sees past its window. A layer whose KV is another
    layer's (KV sharing) would have its pages written twice, each layer's K/V over the other's."""
    impl = getattr(attn, "impl", None)
    cap = getattr(impl, "logits_soft_cap", None)
    if cap:  # None or 0: no soft-capping (vLLM's backends store 0 for none)
        raise LinkUnsupported(
            f"logits soft-capping (logits_soft_cap={cap}, layer {_name(attn)}) is not supported: the linker's "
            f"attention does not apply it"
        )
    if getattr(impl, "alibi_slopes", None) is not None:
        raise LinkUnsupported(
            f"ALiBi attention (alibi_slopes set, layer {_name(attn)}) is not supported: the linker's attention "
            f"adds no ALiBi bias, and linking needs RoPE"
        )
    if getattr(impl, "sinks", None) is not None or getattr(attn, "has_sink", False):
        raise LinkUnsupported(
            f"attention sinks (sinks set, layer {_name(attn)}) are not supported: the linker's attention does not "
            f"add the sink logits"
        )
    for owner in (attn, impl):
        window = getattr(owner, "sliding_window", None)
        if window not in _NO_WINDOW:
            raise LinkUnsupported(
                f"sliding-window attention (sliding_window={window}, layer {_name(attn)}) is not supported: "
                f"the linker attends over every earlier token, and the window drops tokens from chunk KV"
            )
    target = getattr(attn, "kv_sharing_target_layer_name", None) or getattr(impl, "kv_sharing_target_layer_name", None)
    if target is not None:
        raise LinkUnsupported(
            f"KV sharing across layers (kv_sharing_target_layer_name={target!r}, layer {_name(attn)}) is not "
            f"supported: the linker writes every layer's own K/V into its pages"
        )


def _check_head_sizes(attn: torch.nn.Module, first: torch.nn.Module) -> None:
    """The linker keeps one K and one V buffer per request shaped [layers, num_kv_heads, T, head_size], sized
    from the first layer, and the layouts split a cache row into two halves of head_size: values with their
    own head size (head_size_v), or layers whose head counts or sizes differ, would be cut wrongly."""
    head_size_v = getattr(attn, "head_size_v", attn.head_size)
    if head_size_v != attn.head_size:
        raise LinkUnsupported(
            f"head_size_v={head_size_v} differs from head_size={attn.head_size} (layer {_name(attn)}): the "
            f"linker assumes keys and values of one head size"
        )
    if (attn.num_kv_heads, attn.head_size) != (first.num_kv_heads, first.head_size):
        raise LinkUnsupported(
            f"layer {_name(attn)} has num_kv_heads={attn.num_kv_heads}, head_size={attn.head_size} where layer "
            f"{_name(first)} has num_kv_heads={first.num_kv_heads}, head_size={first.head_size}: the linker "
            f"assumes every attention layer has the same KV heads"
        )


def _check_caches(attns: Sequence[torch.nn.Module], kv_caches: Mapping[str, torch.Tensor], block_size: int) -> None:
    """Every layer's cache must be the logical [num_blocks, num_kv_heads, block_size, 2 * head_size] the
    layouts address, with the KV cache manager's block size: the scheduler's block ids count blocks of
    `block_size` tokens, so if vLLM split each into smaller kernel blocks (a backend that supports only
    smaller ones) a block id would address the wrong tokens. And like the first layer's in dtype and shape:
    the layout's read-back self-check runs on the first layer's cache only."""
    first = None
    for attn in attns:
        cache = kv_caches.get(_name(attn))
        if cache is None:
            raise LinkUnsupported(f"layer {_name(attn)} has no KV cache registered with the connector")
        if cache.dim() == 4 and cache.shape[2] != block_size:
            raise LinkUnsupported(
                f"the KV cache of layer {_name(attn)} has kernel blocks of {cache.shape[2]} tokens where the KV "
                f"cache manager's block_size is {block_size}: blocks split into smaller kernel blocks are not "
                f"supported; set block_size to a size the attention backend supports"
            )
        want = (attn.num_kv_heads, block_size, 2 * attn.head_size)
        if cache.dim() != 4 or tuple(cache.shape[1:]) != want:
            raise LinkUnsupported(
                f"the KV cache of layer {_name(attn)} is shaped {tuple(cache.shape)}; the linker reads "
                f"[num_blocks, num_kv_heads, block_size, 2 * head_size] = [B, {', '.join(map(str, want))}]"
            )
        if first is None:
            first = (attn, cache)
        elif (cache.dtype, cache.shape) != (first[1].dtype, first[1].shape):
            raise LinkUnsupported(
                f"the KV cache of layer {_name(attn)} ({cache.dtype}, {tuple(cache.shape)}) differs from layer "
                f"{_name(first[0])}'s ({first[1].dtype}, {tuple(first[1].shape)}): the layout is checked on "
                f"the first layer only"
            )


def _check_rotaries(rotaries: Sequence[torch.nn.Module | None]) -> None:
    """Linking moves compiled keys to new positions by re-rotating them, so every layer needs RoPE; and one
    KeyRotator, built from the first layer's rotary, rotates every layer's keys: a layer with another
    rotary (class, rotary_dim, NeoX or GPT-J pairing, base or scaling, i.e. its cos/sin table), or with
    none (NoPE layers), would get its keys rotated wrongly."""
    first = rotaries[0]
    if first is None:
        raise LinkUnsupported(
            "the model's decoder layers have no rotary embedding: position-independent linking needs RoPE"
        )
    tables: dict[int, torch.Tensor] = {}

    def table(rotary: torch.nn.Module) -> torch.Tensor:
        if id(rotary) not in tables:
            tables[id(rotary)] = vllm_api.rotary_table(rotary)
        return tables[id(rotary)]

    def describe(rotary: torch.nn.Module) -> str:
        return (
            f"{type(rotary).__name__}(rotary_dim={getattr(rotary, 'rotary_dim', '?')}, "
            f"is_neox_style={getattr(rotary, 'is_neox_style', '?')})"
        )

    for i, rotary in enumerate(rotaries[1:], start=1):
        if rotary is first:  # vLLM shares one module between layers with the same settings
            continue
        if rotary is None:
            raise LinkUnsupported(
                f"decoder layer {i} has no rotary embedding where layer 0 has {describe(first)}: layers without "
                f"RoPE (NoPE) are not supported"
            )
        same = (
            type(rotary) is type(first)
            and getattr(rotary, "rotary_dim", None) == getattr(first, "rotary_dim", None)
            and getattr(rotary, "is_neox_style", None) == getattr(first, "is_neox_style", None)
            and torch.equal(table(rotary), table(first))
        )
        if not same:
            raise LinkUnsupported(
                f"decoder layer {i}'s rotary embedding {describe(rotary)} differs from layer 0's {describe(first)} "
                f"or has another cos/sin table (rope theta or scaling): per-layer RoPE settings are not supported, "
                f"one key rotator built from layer 0 serves every layer"
            )


def check_parallelism(parallel_config) -> None:
    """Refuse pipeline parallelism: a rank holds only some layers, and a link runs every layer in one pass.
    (Tensor parallelism is handled: each rank stores and links its own KV heads under rank-suffixed keys.)"""
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    if pp != 1:
        raise LinkUnsupported(
            f"EpicConnector does not support pipeline_parallel_size={pp}: a link runs every layer in one pass; "
            "use tensor parallelism or one engine per device"
        )
