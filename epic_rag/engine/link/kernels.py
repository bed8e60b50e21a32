"""The fused link kernel: cached chunk K/V into vLLM's pages, keys rotated to their linked positions.

One Triton launch covers every cached token of a link pass for a group of layers: it reads each token's
K/V row where it lies (a record already in device memory, or the pass's staging buffer the host copies fed),
rotates K by the token's own position shift in fp32 registers (NeoX or GPT-J pairing, partial rotary dims
copied), rounds once to the cache dtype and stores K and V straight into the pages through the token's slot.
This replaces, per layer, a gather, a dozen elementwise rotation kernels and two scatters.

Sources and pages are addressed by raw byte addresses (int64) so one launch can read several records and
write several layers' caches; the tables are built on the host once per pass (stage.py) and copied over in
one transfer. Triton ships with vLLM's CUDA build. On a CPU the kernel runs only under TRITON_INTERPRET=1
(tests compare it with the torch path in stage.py); serving on a CPU uses the torch path.
NOT RUN ON A GPU IN CI: scripts/device_link.py runs it on one; attach checks it against the torch path on
scratch pages before links use it (stage.check_fused).
"""

from __future__ import annotations

import os

import torch

try:  # vLLM's CUDA build ships Triton; the CPU build may not have it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# Rows of the per-token table a pass hands the kernel (int64 [TABLE_ROWS, M]).
SLOT, DELTA, K_SRC, V_SRC, LSTRIDE, STAGED = range(6)
TABLE_ROWS = 6
BLOCK_T = 32  # tokens per program


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run for caches on `device`: CUDA with Triton, or (tests) a CPU under
    Triton's interpreter."""
    if triton is None:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    # Arguments that change from launch to launch are not specialised on (== 1, multiple of 16): each new
    # combination would compile another variant during the first links (0.5-2 s each on a GPU).
    @triton.jit(do_not_specialize=["M", "stage_base", "layer0"])
    def _fill_pages(
        tab,  # int64 [TABLE_ROWS, M]: slot, delta, K source, V source, layer stride (bytes), staged
        M,
        pages,  # int64 [L]: byte address of each layer's cache (logical [B, H, N, 2D] view)
        sb,
        sh,
        sn,  # the cache view's strides (elements); the last one is 1
        N,  # tokens per block
        stage_base,  # byte address of this launch's staging slot (staged sources are offsets into it)
        layer0,  # the first layer of this launch; program_id(2) adds to it
        cos_t,
        sin_t,  # fp32 [P, ROT // 2]: unit rotation tables (KeyRotator)
        D: tl.constexpr,
        ROT: tl.constexpr,
        HALF_P: tl.constexpr,
        D_P: tl.constexpr,
        REST_P: tl.constexpr,
        NEOX: tl.constexpr,
        DT: tl.constexpr,
        BT: tl.constexpr,
        ALIGN: tl.constexpr,  # every row and page address is 16-byte aligned (the host checked): vector loads
    ):
        HALF: tl.constexpr = ROT // 2
        t = tl.program_id(0) * BT + tl.arange(0, BT)  # [BT] tokens
        # addresses in int64: h * sh passes 2**31 under vLLM's LHBNC layout (sh = B * N * 2D) on large caches
        h = tl.program_id(1).to(tl.int64)
        li = layer0 + tl.program_id(2).to(tl.int64)
        m = t < M
        # table rows: SLOT, DELTA, K_SRC, V_SRC, LSTRIDE, STAGED (literals: the jitted code reads no globals)
        slot = tl.load(tab + 0 * M + t, mask=m, other=0)
        delta = tl.load(tab + 1 * M + t, mask=m, other=0)
        staged = tl.load(tab + 5 * M + t, mask=m, other=0)
        lstride = tl.load(tab + 4 * M + t, mask=m, other=0)
        # A token's row for layer li: a record's row at layer li, or its place in this launch's staging slot.
        off = staged * stage_base + (li - staged * layer0) * lstride
        k_row = (tl.load(tab + 2 * M + t, mask=m, other=0) + off).to(tl.pointer_type(DT)) + h * D  # [BT]
        v_row = (tl.load(tab + 3 * M + t, mask=m, other=0) + off).to(tl.pointer_type(DT)) + h * D
        page = tl.load(pages + li).to(tl.pointer_type(DT))
        dst = page + (slot // N) * sb + h * sh + (slot % N) * sn  # [BT]: K at dst + d, V at dst + D + d
        if ALIGN:
            k_row, v_row, dst = tl.multiple_of(k_row, 16), tl.multiple_of(v_row, 16), tl.multiple_of(dst, 16)

        j = tl.arange(0, HALF_P)
        jm = m[:, None] & (j < HALF)[None, :]
        if NEOX:
            ia, ib = j, j + HALF
        else:
            ia, ib = 2 * j, 2 * j + 1
        x1 = tl.load(k_row[:, None] + ia[None, :], mask=jm, other=0.0).to(tl.float32)
        x2 = tl.load(k_row[:, None] + ib[None, :], mask=jm, other=0.0).to(tl.float32)
        row = tl.abs(delta)[:, None] * HALF + j[None, :]
        c = tl.load(cos_t + row, mask=jm, other=1.0)
        s = tl.load(sin_t + row, mask=jm, other=0.0)
        s = tl.where((delta < 0)[:, None], -s, s)  # R(-d): the same cos, the sine negated
        tl.store(dst[:, None] + ia[None, :], (x1 * c - x2 * s).to(DT), mask=jm)
        tl.store(dst[:, None] + ib[None, :], (x2 * c + x1 * s).to(DT), mask=jm)
        if ROT < D:  # dims past the rotary ones are copied as they are
            r = ROT + tl.arange(0, REST_P)
            rm = m[:, None] & (r < D)[None, :]
            tl.store(dst[:, None] + r[None, :], tl.load(k_row[:, None] + r[None, :], mask=rm), mask=rm)
        d = tl.arange(0, D_P)
        dm = m[:, None] & (d < D)[None, :]
        tl.store(dst[:, None] + D + d[None, :], tl.load(v_row[:, None] + d[None, :], mask=dm), mask=dm)

    _DT = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def fill_pages(
    tab: torch.Tensor,
    num_tokens: int,
    pages: torch.Tensor,
    cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    is_neox: bool,
    layer0: int,
    num_layers: int,
    stage_base: int = 0,
    aligned: bool = False,
) -> None:
    """Launch the fused kernel over `num_tokens` tokens and layers [layer0, layer0 + num_layers).

    tab: int64 [TABLE_ROWS, num_tokens] on the cache's device; pages: int64 [L] byte addresses of every layer's
    cache, each shaped and strided like `cache` (logical [B, H, N, 2D], last stride 1); cos, sin: fp32
    [P, rotary_dim // 2] unit tables on the device; stage_base: byte address of the staging slot holding this
    launch's staged rows (0 when none is staged); aligned: every source row, page row and stride is a multiple of
    16 bytes (the caller checked), so the kernel may use vector loads and stores."""
    if num_tokens == 0 or num_layers == 0:
        return
    _, H, N, C = cache.shape
    D = C // 2
    sb, sh, sn, last = cache.stride()
    assert last == 1 and rotary_dim % 2 == 0 and rotary_dim <= D, (cache.stride(), rotary_dim, D)
    grid = (triton.cdiv(num_tokens, BLOCK_T), H, num_layers)
    _fill_pages[grid](
        tab,
        num_tokens,
        pages,
        sb,
        sh,
        sn,
        N,
        stage_base,
        layer0,
        cos,
        sin,
        D=D,
        ROT=rotary_dim,
        HALF_P=_pow2(rotary_dim // 2),
        D_P=_pow2(D),
        REST_P=_pow2(max(D - rotary_dim, 1)),
        NEOX=is_neox,
        DT=_DT[cache.dtype],
        BT=BLOCK_T,
        ALIGN=aligned,
        # no FMA contraction: each product rounded as torch's separate kernels round it, so the pages hold the
        # torch path's numbers bit for bit (the kernel moves bytes; the arithmetic costs nothing)
        enable_fp_fusion=False,
    )
