"""The linker's kernel path, on CPU tensors: the fused Triton kernel (under Triton's interpreter) against the
torch path, the whole linker against its buffer path, what a GPU would pay per layer (dispatched ops, host
syncs), the device-time budget and the layout's start-up check. The CUDA runs are in scripts/device_check.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epic_rag.engine.jobs import LinkJob, LinkSpan
from epic_rag.engine.link import kernels, linker, stage
from epic_rag.engine.link.budget import DeviceBudget, HostBudget
from epic_rag.engine.link.layout import FlashAttnLayout, LayoutError, canonical_strides
from epic_rag.engine.link.rope import KeyRotator
from epic_rag.policy import parse_policy
from epic_rag.store import ChunkKV
from epic_rag.testing.dispatch_count import OpCounter
from epic_rag.testing.stub_model import RotaryEmbedding, StubModel
from epic_rag.testing.varlen import ReferenceFlashKernels

N = 16  # tokens per block


def _flash_caches(L, H, D, B, dtype):
    """vLLM 0.32's FlashAttention caches: per layer a logical [B, H, N, 2D] view of physical [B, N, H, 2D]."""
    return [torch.zeros(B, N, H, 2 * D, dtype=dtype).permute(0, 2, 1, 3) for _ in range(L)]


def _plan(L, H, D, dtype, g, B):
    """Three segments (records sliced past their sink row, as spans are): shifts forward, back and none."""
    plan = stage.FillPlan()
    free = torch.randperm(B * N, generator=g)
    used = 0
    for n, delta in ((37, 300), (21, -5), (16, 0)):
        k = torch.randn(L, n + 1, H, D, generator=g).to(dtype)
        v = torch.randn(L, n + 1, H, D, generator=g).to(dtype)
        plan.add(k[:, 1:], v[:, 1:], delta, free[used : used + n].sort().values)
        used += n
    return plan


def _fill(filler_cls, plan, caches, **kw):
    f = filler_cls(*kw.pop("args"), caches, 128, **kw)
    state = f.begin(plan)
    for li in range(len(caches)):
        f.layer(state, li)
    return f, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("neox,rot_frac", [(True, 1), (False, 1), (True, 2)])
@pytest.mark.parametrize("staged", [False, True])
def test_fused_kernel_writes_the_pages_the_torch_path_writes(interpreted, dtype, neox, rot_frac, staged):
    L, H, D, B = 5, 2, 32, 12
    g = torch.Generator().manual_seed(3)
    rot = KeyRotator(RotaryEmbedding(D, D // rot_frac, neox=neox))
    plan = _plan(L, H, D, dtype, g, B)
    want = _flash_caches(L, H, D, B, dtype)
    _fill(stage.TorchFiller, plan, want, args=(FlashAttnLayout(), rot))
    got = _flash_caches(L, H, D, B, dtype)
    # staged: every record copied into the staging ring, a group of layers at a time
    f, state = _fill(stage.TritonFiller, plan, got, args=(rot,), stage_all=staged)
    assert f.launches == (-(-L // state.group) if staged else 1)
    for a, b in zip(got, want):
        if dtype == torch.bfloat16:  # the interpreter rounds fp32 -> bf16 toward zero, torch to nearest even
            ulp = torch.finfo(dtype).eps * b.float().abs().clamp_min(torch.finfo(dtype).tiny)
            assert bool(((a.float() - b.float()).abs() <= ulp * 1.0001).all())
        else:
            assert torch.equal(a, b)
    assert any(bool(c.ne(0).any()) for c in got)


def test_a_staging_ring_smaller_than_the_layers_is_filled_in_groups_in_order(interpreted):
    L, H, D, B = 7, 2, 32, 12
    g = torch.Generator().manual_seed(5)
    rot = KeyRotator(RotaryEmbedding(D))
    plan = _plan(L, H, D, torch.float32, g, B)
    want = _flash_caches(L, H, D, B, torch.float32)
    _fill(stage.TorchFiller, plan, want, args=(FlashAttnLayout(), rot))
    got = _flash_caches(L, H, D, B, torch.float32)
    f = stage.TritonFiller(rot, got, plan.num_rows, stage_all=True)  # room for ~1-2 layers of the rows
    state = f.begin(plan)
    assert 1 <= state.group < L
    for li in range(L):
        f.layer(state, li)
    assert f.launches == -(-L // state.group) and state.copied == f.launches
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ------------------------------------------------------------------------- the whole linker, stub model


def _records(L, H, D, dtype, g, chunks=3, n=40):
    return [
        ChunkKV(
            f"c{i}",
            list(range(100 * i, 100 * i + n + 1)),
            torch.randn(L, n + 1, H, D, generator=g).to(dtype),
            torch.randn(L, n + 1, H, D, generator=g).to(dtype),
            base_pos=4,
        )
        for i in range(chunks)
    ]


def _job(recs, policy, glue=5, tail=7):
    n = recs[0].num_tokens - 1
    spans = [LinkSpan(glue + c * n, r.slice(1)) for c, r in enumerate(recs)]
    return LinkJob(list(range(glue + n * len(recs) + tail)), spans, parse_policy(policy))


class _BufferOnly(FlashAttnLayout):
    """The buffer path as the reference: no request attends with the kernel."""

    needs_buffers = True

    def can_attend(self, R, start, end):
        return False


def _stub_linker(model, caches, layout, workspace_tokens, **kw) -> linker.Linker:
    """A Linker over the stub model's layers and their caches (one per layer, in order)."""
    return linker.Linker(
        model=model,
        kv_caches={f"model.layers.{li}.self_attn.attn": c for li, c in enumerate(caches)},
        layout=layout,
        rotator=KeyRotator(model.rotary),
        block_size=N,
        workspace_tokens=workspace_tokens,
        **kw,
    )


def _link(model, layout, jobs, starts, dtype, fused=None, prefix=None):
    L = len(model.model.layers)
    T = max(len(j.token_ids) for j in jobs)
    B = len(jobs) * (-(-T // N)) + 2
    caches = _flash_caches(L, model.hk, model.d, B, dtype)
    if prefix is not None:  # vLLM's own KV below each request's start (a prefix-cache hit)
        for c in caches:
            c.copy_(prefix[: c.numel()].view(c.shape).to(dtype))
    ln = _stub_linker(model, caches, layout, sum(len(j.token_ids) for j in jobs), fused=fused)
    per = -(-T // N)
    loads = [
        linker.LinkLoad(j, list(range(1 + i * per, 1 + (i + 1) * per)), s, len(j.token_ids))
        for i, (j, s) in enumerate(zip(jobs, starts))
    ]
    ln.link_many(loads)
    assert all(j.error is None for j in jobs), [j.error for j in jobs]
    return caches, ln


@pytest.mark.parametrize("policy", ["legolink-16", "naive", "cacheblend-15", "legolink-epic-4", "legolink-9999"])
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_path_pages_equal_the_buffer_path_for_a_batch_with_a_prefix_hit(interpreted, policy, fused):
    # Two requests in one pass; the second's first 16 positions are vLLM's own (start 16): its glue there is
    # neither recomputed nor rewritten, and it still attends with the kernel (all runs are >= start).
    L, HQ, HK, D = 3, 4, 2, 16
    g = torch.Generator().manual_seed(1)
    model = StubModel(L, HQ, HK, D)
    recs = _records(L, HK, D, torch.float32, g)
    prefix = torch.randn(10**6, generator=g)
    jobs = lambda: [_job(recs, policy), _job(recs[::-1], policy, glue=20)]  # noqa: E731
    want, _ = _link(model, _BufferOnly(ReferenceFlashKernels()), jobs(), [0, 16], torch.float32, prefix=prefix)
    kernels_ = ReferenceFlashKernels()
    got, ln = _link(model, FlashAttnLayout(kernels_), jobs(), [0, 16], torch.float32, fused, prefix)
    assert kernels_.calls == L  # one kernel call a layer for the whole pass
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_recompute_below_a_prefix_hit_is_left_to_vllm_and_the_request_stays_on_the_kernel_path():
    from epic_rag.engine.link.layout import CpuAttnLayout

    g = torch.Generator().manual_seed(2)
    recs = _records(2, 2, 16, torch.float32, g)
    job = _job(recs, "legolink-16", glue=20)  # glue [0, 20): the first 16 are a prefix-cache hit
    load = linker.LinkLoad(job, list(range(20)), 16, len(job.token_ids))
    ln = object.__new__(linker.Linker)
    ln.workspace_tokens, ln.layers, ln.block_size = 10**4, [None, None], N
    ln.attn = [(None, None, SimpleNamespace(num_kv_heads=2, head_size=16, layer_name=None))]
    ln.kv_caches = {None: torch.zeros(1, 2, N, 32)}
    ln.rotator = KeyRotator(RotaryEmbedding(16))
    s = ln._check(load)
    assert int(s.R.min()) == 16 and 19 in s.R.tolist()  # recomputed from start on, glue past it included
    assert CpuAttnLayout("vec").can_attend(s.R, 16, len(job.token_ids))


# --------------------------------------------------------------------- what a GPU would pay, per layer


class _StubKernels:
    """FlashAttention's two kernels, counted as one launch each (`counter` set by _counted)."""

    counter = None

    def _launch(self, name):
        if self.counter is not None and not self.counter.paused:
            self.counter.ops.append(f"kernel:{name}")

    def cache_write(self, attn, k, v, key_cache, value_cache, slots) -> None:
        self._launch("cache_write")

    def varlen(self, attn, q, key_cache, value_cache, out, plan) -> None:
        self._launch("varlen")


def _counted(monkeypatch, ln, p):
    """Ops and syncs of advance() over every layer, the stub layers' own ops (the model's) left out."""
    counter = OpCounter()
    for name in ("tolist", "cpu", "numpy"):
        orig = getattr(torch.Tensor, name)

        def spy(self, *a, _orig=orig, _name=name, **k):
            if not counter.paused:
                counter.syncs.append(_name)
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    launch = kernels.fill_pages

    def one_launch(*a, **k):  # a Triton launch dispatches no torch op on a GPU; under the interpreter it runs numpy
        counter.paused = True
        try:
            launch(*a, **k)
        finally:
            counter.paused = False
        counter.ops.append("triton:fill_pages")

    monkeypatch.setattr(kernels, "fill_pages", one_launch)
    # The stub layers' own ops are the model's, not the linker's; their attention call (the shim) is counted.
    layer_cls, shim_forward = type(ln.layers[0]), linker._LinkAttention.forward

    def paused(fn):
        def run(*a, **k):
            was, counter.paused = counter.paused, fn is layer_forward
            try:
                return fn(*a, **k)
            finally:
                counter.paused = was

        return run

    layer_forward = layer_cls.forward
    monkeypatch.setattr(layer_cls, "forward", paused(layer_forward))
    monkeypatch.setattr(linker._LinkAttention, "forward", paused(shim_forward))
    monkeypatch.setattr(_StubKernels, "counter", counter)
    with counter:
        ln.advance(p)
    return counter


def _pass(model, chunks, fused, stage_all=False):
    L = len(model.model.layers)
    g = torch.Generator().manual_seed(7)
    recs = _records(L, model.hk, model.d, torch.float32, g, chunks=chunks)
    job = _job(recs, "legolink-16")
    T = len(job.token_ids)
    caches = _flash_caches(L, model.hk, model.d, -(-T // N) + 1, torch.float32)
    ln = _stub_linker(model, caches, FlashAttnLayout(_StubKernels()), T, fused=fused)
    if fused:
        ln.filler.stage_all = stage_all
    p, _ = ln.begin([linker.LinkLoad(job, list(range(-(-T // N))), 0, T)])
    return ln, p


@pytest.mark.parametrize("chunks", [4, 12])
def test_fused_kernel_path_layer_loop_has_no_host_sync_and_a_fixed_op_count(interpreted, monkeypatch, chunks):
    L = 4
    model = StubModel(L, 4, 2, 16)
    ln, p = _pass(model, chunks, fused=True)  # records resident on the device (the GPU tier)
    c = _counted(monkeypatch, ln, p)
    assert c.syncs == [], c.syncs
    assert c.ops.count("triton:fill_pages") == 1  # every layer's page fill in one launch
    # Per layer the shim's views and the backend's two kernels, whatever the number of chunks (the old path
    # dispatched ~116 ops a layer for 8 chunks, growing with them).
    assert len(c.ops) <= 14 * L, (len(c.ops) / L, c.ops)
    assert len(c.launches()) == 2 * L + 1, c.launches()  # cache write + varlen a layer, one fill for all


@pytest.mark.parametrize("chunks", [4, 12])
def test_staged_records_cost_two_copies_per_record_per_group_and_no_host_sync(interpreted, monkeypatch, chunks):
    L = 4
    model = StubModel(L, 4, 2, 16)
    ln, p = _pass(model, chunks, fused=True, stage_all=True)  # records in host memory, staged
    c = _counted(monkeypatch, ln, p)
    assert c.syncs == [], c.syncs
    groups = c.ops.count("triton:fill_pages")
    copies = sum("copy_" in op for op in c.ops)
    # begin() issued group 0's copies; advance issues the rest, two per record (K, V) per group
    assert groups > 1 and copies == 2 * chunks * (groups - 1)
    assert len(c.launches()) == 2 * L + groups + copies, c.launches()


def test_torch_path_layer_loop_has_no_host_sync_and_two_copies_per_record(monkeypatch):
    L, chunks = 3, 6
    model = StubModel(L, 4, 2, 16)
    ln, p = _pass(model, chunks, fused=False)
    c = _counted(monkeypatch, ln, p)
    assert c.syncs == [], c.syncs
    # per layer: the records' copies (K, V), the rotation (8), the page write, the backend's two kernels
    assert len(c.launches()) <= L * (2 * chunks + 16), c.launches()


@pytest.mark.parametrize("fused", [False, True])
def test_a_pass_never_reads_a_device_value_on_the_host(fused):
    # begin() runs right after the step's forward is issued, advance() between forwards: a device value read
    # on the host would wait for the device. With the caches on torch's meta device every such read raises.
    L, chunks = 3, 4
    model = StubModel(L, 4, 2, 16, device="meta")
    g = torch.Generator().manual_seed(7)
    job = _job(_records(L, 2, 16, torch.float32, g, chunks=chunks), "legolink-16", glue=20)
    T = len(job.token_ids)
    caches = [torch.empty(-(-T // N) + 1, 2, N, 32, device="meta") for _ in range(L)]
    ln = _stub_linker(model, caches, FlashAttnLayout(_StubKernels()), T, fused=fused)
    p, _ = ln.begin([linker.LinkLoad(job, list(range(-(-T // N))), 16, T)])  # a prefix hit below 16 too
    assert p is not None and job.error is None, job.error
    if not fused:  # the fused kernel itself cannot run on meta tensors
        assert ln.advance(p) and job.recomputed == len(p.seqs[0].R) > 0


# -------------------------------------------------------------------------------- the link's step budget


class _Event:
    """A CUDA event stand-in: completes when the test says so, at a time the test sets."""

    def __init__(self, clock):
        self.clock, self.t, self.done = clock, None, False

    def record(self):
        self.t = self.clock["now"]

    def query(self):
        return self.clock["done"]

    def elapsed_time(self, other):
        assert self.clock["done"], "elapsed_time on events not complete would wait for the device"
        return other.t - self.t


def test_device_budget_gives_a_link_the_share_of_the_forward_it_measured_on_the_device_without_waiting():
    clock = {"now": 0.0, "done": False}
    b = DeviceBudget(share=0.5, new_event=lambda: _Event(clock), record=lambda e: e.record())
    b.bound()
    clock["now"] = 10.0  # the forward took 10 ms of device time
    b.start(idle=False)
    assert b.more() is False  # nothing measured yet: one layer
    clock["now"] = 12.0  # that layer took 2 ms
    b.end()
    clock["now"] = 20.0
    b.bound()
    clock["now"] = 30.0
    b.start(idle=False)  # the events are not complete: the estimates stay unknown, never waited for
    assert (b.forward_ms, b.layer_ms) == (None, None)
    clock["now"] = 32.0
    b.more()
    b.end()
    clock["done"], clock["now"] = True, 40.0
    b.bound()
    clock["now"] = 50.0
    b.start(idle=False)
    assert b.forward_ms == 10.0 and b.layer_ms == 2.0
    ran = 1
    while b.more():
        ran += 1
    assert ran == 2  # 0.5 x 10 ms / 2 ms per layer
    b.end()
    b.bound()
    b.start(idle=True)  # nothing else runs: no limit
    assert all(b.more() for _ in range(100))


def test_an_idle_step_adds_no_forward_sample_to_the_device_budget():
    # An idle step runs no forward: the time between its bind and start is not a forward's, and counting it
    # (SMOOTH = 0.5) halved the estimate, so the next busy steps got about half their layers.
    clock = {"now": 0.0, "done": False}
    b = DeviceBudget(share=1.0, new_event=lambda: _Event(clock), record=lambda e: e.record())
    b.bound()
    clock["now"] = 10.0  # a busy step's forward: 10 ms
    b.start(idle=False)
    b.more()
    clock["now"] = 12.0
    b.end()
    b.bound()
    clock["now"] = 12.1  # an idle step: nothing ran between bind and start
    b.start(idle=True)
    b.end()
    clock["done"], clock["now"] = True, 20.0
    b.bound()
    clock["now"] = 30.0  # the next busy step's forward: 10 ms again
    b.start(idle=False)
    assert b.forward_ms == 10.0


def test_host_budget_ends_a_busy_steps_link_after_its_share_of_the_forward():
    b = HostBudget(share=0.0)
    b.bound()
    b.start(idle=False)
    assert not b.more() and not b.has_room()
    b.start(idle=True)
    assert b.more() and b.has_room()


# --------------------------------------------------------------------------------- the layout's checks


def test_one_kv_head_pages_get_canonical_strides_as_vllm_gives_flash_attention():
    cache = torch.zeros(4, N, 1, 2 * 8).permute(0, 2, 1, 3)  # one KV head per rank: a size-1 dim
    kp, vp = FlashAttnLayout.pages(cache)
    assert kp.shape == (4, N, 1, 8) and kp.stride(2) == 8 and vp.stride(2) == 8  # not the raw 2D of K||V
    assert kp.data_ptr() == cache.data_ptr() and vp.data_ptr() == cache.data_ptr() + 8 * 4
    t = torch.zeros(3, 5)
    assert canonical_strides(t) is t


def test_flash_layout_start_up_check_runs_the_kernels_on_a_cache_strided_like_the_real_one():
    like = torch.zeros(8, N, 2, 2 * 16).permute(0, 2, 1, 3)
    FlashAttnLayout(ReferenceFlashKernels()).self_check(like)

    class Transposing(ReferenceFlashKernels):  # a kernel that stores K with its heads swapped
        def cache_write(self, attn, k, v, key_cache, value_cache, slots):
            super().cache_write(attn, k.flip(1), v, key_cache, value_cache, slots)

    with pytest.raises(LayoutError, match="cache write"):
        FlashAttnLayout(Transposing()).self_check(like)

    class OffByOne(ReferenceFlashKernels):  # a varlen kernel that misses each query's own key
        def varlen(self, attn, q, key_cache, value_cache, out, plan):
            super().varlen(attn, q, key_cache, value_cache, out, _shorter(plan))

    with pytest.raises(LayoutError, match="varlen"):
        FlashAttnLayout(OffByOne()).self_check(like)


def _shorter(plan):
    from dataclasses import replace

    return replace(plan, seq_lens=plan.seq_lens - 1)


def test_the_rope_self_check_leaves_the_models_shared_rotary_table_alone():
    # vLLM shares one rotary module (and its cos/sin buffer) across layers; compiled graphs and CUDA graphs
    # captured its address. The attach-time check must not re-assign it (forward_native would, to fp32 CPU).
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding as VllmRope

    from epic_rag.engine.link import rope

    with set_current_vllm_config(VllmConfig()):
        r = VllmRope(64, 64, 4096, 10000.0, True, torch.bfloat16)
    before = r.cos_sin_cache
    rope.self_check(rope.KeyRotator(r), r, 64, 2, torch.bfloat16)
    assert r.cos_sin_cache is before and r.cos_sin_cache.dtype == torch.bfloat16


def test_a_request_failing_its_checks_on_another_tensor_parallel_rank_is_failed_on_every_rank():
    # Ranks must run the same pass (their layers' collectives stay in step): the failure flags are agreed.
    L = 2
    model = StubModel(L, 4, 2, 16)
    g = torch.Generator().manual_seed(4)
    jobs = [_job(_records(L, 2, 16, torch.float32, g), "legolink-16") for _ in range(2)]
    T = len(jobs[0].token_ids)
    caches = _flash_caches(L, 2, 16, 2 * (-(-T // N)) + 1, torch.float32)
    seen = []

    def other_rank_failed_the_first(flags):
        seen.append(list(flags))
        return [True, False]

    ln = _stub_linker(model, caches, FlashAttnLayout(_StubKernels()), 2 * T, agree=other_rank_failed_the_first)
    per = -(-T // N)
    loads = [linker.LinkLoad(j, list(range(i * per, (i + 1) * per)), 0, T) for i, j in enumerate(jobs)]
    p, rest = ln.begin(loads)
    assert seen == [[False, False]] and rest == []  # both passed here
    assert "another rank" in jobs[0].error and jobs[1].error is None
    assert [s.load.job for s in p.seqs] == [jobs[1]]


def test_a_capture_waits_on_its_own_events_not_on_the_whole_stream():
    # N10: on a GPU each capture records an event after its copies into page-locked buffers; `captured` waits
    # for those events alone (a full stream sync would also wait for link layers queued after the capture)
    from epic_rag.testing.fake_streams import FakeStreams

    L = 2
    model = StubModel(L, 4, 2, 16)
    g = torch.Generator().manual_seed(8)
    caches = _flash_caches(L, 2, 16, 6, torch.float32)
    for c in caches:
        c.copy_(torch.randn(c.shape, generator=g))
    api = FakeStreams()
    ln = _stub_linker(model, caches, FlashAttnLayout(_StubKernels()), 64, streams=api)
    k, v = torch.zeros(L, 40, 2, 16), torch.zeros(L, 40, 2, 16)
    blocks = [3, 1, 4]
    landed = [ln.capture(blocks, 0, 20, k, v, 0), ln.capture(blocks, 20, 40, k, v, 20)]
    api.launch("a link layer queued after the captures")
    ln.captured(landed)
    assert api.host_waits == landed  # FakeStream.synchronize raises: no stream sync either
    kinds = [kind for kind, _ in api.compute.log]
    assert kinds == ["copy"] * 2 * L + ["record"] + ["copy"] * 2 * L + ["record", "kernel"]
    want_k, want_v = zip(*(ln.layout.read_range(c, blocks, 0, 40) for c in caches))
    assert torch.equal(k, torch.stack(want_k)) and torch.equal(v, torch.stack(want_v))
