"""The int4 matmul (``W4Weight``, layout in models/quant/w4_weight.py): ``out[M, N] = x[M, K] @ W[N, K]^T``
streamed from the packed codes on the tensor cores, with the fusions of ``triton_gemv.py`` (RMSNorm of
x, silu(gate)·up over a packed [gate | up] weight, in-place residual add, bias).

One kernel for every row count, written per lane: Triton tensors of ``32 · num_warps`` elements, one per
thread, whose addresses come from the thread's own ``%tid.x`` (inline PTX), so that each lane holds
exactly its ``mma.sync.m16n8k16`` fragments:

- each warp owns a tile of 16 weight rows (gated: the gate tile and the matching up tile) and a block
  of 8 rows of x, the MMA's B columns (fewer rows: zeros), so 1 to 8 rows cost the same;
- per 64-wide chunk of K a lane loads its 16 bytes of codes (one ``LDG.128``) and, per 16-wide K step,
  turns one word into its four A registers with one shift and one and-or each (``1 + q/16`` as bf16
  or fp16 halves, exact) inside the same asm block as the MMA (float32 accumulation);
- the group's scale and offset enter once per group: ``Σ (q·s + z)·x = 16·s·P + (z − 16·s)·Σx`` with
  ``P = Σ (1 + q/16)·x`` from the weight MMAs and ``Σx`` (per B column) from an MMA of an all-ones A
  with the same B;
- the next chunk's codes are loaded before this chunk's arithmetic (the first before the PDL wait:
  weights are never written by a kernel of the step);
- split-K (``SPLIT`` programs share a column block's K range when the blocks alone are too few for
  the SMs): every program writes its float32 partials to the workspace (``splitk.py``), the last one
  to finish adds them in split order and runs the shared epilogue (``triton_epilogue.store_rows``);
  deterministic, no float atomics.

A row of x is one MMA column: its result never depends on the other rows, and the configuration
depends on the weight's shape only, so a row gives the same bits at every row count (batch-invariant
mode needs nothing else). Numerics: ``1 + q/16`` times a bf16/fp16 x is exact, sums in float32, so the
result is the product with the dequantized float32 weight up to summation order.

Float32 models (and CPU tensors, e.g. under Triton's interpreter) have no 16-bit MMA: ``w4_runs`` says
no and ``triton_gemv.gemv`` dequantizes and runs the float skinny matmul there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.models.quant.w4_weight import CHUNK, TILE, W4Weight
from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue
from tandem.worker.splitk import CHUNK_ROWS, workspace
from tandem.worker.triton_epilogue import store_rows

_BM = 8  # x rows per program (the MMA's N)


@triton.jit
def _thread_ids(e):
    """The hardware thread index of the thread holding each element (``%tid.x``)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [e], dtype=tl.int32, is_pure=True, pack=1)


def _mma_asm(dtype: torch.dtype) -> tuple[str, str]:
    """The inline PTX of ``_mma_codes`` and ``_mma_ones`` for a 16-bit model dtype: A register j
    from nibbles j and j + 4 of a word as ``1 + q/16`` in that dtype's bits (bf16 ``0x3F80 | q << 3``,
    fp16 ``0x3C00 | q << 6``: one shift and one ``lop3`` each), then the MMA."""
    bf16 = dtype == torch.bfloat16
    ty, one, mask = ("bf16", "0x3F803F80", "0x00780078") if bf16 else ("f16", "0x3C003C00", "0x03C003C0")
    lift = 3 if bf16 else 6  # bit of q's lowest bit in each half
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32"
    unpack = []
    for j in range(4):  # nibble j -> bits lift..lift + 3
        s = lift - 4 * j
        unpack.append(f"{'shl.b32' if s >= 0 else 'shr.u32'} t, $4, {abs(s)};")
        unpack.append(f"lop3.b32 a{j}, t, {mask}, {one}, 0xEA;")
    codes = ("{ .reg .b32 a0, a1, a2, a3, t; " + " ".join(unpack)
             + f" {mma} {{$0, $1, $2, $3}}, {{a0, a1, a2, a3}}, {{$5, $6}}, {{$7, $8, $9, $10}}; }}")
    ones = ("{ .reg .b32 o; .reg .f32 u, v; " + f"mov.b32 o, {one}; "
            + f"{mma} {{$0, $1, u, v}}, {{o, o, o, o}}, {{$2, $3}}, {{$4, $5, $4, $5}}; }}")
    return codes, ones


@triton.jit
def _mma_codes(w, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
    """D = A · B + C for one 16-wide K step: A (16 weight rows) from word ``w`` of the lane's chunk —
    A register j from nibbles j and j + 4 as two 16-bit floats ``1 + q/16`` — B (this lane's x pairs
    ``b0``, ``b1``), C / D the lane's four float32 accumulators (rows g, g + 8 × columns 2τ, 2τ + 1).
    ``ASM``: ``_mma_asm(dtype)[0]``."""
    return tl.inline_asm_elementwise(ASM, "=f,=f,=f,=f,r,r,r,f,f,f,f", [w, b0, b1, c0, c1, c2, c3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _mma_ones(b0, b1, c0, c1, ASM: tl.constexpr):
    """Σ over the step's 16 K slots of B's columns 2τ, 2τ + 1 (an MMA with A = ones), added to c0, c1.
    ``ASM``: ``_mma_asm(dtype)[1]``."""
    return tl.inline_asm_elementwise(ASM, "=f,=f,r,r,f,f", [b0, b1, c0, c1], dtype=(tl.float32, tl.float32),
                                     is_pure=True, pack=1)


@triton.jit
def _split4(v):
    """[E, 4] -> its four columns."""
    E: tl.constexpr = v.shape[0]
    a, b = tl.split(tl.reshape(v, [E, 2, 2]))  # a: columns 0, 2; b: 1, 3
    c0, c2 = tl.split(a)
    c1, c3 = tl.split(b)
    return c0, c1, c2, c3


@triton.jit
def _word(v, s: tl.constexpr):
    """Column s of [E, 4]."""
    c0, c1, c2, c3 = _split4(v)
    if s == 0:
        return c0
    elif s == 1:
        return c1
    elif s == 2:
        return c2
    else:
        return c3


@triton.jit
def _b_pairs(x_ptr, xi_ptr, nw_ptr, m, m_ok, tau, k0, K: tl.constexpr, NORM: tl.constexpr, dt: tl.constexpr):
    """This lane's B registers for the K step at ``k0``: x[m, k0 + 4τ + 0..3] (times the norm weight,
    rounded to dt, with NORM) as two pairs of 16-bit floats; and Σ x² of the raw values (NORM)."""
    k = k0 + tau[:, None] * 4 + tl.arange(0, 4)[None, :]  # [E, 4]
    ok = m_ok[:, None] & (k < K)
    if NORM:
        xf = tl.load(x_ptr[:, None] + k, mask=ok, other=0.0).to(tl.float32)
        sq = tl.sum(xf * xf, 1)
        nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
        bits = (xf * nw).to(dt).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        v0, v1, v2, v3 = _split4(bits)
        return v0 | (v1 << 16), v2 | (v3 << 16), sq
    else:
        p = k0 // 2 + tau[:, None] * 2 + tl.arange(0, 2)[None, :]  # pairs (2p, 2p + 1)
        pr = tl.load(xi_ptr[:, None] + p, mask=m_ok[:, None] & (2 * p < K), other=0)  # [E, 2] int32 pairs
        b0, b1 = tl.split(pr)
        return b0, b1, tl.zeros_like(b0).to(tl.float32)


@triton.jit
def _step_codes(wq, uq, st, wmask, STEP: tl.constexpr, GATED: tl.constexpr):
    """The lane's codes of K step ``st`` (one or two chunks; GATED: of the up tile too); chunks a step
    does not have come back as the first one (unused)."""
    wa = tl.load(wq + st * STEP * 128, mask=wmask, other=0)
    wb = wa
    ua = wa
    ub = wa
    if STEP == 2:
        wb = tl.load(wq + (st * STEP + 1) * 128, mask=wmask, other=0)
    if GATED:
        ua = tl.load(uq + st * STEP * 128, mask=wmask, other=0)
        if STEP == 2:
            ub = tl.load(uq + (st * STEP + 1) * 128, mask=wmask, other=0)
    return wa, wb, ua, ub


@triton.jit(do_not_specialize=["M"])  # (M = 1 specialized: more registers, fewer warps per SM, slower)
def _w4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, eps,
    M, N, stride_xm, stride_sn, stride_rm, stride_om, up_off,
    K: tl.constexpr, CHUNKS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr,
    MMA_ASM: tl.constexpr, ONES_ASM: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row block of 8, split, column block of 16 · W weight rows), row blocks fastest, then
    splits: the programs that stream the same codes run together (L2)."""
    E: tl.constexpr = 32 * W
    BN: tl.constexpr = 16 * W
    STEP: tl.constexpr = GROUP // 64 if GROUP >= 64 else 1  # chunks per loop step (one group, or a chunk)
    STEPS: tl.constexpr = CHUNKS // STEP
    SPS: tl.constexpr = (STEPS + SPLIT - 1) // SPLIT  # steps per split
    TW: tl.constexpr = CHUNKS * 128  # words per tile
    dt = s_ptr.dtype.element_ty
    pid = tl.program_id(0)
    mblocks = tl.cdiv(M, 8)
    mb = pid % mblocks
    pid = pid // mblocks
    sp = pid % SPLIT
    nb = pid // SPLIT
    tid = _thread_ids(tl.arange(0, E))
    lane = tid % 32
    g = lane // 4
    tau = lane % 4
    tile = nb * W + tid // 32
    tile_ok = tile < N // 16
    wq = w_ptr + tile.to(tl.int64)[:, None] * TW + lane[:, None] * 4 + tl.arange(0, 4)[None, :]
    uq = wq + (up_off // 16) * TW  # GATED: the up tile
    st_lo = sp * SPS
    st_hi = tl.minimum(st_lo + SPS, STEPS)
    wmask = tile_ok[:, None] & (st_lo < st_hi)  # (a split past the end loads nothing)
    # the first step's codes: loaded before the PDL wait (no kernel of the step writes weights)
    wa_n, wb_n, ua_n, ub_n = _step_codes(wq, uq, st_lo, wmask, STEP, GATED)
    if PDL:
        pdl_prologue()

    m = mb * 8 + g  # this lane's x row: B column g
    m_ok = m < M
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    xi_row = x_ptr.to(tl.pointer_type(tl.int32)) + m.to(tl.int64) * (stride_xm // 2)
    r0 = (tile * 16 + g).to(tl.int64)  # this lane's weight rows r0, r0 + 8
    s_a = s_ptr + r0 * stride_sn
    z_a = z_ptr + r0 * stride_sn
    zero = tl.zeros([E], dtype=tl.float32)
    acc0, acc1, acc2, acc3 = zero, zero, zero, zero  # rows r0 / r0 + 8 × x rows 2τ / 2τ + 1
    acu0, acu1, acu2, acu3 = zero, zero, zero, zero  # the same for the up rows (GATED)
    ssq = zero
    for st in range(st_lo, st_hi):
        wa = wa_n
        wb = wb_n
        ua = ua_n
        ub = ub_n
        nxt = tl.minimum(st + 1, st_hi - 1)  # the last step reloads its own codes (cached)
        wa_n, wb_n, ua_n, ub_n = _step_codes(wq, uq, nxt, wmask, STEP, GATED)
        d0, d1, d2, d3 = zero, zero, zero, zero
        du0, du1, du2, du3 = zero, zero, zero, zero
        e0, e1 = zero, zero
        for cc in tl.static_range(STEP):
            c = st * STEP + cc
            if cc == 0:
                wv = wa
                uv = ua
            else:
                wv = wb
                uv = ub
            for s in tl.static_range(4):
                k0 = c * 64 + s * 16
                b0, b1, sq = _b_pairs(x_row, xi_row, nw_ptr, m, m_ok, tau, k0, K, NORM, dt)
                if NORM:
                    ssq += sq
                e0, e1 = _mma_ones(b0, b1, e0, e1, ONES_ASM)
                d0, d1, d2, d3 = _mma_codes(_word(wv, s), b0, b1, d0, d1, d2, d3, MMA_ASM)
                if GATED:
                    du0, du1, du2, du3 = _mma_codes(_word(uv, s), b0, b1, du0, du1, du2, du3, MMA_ASM)
                if (cc * 64 + (s + 1) * 16) % GROUP == 0:  # a group ends: its scale and offset, once
                    grp = k0 // GROUP
                    sa = tl.load(s_a + grp, mask=tile_ok, other=0.0).to(tl.float32) * 16.0
                    za = tl.load(z_a + grp, mask=tile_ok, other=0.0).to(tl.float32) - sa
                    sb = tl.load(s_a + 8 * stride_sn + grp, mask=tile_ok, other=0.0).to(tl.float32) * 16.0
                    zb = tl.load(z_a + 8 * stride_sn + grp, mask=tile_ok, other=0.0).to(tl.float32) - sb
                    acc0 += sa * d0 + za * e0
                    acc1 += sa * d1 + za * e1
                    acc2 += sb * d2 + zb * e0
                    acc3 += sb * d3 + zb * e1
                    if GATED:
                        uo = up_off * stride_sn
                        sa = tl.load(s_a + uo + grp, mask=tile_ok, other=0.0).to(tl.float32) * 16.0
                        za = tl.load(z_a + uo + grp, mask=tile_ok, other=0.0).to(tl.float32) - sa
                        sb = tl.load(s_a + uo + 8 * stride_sn + grp, mask=tile_ok, other=0.0).to(tl.float32) * 16.0
                        zb = tl.load(z_a + uo + 8 * stride_sn + grp, mask=tile_ok, other=0.0).to(tl.float32) - sb
                        acu0 += sa * du0 + za * e0
                        acu1 += sa * du1 + za * e1
                        acu2 += sb * du2 + zb * e0
                        acu3 += sb * du3 + zb * e1
                    d0, d1, d2, d3 = zero, zero, zero, zero
                    du0, du1, du2, du3 = zero, zero, zero, zero
                    e0, e1 = zero, zero

    # partials to the workspace: [SPLIT, rows, width] float32, then [SPLIT, rows, 4] sums of squares
    mp = mblocks * 8
    width = N + up_off
    ma = mb * 8 + 2 * tau  # the x rows of this lane's columns
    ok_a = tile_ok & (ma < M)
    ok_b = tile_ok & (ma + 1 < M)
    at_a = ws_ptr + (sp * mp + ma).to(tl.int64) * width + r0
    at_b = at_a + width
    tl.store(at_a, acc0, mask=ok_a)
    tl.store(at_a + 8, acc2, mask=ok_a)
    tl.store(at_b, acc1, mask=ok_b)
    tl.store(at_b + 8, acc3, mask=ok_b)
    if GATED:
        tl.store(at_a + N, acu0, mask=ok_a)
        tl.store(at_a + N + 8, acu2, mask=ok_a)
        tl.store(at_b + N, acu1, mask=ok_b)
        tl.store(at_b + N + 8, acu3, mask=ok_b)
    if NORM:  # warp 0's lanes hold x row m's squares split over τ
        tl.store(ws_ptr + SPLIT * mp * width + (sp * mp + m) * 4 + tau, ssq, mask=(tid < 32) & m_ok)
    tl.debug_barrier()  # every thread's partials written before they are read back / released
    last = tl.full([], 1, tl.int1)
    if SPLIT > 1:
        cnt = cnt_ptr + nb * mblocks + mb
        last = tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1
    if last:  # sum the splits in order and finish the block
        n = nb * BN + tl.arange(0, BN)
        mr = mb * 8 + tl.arange(0, 8)
        om = (n < N)[:, None] & (mr < M)[None, :]
        acc = tl.zeros([BN, 8], dtype=tl.float32)
        acc_u = tl.zeros([BN, 8], dtype=tl.float32)
        ss = tl.zeros([8], dtype=tl.float32)
        for s2 in tl.static_range(SPLIT):
            at = ws_ptr + (s2 * mp + mr[None, :]).to(tl.int64) * width + n[:, None]
            acc += tl.load(at, mask=om, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_u += tl.load(at + N, mask=om, other=0.0, cache_modifier=".cg")
            if NORM:
                sq_at = ws_ptr + SPLIT * mp * width + (s2 * mp + mr[:, None]) * 4 + tl.arange(0, 4)[None, :]
                ss += tl.sum(tl.load(sq_at, mask=(mr < M)[:, None], other=0.0, cache_modifier=".cg"), 1)
        if SPLIT > 1:
            tl.atomic_xchg(cnt_ptr + nb * mblocks + mb, 0)  # ready for the next launch
        store_rows(tl.trans(acc), tl.trans(acc_u), ss, mr, n, mr < M, n < N, b_ptr, res_ptr, out_ptr,
                   stride_rm, stride_om, up_off, eps, dt, K, NORM, HAS_BIAS, GATED, HAS_RES)


class W4Config(NamedTuple):
    """Launch configuration of ``_w4_kernel``: warps per program (each a tile of 16 weight rows) and
    the split of K."""
    warps: int
    split: int


def w4_config(n: int, k: int, group: int, gated: bool) -> W4Config:
    """The configuration for an [m, k] x [n, k]^T int4 product (``n``: weight rows; gated: both halves).
    Depends on the shape only, never on the row count (batch invariance). Split-K doubles while there
    are fewer than 3072 warps (8 warps per program, 4 for gated weights) and every split keeps at least
    two steps. From the sweeps of
    docs/performance.md §47 (8B shapes, one row): on the H100 with the decode fusions the fastest were
    qkv (8, 4) 16.7 µs, o (8, 8) 8.0, gate_up (4, 8) 34.1, down (8, 16) 15.6 (4 warps everywhere: 20.8 /
    9.0 / 34.3 / 16.2); on the H200 (prototype, plain products) warps mattered less than the split."""
    warps = 4 if gated else 8
    tiles = (n // 2 if gated else n) // TILE
    steps = -(-k // max(group, CHUNK))
    split = 1
    while -(-tiles // warps) * split * warps < 3072 and steps // (2 * split) >= 2:
        split *= 2
    return W4Config(warps, split)


def w4_runs(x: torch.Tensor, w: W4Weight, nout: int) -> bool:
    """Can ``_w4_kernel`` take this product? 16-bit model dtype on a CUDA device, x rows of an even
    stride (read as pairs), whole tiles of output rows (gated: per half). Otherwise ``triton_gemv``
    dequantizes and runs the float kernel (float32 models, CPU tensors under Triton's interpreter)."""
    return (w.dtype in (torch.bfloat16, torch.float16) and x.device.type == "cuda" and x.stride(0) % 2 == 0
            and nout % TILE == 0)


def w4_gemv(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, gated: bool, residual: torch.Tensor | None, out: torch.Tensor,
            config: tuple[int, ...] | None) -> None:
    """Launch for ``triton_gemv.gemv`` (arguments checked there); ``config``: a ``W4Config`` (warps,
    split) instead of ``w4_config``'s."""
    mrows, kin = x.shape
    nout = out.shape[1]
    cfg = W4Config(*config) if config is not None else w4_config(w.shape[0], kin, w.group, gated)
    mma_asm, ones_asm = _mma_asm(w.dtype)
    pdl = pdl_enabled(x.device)
    nblocks = triton.cdiv(nout // TILE, cfg.warps)
    width = nout * (2 if gated else 1)
    for r0 in range(0, mrows, CHUNK_ROWS):  # bounded workspace: at most 64 rows per launch
        r1 = min(mrows, r0 + CHUNK_ROWS)
        mblocks = triton.cdiv(r1 - r0, _BM)
        ws, cnt = workspace(x.device, cfg.split * mblocks * _BM * (width + 4), nblocks * mblocks)
        o = out[r0:r1]
        _w4_kernel[(nblocks * cfg.split * mblocks,)](
            x[r0:r1], w.qweight, w.scale, w.offset, bias if bias is not None else o,
            norm_weight if norm_weight is not None else o, o, o, ws, cnt, eps, r1 - r0, nout, x.stride(0),
            w.scale.stride(0), o.stride(0), o.stride(0), nout if gated else 0,
            K=kin, CHUNKS=w.kp // CHUNK, GROUP=w.group, W=cfg.warps, SPLIT=cfg.split,
            MMA_ASM=mma_asm, ONES_ASM=ones_asm,
            HAS_BIAS=bias is not None, NORM=norm_weight is not None, GATED=gated, HAS_RES=residual is not None,
            PDL=pdl, num_warps=cfg.warps, num_stages=1, **launch_kwargs(pdl))
