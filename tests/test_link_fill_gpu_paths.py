"""The fused page filler's GPU-only behaviour, made checkable on a CPU (issue 33: N2, N5, N7, N9): the staging
ring's copies and events replayed on fake streams in the orders a GPU may run them, the start-up check against
the torch filler with its fallback, the kernel compiled for sm_90 by Triton's CUDA backend (no GPU needed), its
specialisation, and the group size of small links."""

from __future__ import annotations

import logging

import pytest
import torch

from epic_rag.engine.link import kernels, stage
from epic_rag.engine.link.layout import FlashAttnLayout
from epic_rag.engine.link.rope import KeyRotator
from epic_rag.testing.fake_streams import FakeStreams, ahead, replay, shuffled
from epic_rag.testing.stub_model import RotaryEmbedding

N = 16  # tokens per block


def _caches(L, H, D, B, dtype=torch.float32):
    """vLLM 0.32's FlashAttention caches: per layer a logical [B, H, N, 2D] view of physical [B, N, H, 2D]."""
    return [torch.zeros(B, N, H, 2 * D, dtype=dtype).permute(0, 2, 1, 3) for _ in range(L)]


def _plan(L, H, D, g, B, sizes=((37, 300), (21, -5), (16, 0))):
    plan = stage.FillPlan()
    free = torch.randperm(B * N, generator=g)
    used = 0
    for n, delta in sizes:
        k, v = (torch.randn(L, n + 1, H, D, generator=g) for _ in range(2))
        plan.add(k[:, 1:], v[:, 1:], delta, free[used : used + n].sort().values)
        used += n
    return plan


def _torch_pages(plan, L, H, D, B, rot):
    want = _caches(L, H, D, B)
    f = stage.TorchFiller(FlashAttnLayout(), rot, want, plan.num_rows)
    st = f.begin(plan)
    for li in range(L):
        f.layer(st, li)
    return want


# ------------------------------------------------------------------ the staging ring, on fake streams


def _ring_run(monkeypatch, passes=2, L=7, sabotage=None):
    """Two passes through a TritonFiller whose ring holds about one layer (groups of one layer, both slots,
    events carried from one pass to the next), on fake streams; the kernel launches logged as the compute
    stream's work. Returns (api, filler, copies per group, pages, reference pages)."""
    H, D, B = 2, 32, 12
    g = torch.Generator().manual_seed(5)
    rot = KeyRotator(RotaryEmbedding(D))
    plan = _plan(L, H, D, g, B)
    got = _caches(L, H, D, B)
    holder = {}

    def slot_of(ptr):
        for i, buf in enumerate(holder["f"]._ring):
            if buf.data_ptr() <= ptr < buf.data_ptr() + buf.numel() * buf.element_size():
                return i
        raise AssertionError(f"a staging copy outside the ring at {ptr:#x}")

    api = FakeStreams(tag_copy=lambda dst, src: slot_of(dst.data_ptr()))
    f = holder["f"] = stage.TritonFiller(rot, got, plan.num_rows, stage_all=True, streams=api)
    if sabotage:
        sabotage(f)
    launch = kernels.fill_pages

    def logged(*a, **k):
        api.launch(slot_of(k["stage_base"]))
        return launch(*a, **k)

    monkeypatch.setattr(kernels, "fill_pages", logged)
    for _ in range(passes):
        st = f.begin(plan)
        for li in range(L):
            f.layer(st, li)
    assert 1 <= st.group < L and len(st.host) == 3
    return api, f, 2 * len(st.host), got, _torch_pages(plan, L, H, D, B, rot)


def _checker(per_group):
    """At every kernel: its slot holds exactly its own group's copies (all landed: no stale read; none of
    the group two later yet: no overwrite of a slot still being read)."""
    copies, kernels_run = [0, 0], [0, 0]

    def check(kind, slot):
        if kind == "copy":
            copies[slot] += 1
        else:
            want = (kernels_run[slot] + 1) * per_group
            assert copies[slot] == want, (
                f"kernel {kernels_run[slot]} of slot {slot} ran with {copies[slot]} copies landed there, not {want}"
            )
            kernels_run[slot] += 1

    return check


def test_the_staging_ring_never_overwrites_a_slot_being_read_nor_reads_one_still_being_copied(interpreted, monkeypatch):
    api, f, per_group, got, want = _ring_run(monkeypatch)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # the data, in issue order
    # every copy on the side stream, every kernel on the compute stream
    side = [s for s in api.streams if s is not api.compute]
    assert len(side) == 1 and {k for k, _ in side[0].log} == {"copy", "wait", "record"}
    assert {k for k, _ in api.compute.log} == {"kernel", "wait", "record"}
    orders = [ahead("side"), ahead("compute")] + [shuffled(seed) for seed in range(40)]
    for pick in orders:  # the copy stream as far ahead as allowed, the compute stream, random interleavings
        run = replay(api, pick, _checker(per_group))
        assert sum(kind == "kernel" for _, kind, _ in run) == f.launches
    assert api.host_waits == []  # the host never waits


def test_the_ring_replay_catches_a_copy_that_does_not_wait_for_the_slot_to_be_free(interpreted, monkeypatch):
    # the check above can fail: without the copy stream's wait on the slot's `free` event, a copy stream that
    # runs ahead overwrites a slot whose kernel has not run
    def no_free_wait(f):
        f._copy.wait_event = lambda e: None

    api, _, per_group, _, _ = _ring_run(monkeypatch, sabotage=no_free_wait)
    with pytest.raises(AssertionError, match="copies landed"):
        replay(api, ahead("side"), _checker(per_group))


def test_the_ring_replay_catches_a_kernel_that_does_not_wait_for_its_copies(interpreted, monkeypatch):
    def no_ready_wait(f):
        real = f.streams.current

        class _NoWait:
            def __init__(self, s):
                self.s = s

            def wait_event(self, e):
                return None

            def __getattr__(self, name):
                return getattr(self.s, name)

        f.streams.current = lambda: _NoWait(real())

    api, _, per_group, _, _ = _ring_run(monkeypatch, sabotage=no_ready_wait)
    with pytest.raises(AssertionError, match="copies landed"):
        replay(api, ahead("compute"), _checker(per_group))


def test_a_small_link_is_staged_in_groups_so_its_copies_overlap_the_layers(interpreted):
    # One chunk and a ring sized for a whole pass: the slot holds every layer, yet group 0's copy (which no
    # compute overlaps) must stay a small part of the copies.
    L, H, D, B = 16, 2, 32, 12
    g = torch.Generator().manual_seed(6)
    rot = KeyRotator(RotaryEmbedding(D))
    plan = _plan(L, H, D, g, B, sizes=((40, 7),))
    f = stage.TritonFiller(rot, _caches(L, H, D, B), 4096, stage_all=True)
    st = f.begin(plan)
    assert st.group <= -(-L // stage.MIN_GROUPS) == 2
    for li in range(L):
        f.layer(st, li)
    assert f.launches == -(-L // st.group) >= stage.MIN_GROUPS


# ------------------------------------------------------------------------- the start-up check at attach


def _linkable(L=3, H=2, D=32, B=12):
    rot = KeyRotator(RotaryEmbedding(D))
    return FlashAttnLayout(), rot, _caches(L, H, D, B)


def test_the_start_up_check_keeps_the_fused_filler_where_it_writes_the_torch_fillers_pages(interpreted):
    layout, rot, caches = _linkable()
    filler, check = stage.choose_filler(layout, rot, caches, 256)
    assert isinstance(filler, stage.TritonFiller) and check.passed is True and check.filler == "TritonFiller"
    assert all(not bool(c.ne(0).any()) for c in caches)  # scratch pages only: the real ones untouched


@pytest.mark.parametrize(
    "fault",
    ["wrong pages", "compile error"],
)
def test_a_fused_filler_failing_its_start_up_check_falls_back_to_the_torch_filler(
    interpreted, monkeypatch, caplog, fault
):
    launch = kernels.fill_pages

    def broken(*a, **k):
        if fault == "compile error":
            raise RuntimeError("triton.CompilationError: at 12:4: unsupported pointer cast")
        launch(*a, **{**k, "layer0": k["layer0"]})
        a[3].zero_()  # a kernel that loses the first layer's pages (of the cache it is given)

    monkeypatch.setattr(kernels, "fill_pages", broken)
    layout, rot, caches = _linkable()
    with caplog.at_level(logging.WARNING, logger=stage.__name__):
        filler, check = stage.choose_filler(layout, rot, caches, 256)
    assert isinstance(filler, stage.TorchFiller) and check.passed is False and check.filler == "TorchFiller"
    assert ("differ from the torch filler" if fault == "wrong pages" else "CompilationError") in check.reason
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "torch filler" in warned[0].getMessage()


def test_the_torch_filler_chosen_outright_or_the_fused_one_forced_runs_no_check():
    layout, rot, caches = _linkable()
    _, check = stage.choose_filler(layout, rot, caches, 256, fused=False)
    assert check.passed is None and check.filler == "TorchFiller"


def test_scratch_pages_have_the_real_caches_strides_where_blocks_are_outermost():
    like = torch.zeros(64, N, 8, 2 * 128).permute(0, 2, 1, 3)[:40]  # FlashAttention's NHD, a slice of more
    s = stage._scratch_like(like, 5)
    assert s.shape == (5, 8, N, 256) and s.stride() == like.stride()
    hnd = torch.zeros(8, 64, N, 256).permute(1, 0, 2, 3)  # heads outermost (vLLM's HND layout)
    s = stage._scratch_like(hnd, 5)
    assert s.shape == (5, 8, N, 256) and s.stride() == (N * 256, 5 * N * 256, 256, 1)


# ------------------------------------------------------------------------------ the kernel as compiled


def _compile_sm90():
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"tab": "*i64", "M": "i32", "pages": "*i64", "sb": "i32", "sh": "i32", "sn": "i32", "N": "i32"}
    sig |= {"stage_base": "i64", "layer0": "i32", "cos_t": "*fp32", "sin_t": "*fp32"}
    consts = {"D": 128, "ROT": 128, "HALF_P": 64, "D_P": 128, "REST_P": 1, "NEOX": True, "DT": tl.bfloat16}
    consts |= {"BT": kernels.BLOCK_T, "ALIGN": True}
    sig |= dict.fromkeys(consts, "constexpr")
    src = ASTSource(kernels._fill_pages, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})


def test_the_kernel_computes_page_addresses_in_64_bits_for_caches_past_2_gib():
    # Under vLLM's LHBNC layout a head's stride is B * N * 2D: h * sh passes 2**31 on large caches. The kernel
    # compiled for sm_90 (Triton's CUDA backend runs without a GPU) must widen both before multiplying.
    ttir = _compile_sm90().asm["ttir"]
    assert "arith.extsi %sh : i32 to i64" in ttir and "arith.extsi %h : i32 to i64" in ttir
    assert "arith.muli %h, %sh : i32" not in ttir


def test_the_kernel_is_not_specialised_on_what_changes_from_launch_to_launch():
    # M (tokens of the pass), layer0 (the group's first layer) and stage_base (the ring slot's address) change
    # between launches; Triton specialises an int on == 1 and multiples of 16, so each would compile variants
    # in the first links
    if kernels.triton is None:
        pytest.skip("no Triton")
    free = {p.name for p in kernels._fill_pages.params if p.do_not_specialize}
    assert {"M", "layer0", "stage_base"} <= free


def test_the_torch_filler_copies_records_without_stalling_the_host_per_record():
    # The torch filler is the fallback after a failed start-up check: on a GPU a blocking copy from a
    # page-locked record waits for the stream once per record per layer.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        blocking = 0
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten.copy_.default:
                self.count += 1
                self.blocking += not (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
            return func(*args, **kwargs)

    L, H, D, B = 2, 2, 32, 12
    g = torch.Generator().manual_seed(9)
    rot = KeyRotator(RotaryEmbedding(D))
    plan = _plan(L, H, D, g, B)
    f = stage.TorchFiller(FlashAttnLayout(), rot, _caches(L, H, D, B), plan.num_rows)
    st = f.begin(plan)
    with Copies() as c:
        f.layer(st, 0)
    assert c.count >= 2 * len(plan.segments) and c.blocking == c.count - 2 * len(plan.segments)
