"""Key rotation against vLLM's own rotary modules, and the paged-KV accessors (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from epic_rag.engine.link.layout import CpuAttnLayout, FlashAttnLayout, LayoutError, query_runs, slots_for
from epic_rag.engine.link.rope import KeyRotator, RopeError
from epic_rag.testing.varlen import ReferenceFlashKernels

ROPES = {
    "default": {"rope_theta": 10000.0, "rope_type": "default"},
    "linear": {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_theta": 500000.0,
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    },
    "yarn": {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
}


def _rope(params, head=64, neox=True):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        return get_rope(head, max_position=8192, rope_parameters=dict(params), is_neox_style=neox, dtype=torch.float32)


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("neox", [True, False])
def test_rotated_keys_equal_keys_computed_at_the_real_position(kind, neox):
    rope = _rope(ROPES[kind], neox=neox)
    rot = KeyRotator(rope)
    n, H, D, delta = 40, 3, 64, 1777
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(n, H * D, generator=g) * 5
    q = torch.zeros_like(raw)
    _, k0 = rope.forward_native(torch.arange(n), q.clone(), raw.clone())  # compiled at 0..n-1
    _, kp = rope.forward_native(torch.arange(n) + delta, q.clone(), raw.clone())  # linked at delta..
    shifted = rot.rotate(k0.view(n, H, D), delta)
    err = (shifted - kp.view(n, H, D)).abs().max().item()
    assert err < 2e-4 * kp.abs().max().item(), err


def test_rotation_by_zero_is_identity_and_out_of_table_shift_is_refused():
    rot = KeyRotator(_rope(ROPES["default"]))
    k = torch.randn(5, 2, 64)
    assert torch.equal(rot.rotate(k, 0), k)
    with pytest.raises(RopeError):
        rot.rotate(k, 10**7)


def test_rotator_keeps_fp32_tables_per_device_and_rotates_on_the_keys_device():
    # The tables go to the keys' device once and stay there (CUDA keys must not multiply CPU rows, nor
    # copy a row to the GPU per call); "meta" stands in for a GPU here.
    rot = KeyRotator(_rope(ROPES["llama3"]))
    cos, sin = rot.tables("cpu")
    assert cos is rot.cos and sin is rot.sin and cos.dtype == torch.float32
    mcos, msin = rot.tables("meta")
    assert mcos.device.type == msin.device.type == "meta" and mcos.dtype == msin.dtype == torch.float32
    assert rot.tables(torch.device("meta"))[0] is mcos and mcos.shape == cos.shape
    out = rot.rotate(torch.empty((2, 5, 3, 64), dtype=torch.bfloat16, device="meta"), -17)
    assert out.device.type == "meta" and out.dtype == torch.float32 and out.shape == (2, 5, 3, 64)
    # 16-bit keys are rotated in fp32 from their rounded values; a negative shift undoes a positive one.
    k = torch.randn((2, 5, 3, 64), dtype=torch.bfloat16)
    assert torch.equal(rot.rotate(k, 300), rot.rotate(k.float(), 300))
    assert torch.allclose(rot.rotate(rot.rotate(k, 300), -300), k.float(), atol=1e-5)


def test_non_shiftable_rope_is_refused():
    class DynamicNTKScalingRotaryEmbedding(torch.nn.Module):
        pass

    with pytest.raises(RopeError, match="not position-shiftable"):
        KeyRotator(DynamicNTKScalingRotaryEmbedding())


def test_slots_follow_the_block_table():
    # positions 0..250 step 50, block size 128 -> blocks (7, 7, 7, 3, 3, 3), offsets (0, 50, 100, 22, 72, 122)
    slots = slots_for([7, 3, 9], torch.arange(0, 300, 50), 128)
    assert slots.tolist() == [896, 946, 996, 406, 456, 506]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_layout_reads_back_what_vllms_write_op_stored(dtype):
    layout = CpuAttnLayout("vec")
    like = torch.empty((4, 3, 128, 2 * 64), dtype=dtype)
    layout.self_check(like)  # raises LayoutError on mismatch


def test_cpu_layout_stores_keys_transposed_per_block():
    layout = CpuAttnLayout("vec")
    cache = torch.zeros((2, 1, 32, 2 * 32))
    k = torch.arange(32, dtype=torch.float32).view(1, 1, 32)
    v = -torch.arange(32, dtype=torch.float32).view(1, 1, 32)
    layout.write(cache, torch.tensor([32 + 5]), k, v)
    flat = cache[1, 0].reshape(-1)
    kpart = flat[: 32 * 32].view(32, 32)  # [D, N]
    assert torch.equal(kpart[:, 5], k.flatten())
    vpart = flat[32 * 32 :].view(32, 32)  # [N, D]
    assert torch.equal(vpart[5], v.flatten())


def test_unknown_cpu_isa_is_refused():
    with pytest.raises(LayoutError, match="amx"):
        CpuAttnLayout("amx")


def test_flash_attention_layout_logic_on_cpu_tensors():
    # CUDA FlashAttention's per-layer cache: logical [B, H, N, 2D], K = [..., :D], V = [..., D:].
    # vLLM's own write path (do_kv_cache_update) views it as transpose(1, 2).split(D, -1).
    layout = FlashAttnLayout(ReferenceFlashKernels())  # vLLM's CUDA kernels stand-in: the start-up check runs them
    B, H, N, D = 4, 2, 16, 8
    cache = torch.zeros((B, H, N, 2 * D))
    layout.self_check(cache)
    slots = torch.tensor([16 + 3, 48 + 15])
    k, v = torch.randn(2, H, D), torch.randn(2, H, D)
    layout.write(cache, slots, k, v)
    key_cache, value_cache = cache.transpose(1, 2).split(D, dim=-1)  # as vLLM reads it: [B, N, H, D]
    assert torch.equal(key_cache[1, 3], k[0]) and torch.equal(value_cache[3, 15], v[1])


def test_a_layout_that_scrambles_data_fails_its_self_check():
    class Broken(FlashAttnLayout):
        def read(self, cache, slots):
            k, v = super().read(cache, slots)
            return v, k

    with pytest.raises(LayoutError):
        Broken().self_check(torch.zeros((3, 2, 16, 16)))


def test_chunk_keys_change_with_model_tokenizer_dtype_lead_tenant_and_tokens():
    from epic_rag.keys import chunk_key, kv_fingerprint

    base = kv_fingerprint("model-a", "tok-a", "torch.float32")
    k = chunk_key(base, [1, 2, 3])
    assert chunk_key(base, [1, 2, 3]) == k  # content only: stable
    assert chunk_key(kv_fingerprint("model-b", "tok-a", "torch.float32"), [1, 2, 3]) != k
    assert chunk_key(kv_fingerprint("model-a", "tok-b", "torch.float32"), [1, 2, 3]) != k
    assert chunk_key(kv_fingerprint("model-a", "tok-a", "torch.bfloat16"), [1, 2, 3]) != k
    assert chunk_key(base, [1, 2, 3], [9, 8]) != k and chunk_key(base, [1, 2, 3], [9, 7]) != chunk_key(
        base, [1, 2, 3], [9, 8]
    )
    assert chunk_key(base, [1, 2, 3], tenant="acme") != k
    assert chunk_key(base, [1, 2, 4]) != k and chunk_key(base, [3, 2, 1]) != k


@pytest.mark.parametrize("layout", [CpuAttnLayout("vec"), FlashAttnLayout()])
@pytest.mark.parametrize("start, end", [(0, 256), (5, 300), (130, 140), (0, 1), (127, 129)])
def test_range_reads_and_writes_match_per_slot_access(layout, start, end):
    N, H, D = 128, 3, 32
    block_ids = [6, 2, 9, 4]
    cache = torch.zeros((10, H, N, 2 * D))
    k, v = torch.randn(end - start, H, D), torch.randn(end - start, H, D)
    layout.write_range(cache, block_ids, start, end, k, v)
    rk, rv = layout.read(cache, slots_for(block_ids, torch.arange(start, end), N))
    assert torch.equal(rk, k) and torch.equal(rv, v)
    rk2, rv2 = layout.read_range(cache, block_ids, start, end)
    assert torch.equal(rk2, k) and torch.equal(rv2, v)


class _FakeAttn:
    """The fields of a vLLM Attention module that the paged-attention path reads."""

    def __init__(self, Hq, Hk, D):
        from types import SimpleNamespace

        self.num_heads, self.num_kv_heads, self.head_size = Hq, Hk, D
        self.impl = SimpleNamespace(scale=D**-0.5, alibi_slopes=None, logits_soft_cap=0.0, sinks=None)


def _reference_attention(q, K, V, R, scale):
    """Each query at position R[i] attends keys [0, R[i]].  # q: [nR, Hq, D], K/V: [T, Hk, D]"""
    G = q.shape[1] // K.shape[1]
    Ke, Ve = K.repeat_interleave(G, 1), V.repeat_interleave(G, 1)  # [T, Hq, D]
    s = torch.einsum("nhd,thd->hnt", q, Ke) * scale
    s.masked_fill_(torch.arange(K.shape[0])[None, None, :] > R[None, :, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(s, -1), Ve)


@pytest.mark.parametrize("runs", [[(0, 300)], [(0, 3), (40, 56), (130, 131), (200, 216), (290, 300)]])
def test_cpu_kernel_attention_over_pages_equals_masked_attention(runs):
    # Runs of recomputed positions become kernel "sequences" over shared pages: query at t sees [0, t].
    N, Hq, Hk, D, T = 128, 6, 2, 64, 300
    layout, attn = CpuAttnLayout("vec"), _FakeAttn(Hq, Hk, D)
    block_ids = [3, 0, 5]
    cache = torch.zeros((6, Hk, N, 2 * D))
    K, V = torch.randn(T, Hk, D), torch.randn(T, Hk, D)
    R = torch.cat([torch.arange(a, b) for a, b in runs])
    cached = torch.ones(T, dtype=torch.bool)
    cached[R] = False
    layout.write_range(cache, block_ids, 0, T, torch.where(cached[:, None, None], K, 0.0), V)  # R's K not yet
    plan = layout.attention_plan(cache, [(block_ids, R)], attn)
    q = torch.randn(len(R), Hq, D)
    out = layout.attend(plan, attn, cache, q.view(len(R), -1), K[R].reshape(len(R), -1), V[R].reshape(len(R), -1))
    ref = _reference_attention(q, K, V, R, attn.impl.scale)
    assert torch.allclose(out.view(len(R), Hq, D), ref, atol=1e-5)
    assert torch.equal(layout.read_range(cache, block_ids, 0, T)[0], K)  # R's fresh keys were stored


def test_query_runs_are_kernel_sequences_ending_at_each_runs_last_position():
    R = torch.cat([torch.arange(0, 3), torch.arange(40, 56), torch.tensor([130])])
    qsl, seq_lens = query_runs(R)
    assert qsl.tolist() == [0, 3, 19, 20] and seq_lens.tolist() == [3, 56, 131]
    assert qsl.dtype == seq_lens.dtype == torch.int32


def test_cpu_kernel_attention_is_planned_inside_the_links_range_whatever_the_runs():
    layout = CpuAttnLayout("vec")
    R = torch.arange(10, 20)
    assert layout.can_attend(R, 0, 300)
    assert not layout.can_attend(R, 12, 300)  # would overwrite shared prefix
    assert not layout.can_attend(R, 0, 15)  # beyond the claimed range
    assert layout.can_attend(torch.arange(0, 260, 2), 0, 300)  # scattered picks: one kernel sequence each
    assert not layout.can_attend(R[:0], 0, 300)


def test_flash_attention_kernel_path_takes_any_number_of_runs_inside_the_links_range():
    layout = FlashAttnLayout(ReferenceFlashKernels())
    scattered = torch.arange(0, 260, 2)  # CacheBlend's picks: exact here too
    assert layout.can_attend(scattered, 0, 300)
    assert not layout.can_attend(torch.arange(10, 20), 12, 300)  # would overwrite shared prefix
    assert not layout.can_attend(torch.arange(10, 20), 0, 15)
    assert not layout.can_attend(scattered[:0], 0, 300)


@pytest.mark.parametrize("layout_kind", ["cpu_attn", "flash_attn"])
def test_one_kernel_plan_for_several_requests_equals_each_ones_masked_attention(layout_kind):
    # A batched link: each request's runs are kernel sequences over its own block table, packed in one call.
    # FlashAttention's adapter runs the same plan through a kernel written from FlashAttention's contract.
    N, Hq, Hk, D = 32, 6, 2, 64
    kernels = ReferenceFlashKernels()
    layout = CpuAttnLayout("vec") if layout_kind == "cpu_attn" else FlashAttnLayout(kernels)
    attn = _FakeAttn(Hq, Hk, D)
    cache = torch.zeros((12, Hk, N, 2 * D))
    scattered = [(t, t + 1) for t in range(3, 40, 3)]  # CacheBlend-like picks: runs of one query (flash only)
    reqs = [  # (block_ids, T, runs of R)
        ([3, 0, 5], 70, [(0, 3), (40, 56), (69, 70)]),
        ([7, 1, 9, 2], 120, [(0, 120)]),
        ([11], 20, [(4, 9), (15, 17)]),
    ] + ([([4, 6], 40, scattered)] if layout_kind == "flash_attn" else [])
    seqs, qs, ks, vs, refs = [], [], [], [], []
    for block_ids, T, runs in reqs:
        K, V = torch.randn(T, Hk, D), torch.randn(T, Hk, D)
        R = torch.cat([torch.arange(a, b) for a, b in runs])
        cached = torch.ones(T, dtype=torch.bool)
        cached[R] = False
        layout.write_range(cache, block_ids, 0, T, torch.where(cached[:, None, None], K, 0.0), V)
        assert layout.can_attend(R, 0, T)
        q = torch.randn(len(R), Hq, D)
        seqs.append((block_ids, R))
        qs.append(q.view(len(R), -1))
        ks.append(K[R].reshape(len(R), -1))
        vs.append(V[R].reshape(len(R), -1))
        refs.append((_reference_attention(q, K, V, R, attn.impl.scale), block_ids, T, K))
    plan = layout.attention_plan(cache, seqs, attn)
    out = layout.attend(plan, attn, cache, torch.cat(qs), torch.cat(ks), torch.cat(vs))  # [sum nR, Hq*D]
    for got, (ref, block_ids, T, K) in zip(out.split([len(R) for _, R in seqs]), refs):
        assert torch.allclose(got.view(-1, Hq, D), ref, atol=1e-5)
        assert torch.equal(layout.read_range(cache, block_ids, 0, T)[0], K)  # R's fresh keys stored in its pages
    if layout_kind == "flash_attn":
        assert kernels.calls == 1  # one kernel call for the whole batch


def test_run_plan_is_the_kernels_varlen_metadata_for_packed_requests():
    from epic_rag.engine.link.layout import RunPlan

    R1 = torch.cat([torch.arange(0, 3), torch.arange(40, 56)])  # request 1: blocks [3, 0, 5] (N=32)
    R2 = torch.tensor([5, 7])  # request 2: blocks [9]
    plan = RunPlan.build([([3, 0, 5], R1), ([9], R2)], 32)
    assert plan.query_start_loc.tolist() == [0, 3, 19, 20, 21]
    assert plan.seq_lens.tolist() == [3, 56, 6, 8]
    assert plan.block_table.tolist() == [[3, 0], [3, 0], [9, 0], [9, 0]]  # only the blocks each run reads
    assert plan.slots.tolist() == [96, 97, 98] + [t - 32 for t in range(40, 56)] + [293, 295]  # block 0 holds 32..63
    assert (plan.max_query_len, plan.max_seq_len) == (16, 56)
    assert plan.query_start_loc.dtype == plan.seq_lens.dtype == plan.block_table.dtype == torch.int32


def _amx_bf16() -> bool:
    return torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probed_layout_learns_the_hand_coded_vec_packing(dtype):
    from epic_rag.engine.link.layout import ProbedCpuAttnLayout

    N, H, D = 32, 3, 64
    probed, known = ProbedCpuAttnLayout("vec"), CpuAttnLayout("vec")
    a, b = torch.zeros((6, H, N, 2 * D), dtype=dtype), torch.zeros((6, H, N, 2 * D), dtype=dtype)
    k, v = torch.randn(100, H, D).to(dtype), torch.randn(100, H, D).to(dtype)
    probed.write_range(a, [4, 1, 5, 0], 7, 107, k, v)
    known.write_range(b, [4, 1, 5, 0], 7, 107, k, v)
    assert torch.equal(a, b)
    rk, rv = probed.read_range(b, [4, 1, 5, 0], 7, 107)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    probed.self_check(a)


@pytest.mark.skipif(not _amx_bf16(), reason="this CPU has no AMX tiles (vLLM packs bf16 for `amx` only there)")
def test_amx_bf16_layout_is_probed_and_its_kernel_attention_equals_masked_attention():
    from epic_rag.engine.link.layout import ProbedCpuAttnLayout

    N, Hq, Hk, D, T = 32, 6, 2, 64, 100
    layout, attn = ProbedCpuAttnLayout("amx"), _FakeAttn(Hq, Hk, D)
    cache = torch.zeros((6, Hk, N, 2 * D), dtype=torch.bfloat16)
    layout.self_check(cache)
    block_ids = [3, 0, 5, 1]
    K, V = torch.randn(T, Hk, D).to(torch.bfloat16), torch.randn(T, Hk, D).to(torch.bfloat16)
    R = torch.cat([torch.arange(0, 3), torch.arange(40, 56), torch.arange(90, 100)])
    cached = torch.ones(T, dtype=torch.bool)
    cached[R] = False
    layout.write_range(cache, block_ids, 0, T, torch.where(cached[:, None, None], K, 0.0), V)
    plan = layout.attention_plan(cache, [(block_ids, R)], attn)
    q = torch.randn(len(R), Hq, D).to(torch.bfloat16)
    out = layout.attend(plan, attn, cache, q.view(len(R), -1), K[R].reshape(len(R), -1), V[R].reshape(len(R), -1))
    ref = _reference_attention(q.float(), K.float(), V.float(), R, attn.impl.scale)
    assert torch.allclose(out.view(len(R), Hq, D).float(), ref, atol=3e-2)
    assert torch.equal(layout.read_range(cache, block_ids, 0, T)[0], K)


@pytest.mark.parametrize("lead", [1, 5])
@pytest.mark.parametrize("steps", [[(0, 12)], [(0, 3), (3, 7), (7, 12)], [(0, 1), (1, 5), (5, 12)]])
def test_capture_keeps_the_sink_and_the_chunk_whatever_the_prefill_steps(lead, steps):
    from epic_rag.engine.jobs import Capture

    # Prompt [lead] + chunk of 12 - lead tokens; the record keeps position 0 and positions lead.. in order.
    cap = Capture(k=torch.empty(1, 12 - lead + 1), v=torch.empty(1, 12 - lead + 1), lead=lead)
    got = [p for a, b in steps for first, stop, at in cap.kept(a, b) for p in range(first, stop)]
    at = [i for a, b in steps for first, stop, i0 in cap.kept(a, b) for i in range(i0, i0 + stop - first)]
    want = [0] + list(range(max(lead, 1), 12))
    assert got == want and at == list(range(len(want)))
