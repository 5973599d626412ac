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


def _mma_asm(dtype: torch.dtype) -> tuple[str, str, str, str]:
    """The inline PTX of ``_mma_codes``, ``_mma_ones``, ``_ones`` and ``_mul2`` for a 16-bit model
    dtype: A register j from nibbles j and j + 4 of a word as ``1 + q/16`` in that dtype's bits (bf16
    ``0x3F80 | q << 3``, fp16 ``0x3C00 | q << 6``: one shift and one ``lop3`` each), then the MMA; an
    MMA with an all-ones A; four registers of ones; a paired product rounded once."""
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
    ones = f"{mma} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, {{$10, $11, $12, $13}};"
    fill = " ".join(f"mov.b32 ${i}, {one};" for i in range(4))
    mul = f"mul.rn.{ty}x2 $0, $1, $2;"
    return codes, ones, fill, mul


@triton.jit
def _mma_codes(w, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
    """D = A · B + C for one 16-wide K step: A (16 weight rows) from word ``w`` of the lane's chunk —
    A register j from nibbles j and j + 4 as two 16-bit floats ``1 + q/16`` — B (this lane's x pairs
    ``b0``, ``b1``), C / D the lane's four float32 accumulators (rows g, g + 8 × columns 2τ, 2τ + 1).
    ``ASM``: ``_mma_asm(dtype)[0]``."""
    return tl.inline_asm_elementwise(ASM, "=f,=f,=f,=f,r,r,r,f,f,f,f", [w, b0, b1, c0, c1, c2, c3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _ones(e, ASM: tl.constexpr):
    """Four registers holding two 16-bit ones each, made once outside the loop: the all-ones A of
    ``_mma_ones`` (not pure, so the four stay distinct registers, an aligned quad for the MMA, rather
    than one register copied into a quad at every MMA). ``ASM``: ``_mma_asm(dtype)[2]``."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,r", [e], dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                                     is_pure=False, pack=1)


@triton.jit
def _mma_ones(o0, o1, o2, o3, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
    """Σ over the step's 16 K slots of B's columns (A = ``_ones``), added to the lane's c0..c3 (c0 = c2:
    column 2τ, c1 = c3: column 2τ + 1; four accumulators so that C is a quad without copies).
    ``ASM``: ``_mma_asm(dtype)[1]``."""
    return tl.inline_asm_elementwise(ASM, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [o0, o1, o2, o3, b0, b1, c0, c1, c2, c3],
                                     dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _mul2(a, b, ASM: tl.constexpr):
    """Two 16-bit products per register, each rounded once (as ``(x * w).to(dt)`` in float32 would).
    ``ASM``: ``_mma_asm(dtype)[3]``."""
    return tl.inline_asm_elementwise(ASM, "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1)


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
def _b_pairs(xi_ptr, nwi_ptr, m_ok, tau, k0, K: tl.constexpr, NORM: tl.constexpr, MUL_ASM: tl.constexpr):
    """This lane's B registers for the K step at ``k0``: x[m, k0 + 4τ + 0..3] as two pairs of 16-bit
    floats (with NORM, times the norm weight, each product rounded to the model dtype)."""
    p = tl.multiple_of(k0 // 2 + tau * 2, 2)[:, None] + tl.arange(0, 2)[None, :]  # pairs (2p, 2p + 1)
    pr = tl.load(xi_ptr[:, None] + p, mask=m_ok[:, None] & (p < K // 2), other=0)  # [E, 2] int32 pairs
    x0, x1 = tl.split(pr)
    if NORM:
        n0, n1 = tl.split(tl.load(nwi_ptr + p, mask=p < K // 2, other=0))
        return _mul2(x0, n0, MUL_ASM), _mul2(x1, n1, MUL_ASM)
    else:
        return x0, x1


@triton.jit
def _step_codes(wq, uq, st, wmask, umask, STEP: tl.constexpr, SECOND: tl.constexpr):
    """The lane's codes of K step ``st`` (one or two chunks; SECOND: of its second tile too); chunks a
    step does not have come back as the first one (unused)."""
    wa = tl.load(wq + st * STEP * 128, mask=wmask, other=0)
    wb = wa
    ua = wa
    ub = wa
    if STEP == 2:
        wb = tl.load(wq + (st * STEP + 1) * 128, mask=wmask, other=0)
    if SECOND:
        ua = tl.load(uq + st * STEP * 128, mask=umask, other=0)
        if STEP == 2:
            ub = tl.load(uq + (st * STEP + 1) * 128, mask=umask, other=0)
    return wa, wb, ua, ub


@triton.jit
def _group_scales(s_a, z_a, grp, ok, stride_sn):
    """Rows r0 and r0 + 8 of group ``grp``: 16·scale and offset − 16·scale, float32 (the form the
    ``1 + q/16`` sums take them in)."""
    sa = tl.load(s_a + grp, mask=ok, other=0.0).to(tl.float32) * 16.0
    za = tl.load(z_a + grp, mask=ok, other=0.0).to(tl.float32) - sa
    sb = tl.load(s_a + 8 * stride_sn + grp, mask=ok, other=0.0).to(tl.float32) * 16.0
    zb = tl.load(z_a + 8 * stride_sn + grp, mask=ok, other=0.0).to(tl.float32) - sb
    return sa, za, sb, zb


@triton.jit
def _step_weights(wq, uq, s_a, z_a, o2s, st, wmask, umask, ok1, ok2, stride_sn, STEP: tl.constexpr,
                  SECOND: tl.constexpr, PRE: tl.constexpr):
    """Everything of the weight a lane needs for K step ``st``: its codes (``_step_codes``) and, with
    one group per step (PRE), the group's scales and offsets of both tiles (else zeros, unused)."""
    wa, wb, ua, ub = _step_codes(wq, uq, st, wmask, umask, STEP, SECOND)
    sa, za, sb, zb = _group_scales(s_a, z_a, st, ok1, stride_sn) if PRE else (wa * 0.0, wa * 0.0, wa * 0.0, wa * 0.0)
    sa2, za2, sb2, zb2 = sa, za, sb, zb
    if SECOND and PRE:
        sa2, za2, sb2, zb2 = _group_scales(s_a + o2s, z_a + o2s, st, ok2, stride_sn)
    return wa, wb, ua, ub, sa, za, sb, zb, sa2, za2, sb2, zb2


@triton.jit(do_not_specialize=["M"])  # (M = 1 specialized: more registers, fewer warps per SM, slower)
def _w4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, eps,
    M, N, stride_xm, stride_sn, stride_rm, stride_om, up_off,
    K: tl.constexpr, CHUNKS: tl.constexpr, GROUP: tl.constexpr, W: tl.constexpr, SPLIT: tl.constexpr,
    TILES: tl.constexpr, DEPTH: tl.constexpr, MMA_ASM: tl.constexpr, ONES_ASM: tl.constexpr, FILL_ASM: tl.constexpr,
    MUL_ASM: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row block of 8, split, column block of 16 · W · TILES weight rows), row blocks fastest,
    then splits: the programs that stream the same codes run together (L2). Each warp streams a second
    tile with the same x (B and Σx shared): the up tile of its gate tile (GATED), or with TILES = 2 the
    tile W tiles on."""
    E: tl.constexpr = 32 * W
    BN: tl.constexpr = 16 * W * TILES
    SECOND: tl.constexpr = GATED or TILES == 2
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
    tile = nb * (W * TILES) + tid // 32
    tile_ok = tile < N // 16
    tile2_ok = (tile + W) < N // 16 if TILES == 2 else tile_ok
    off2 = up_off if GATED else 16 * W  # rows from a lane's first tile to its second
    wq = w_ptr + tile.to(tl.int64)[:, None] * TW + lane[:, None] * 4 + tl.arange(0, 4)[None, :]
    uq = wq + (off2 // 16) * TW  # SECOND: the second tile
    st_lo = sp * SPS
    st_hi = tl.minimum(st_lo + SPS, STEPS)
    wmask = tile_ok[:, None] & (st_lo < st_hi)  # (a split past the end loads nothing)
    umask = tile2_ok[:, None] & (st_lo < st_hi)
    r0 = (tile * 16 + g).to(tl.int64)  # this lane's weight rows r0, r0 + 8
    s_a = s_ptr + r0 * stride_sn
    z_a = z_ptr + r0 * stride_sn
    o2s = off2 * stride_sn  # the second tile's scales
    # the first step's codes (and, one group per step, its scales): loaded before the PDL wait (no
    # kernel of the step writes weights)
    PRE: tl.constexpr = GROUP >= 64  # one group per step: its scales travel with its codes
    ok1 = tile_ok & (st_lo < st_hi)
    ok2 = tile2_ok & (st_lo < st_hi)
    nx = _step_weights(wq, uq, s_a, z_a, o2s, st_lo, wmask, umask, ok1, ok2, stride_sn, STEP, SECOND, PRE)
    nx2 = nx
    if DEPTH == 2:  # two steps in flight
        nx2 = _step_weights(wq, uq, s_a, z_a, o2s, tl.minimum(st_lo + 1, st_hi - 1), wmask, umask, ok1, ok2,
                            stride_sn, STEP, SECOND, PRE)
    if PDL:
        pdl_prologue()

    m = mb * 8 + g  # this lane's x row: B column g
    m_ok = m < M
    xi_row = x_ptr.to(tl.pointer_type(tl.int32)) + m.to(tl.int64) * (stride_xm // 2)  # x as 16-bit pairs
    nwi = nw_ptr.to(tl.pointer_type(tl.int32))
    zero = tl.zeros([E], dtype=tl.float32)
    o0, o1, o2, o3 = _ones(tid, FILL_ASM)
    acc0, acc1, acc2, acc3 = zero, zero, zero, zero  # rows r0 / r0 + 8 × x rows 2τ / 2τ + 1
    acu0, acu1, acu2, acu3 = zero, zero, zero, zero  # the same for the second tile (SECOND)
    for st in range(st_lo, st_hi):
        wa, wb, ua, ub, sa, za, sb, zb, sa2, za2, sb2, zb2 = nx
        # the step DEPTH on (the last steps reload the split's last one: cached)
        nxt = tl.minimum(st + DEPTH, st_hi - 1)
        if DEPTH == 2:
            nx = nx2
            nx2 = _step_weights(wq, uq, s_a, z_a, o2s, nxt, wmask, umask, tile_ok, tile2_ok, stride_sn, STEP,
                                SECOND, PRE)
        else:
            nx = _step_weights(wq, uq, s_a, z_a, o2s, nxt, wmask, umask, tile_ok, tile2_ok, stride_sn, STEP,
                               SECOND, PRE)
        d0, d1, d2, d3 = zero, zero, zero, zero
        du0, du1, du2, du3 = zero, zero, zero, zero
        e0, e1, e2, e3 = zero, zero, zero, zero
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
                b0, b1 = _b_pairs(xi_row, nwi, m_ok, tau, k0, K, NORM, MUL_ASM)
                e0, e1, e2, e3 = _mma_ones(o0, o1, o2, o3, b0, b1, e0, e1, e2, e3, ONES_ASM)
                d0, d1, d2, d3 = _mma_codes(_word(wv, s), b0, b1, d0, d1, d2, d3, MMA_ASM)
                if SECOND:
                    du0, du1, du2, du3 = _mma_codes(_word(uv, s), b0, b1, du0, du1, du2, du3, MMA_ASM)
                if (cc * 64 + (s + 1) * 16) % GROUP == 0:  # a group ends: its scale and offset, once
                    if not PRE:
                        grp = k0 // GROUP
                        sa, za, sb, zb = _group_scales(s_a, z_a, grp, tile_ok, stride_sn)
                        if SECOND:
                            sa2, za2, sb2, zb2 = _group_scales(s_a + o2s, z_a + o2s, grp, tile2_ok, stride_sn)
                    acc0 = tl.fma(sa, d0, tl.fma(za, e0, acc0))
                    acc1 = tl.fma(sa, d1, tl.fma(za, e1, acc1))
                    acc2 = tl.fma(sb, d2, tl.fma(zb, e0, acc2))
                    acc3 = tl.fma(sb, d3, tl.fma(zb, e1, acc3))
                    if SECOND:
                        acu0 = tl.fma(sa2, du0, tl.fma(za2, e0, acu0))
                        acu1 = tl.fma(sa2, du1, tl.fma(za2, e1, acu1))
                        acu2 = tl.fma(sb2, du2, tl.fma(zb2, e0, acu2))
                        acu3 = tl.fma(sb2, du3, tl.fma(zb2, e1, acu3))
                    d0, d1, d2, d3 = zero, zero, zero, zero
                    du0, du1, du2, du3 = zero, zero, zero, zero
                    e0, e1, e2, e3 = zero, zero, zero, zero

    # partials to the workspace: [SPLIT, rows, width] float32
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
    if SECOND:  # the up half of the row (GATED) or the rows W tiles on
        o2 = N if GATED else 16 * W
        ok_a2 = tile2_ok & (ma < M)
        ok_b2 = tile2_ok & (ma + 1 < M)
        tl.store(at_a + o2, acu0, mask=ok_a2)
        tl.store(at_a + o2 + 8, acu2, mask=ok_a2)
        tl.store(at_b + o2, acu1, mask=ok_b2)
        tl.store(at_b + o2 + 8, acu3, mask=ok_b2)
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
        for s2 in tl.static_range(SPLIT):
            at = ws_ptr + (s2 * mp + mr[None, :]).to(tl.int64) * width + n[:, None]
            acc += tl.load(at, mask=om, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_u += tl.load(at + N, mask=om, other=0.0, cache_modifier=".cg")
        ss = tl.zeros([8], dtype=tl.float32)
        if NORM:  # Σ x² of the block's rows, here rather than per lane in the K loop
            sq = tl.zeros([8, 64], dtype=tl.float32)
            for k1 in range(0, K, 64):
                kx = k1 + tl.arange(0, 64)
                xv = tl.load(x_ptr + mr[:, None].to(tl.int64) * stride_xm + kx[None, :],
                             mask=(mr < M)[:, None] & (kx < K)[None, :], other=0.0).to(tl.float32)
                sq += xv * xv
            ss = tl.sum(sq, 1)
        if SPLIT > 1:
            tl.atomic_xchg(cnt_ptr + nb * mblocks + mb, 0)  # ready for the next launch
        store_rows(tl.trans(acc), tl.trans(acc_u), ss, mr, n, mr < M, n < N, b_ptr, res_ptr, out_ptr,
                   stride_rm, stride_om, up_off, eps, dt, K, NORM, HAS_BIAS, GATED, HAS_RES)


class W4Config(NamedTuple):
    """Launch configuration of ``_w4_kernel``: warps per program (each streaming a tile of 16 weight
    rows, or two: ``tiles``), the split of K."""
    warps: int
    split: int
    tiles: int = 1  # 2: each warp streams two tiles with the same x (not for gated weights: up is the 2nd)
    depth: int = 1  # K steps of codes in flight ahead of the one computed (1 or 2)


def w4_config(n: int, k: int, group: int, gated: bool) -> W4Config:
    """The configuration for an [m, k] x [n, k]^T int4 product (``n``: weight rows; gated: both halves).
    Depends on the shape only, never on the row count (batch invariance). 8 warps per program; split-K
    doubles while there are fewer than 3072 warps and every split keeps at least two steps; products of
    at least 24 Mi plain weights (8B: qkv, down) stream two tiles per warp, two K steps in flight. From
    the sweeps of docs/performance.md §48 / §50 (8B shapes, one row, with the decode fusions; an H100,
    two sessions agreeing within 1 %): qkv (8, 8, 2, 2) 9.6 µs against 11.0 at (8, 8, 1, 1); o (8, 16)
    6.8 (tiles 2 not among its best four); gate_up (8, 4) 29.2–29.9 against 38.7–39.0 at 4 warps; down
    (8, 16, 2, 2) 15.6–15.7 against 16.7–17.0."""
    warps = 8
    tiles = (n // 2 if gated else n) // TILE
    steps = -(-k // max(group, CHUNK))
    split = 1
    while -(-tiles // warps) * split * warps < 3072 and steps // (2 * split) >= 2:
        split *= 2
    two = not gated and n * k >= 24 * 2**20
    return W4Config(warps, split, 2 if two else 1, 2 if two else 1)


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
    mma_asm, ones_asm, fill_asm, mul_asm = _mma_asm(w.dtype)
    tiles = 1 if gated else cfg.tiles
    pdl = pdl_enabled(x.device)
    nblocks = triton.cdiv(nout // TILE, cfg.warps * tiles)
    width = nout * (2 if gated else 1)
    for r0 in range(0, mrows, CHUNK_ROWS):  # bounded workspace: at most 64 rows per launch
        r1 = min(mrows, r0 + CHUNK_ROWS)
        mblocks = triton.cdiv(r1 - r0, _BM)
        ws, cnt = workspace(x.device, cfg.split * mblocks * _BM * width, nblocks * mblocks)
        o = out[r0:r1]
        _w4_kernel[(nblocks * cfg.split * mblocks,)](
            x[r0:r1], w.qweight, w.scale, w.offset, bias if bias is not None else o,
            norm_weight if norm_weight is not None else o, o, o, ws, cnt, eps, r1 - r0, nout, x.stride(0),
            w.scale.stride(0), o.stride(0), o.stride(0), nout if gated else 0,
            K=kin, CHUNKS=w.kp // CHUNK, GROUP=w.group, W=cfg.warps, SPLIT=cfg.split,
            TILES=tiles, DEPTH=cfg.depth, MMA_ASM=mma_asm, ONES_ASM=ones_asm, FILL_ASM=fill_asm, MUL_ASM=mul_asm,
            HAS_BIAS=bias is not None, NORM=norm_weight is not None, GATED=gated, HAS_RES=residual is not None,
            PDL=pdl, num_warps=cfg.warps, num_stages=1, **launch_kwargs(pdl))
