"""The skinny matmul for int4 weights (``W4Weight``, layout in models/quant/w4_weight.py): ``out[M, N] =
x[M, K] @ W[N, K]^T`` streamed from the packed codes, with the fusions of ``triton_gemv.py`` (RMSNorm
of x, silu(gate)·up over a packed [gate | up] weight, in-place residual add, bias).

Each program owns ``BLOCK_N`` output columns and walks K in runs of 128 codes, 16 int32 words per
run and column; for each of the 8 nibbles a shift and mask gives 16 consecutive codes per column,
multiplied with the matching 16-element slice of x. The group's scale and offset are applied once
per group, not per weight:

    Σ_k (q_k·s + z)·x_k  =  s·Σ_k q_k·x_k  +  z·Σ_k x_k

- up to ``ROW_KERNEL_ROWS`` rows (``_w4_row_kernel``, one program per row, ``RB`` runs per K step):
  codes become float32 exactly with the exponent trick ``bitcast(q | 0x4B000000) − 2^23`` (integer
  OR and one add: no slow int→float conversion), then float32 multiply-adds on the CUDA cores;
- more rows (``_w4_kernel``, 16-row tiles, one run per K step; every row count in batch-invariant
  mode): codes become
  ``c + q`` in the model dtype by the same trick in 16 bits (bf16: ``0x4300 | q`` = 128 + q, fp16:
  ``0x6400 | q`` = 1024 + q, both exact) and go to the tensor cores as is; the constant comes back out
  through the group's offset, ``z − c·s``. A row's result does not depend on the other rows of its
  tile.

Numerics: float32 accumulation; the weight is never rounded to the model dtype (codes, scales and
offsets are exact in float32), so the result equals the product with the dequantized float32 weight
up to summation order — not bit for bit the bf16 kernel on ``W4Weight.dequantize()``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.models.quant.w4_weight import BLOCK, W4Weight
from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue
from tandem.worker.triton_epilogue import store_rows


@triton.jit
def _codes_f32(wd, i: tl.constexpr):
    """Nibble i of each word as an exact float32 (0..15)."""
    bits = ((wd >> (4 * i)) & 15) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _codes_dot(wd, i: tl.constexpr, dt: tl.constexpr):
    """Nibble i of each word as ``MAGIC + q`` in dt (tensor-core operand); float32: q itself."""
    if dt == tl.bfloat16:
        return (((wd >> (4 * i)) & 15) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif dt == tl.float16:
        return (((wd >> (4 * i)) & 15) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        return _codes_f32(wd, i)


@triton.jit
def _w4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, eps,
    M, N, stride_xm, stride_wn, stride_sn, stride_rm, stride_om, up_off,
    K: tl.constexpr, RUNS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr,
    USE_DOT: tl.constexpr, MAGIC: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    mblocks = tl.cdiv(M, BLOCK_M)  # row blocks fastest: a column block's programs share its weight via L2
    row0 = (pid % mblocks) * BLOCK_M
    pid = pid // mblocks
    dt = s_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = row0 + tl.arange(0, BLOCK_M)
    m_mask = m < M
    j = tl.arange(0, 16)
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    u_rows = w_rows + up_off * stride_wn  # GATED: the "up" half of a packed [gate | up] weight
    s_rows = s_ptr + n.to(tl.int64) * stride_sn
    z_rows = z_ptr + n.to(tl.int64) * stride_sn
    su_rows = s_rows + up_off * stride_sn
    zu_rows = z_rows + up_off * stride_sn
    if PDL:  # see pdl.py: x, the residual and the output only after this
        pdl_prologue()

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    xs = tl.zeros([BLOCK_M, 16], dtype=tl.float32)  # Σ x over the current group
    if USE_DOT:
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # Σ (MAGIC + q)·x over the current group
        part_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        part = tl.zeros([BLOCK_N, 16], dtype=tl.float32)  # element-wise q·x, reduced at the group's end
        part_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
    for b in range(RUNS):
        wd = tl.load(w_rows + b * 16 + j[None, :], mask=n_mask[:, None], other=0)
        if GATED:
            wu = tl.load(u_rows + b * 16 + j[None, :], mask=n_mask[:, None], other=0)
        for i in tl.static_range(8):
            k = b * 128 + i * 16 + j
            km = k < K
            xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
            if NORM:  # rms(x) · (W @ (x ⊙ w_norm)): the row scale is applied in the epilogue
                xf = xv.to(tl.float32)
                ssq += xf * xf
                nw = tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
                xv = (xf * nw[None, :]).to(dt)
            xf = xv.to(tl.float32)
            xs += xf
            if USE_DOT:
                part += tl.dot(xv, tl.trans(_codes_dot(wd, i, dt)))
                if GATED:
                    part_u += tl.dot(xv, tl.trans(_codes_dot(wu, i, dt)))
            else:
                part += _codes_f32(wd, i) * xf
                if GATED:
                    part_u += _codes_f32(wu, i) * xf
            if ((i + 1) * 16) % GROUP == 0:  # the group ends: apply its scale and offset
                g = (b * 128 + i * 16) // GROUP
                sc = tl.load(s_rows + g, mask=n_mask, other=0.0).to(tl.float32)
                zo = tl.load(z_rows + g, mask=n_mask, other=0.0).to(tl.float32) - MAGIC * sc
                xsum = tl.sum(xs, 1)
                if USE_DOT:
                    acc += part * sc[None, :] + xsum[:, None] * zo[None, :]
                    part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                else:
                    acc += (tl.sum(part, 1) * sc)[None, :] + xsum[:, None] * zo[None, :]
                    part = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
                if GATED:
                    sc = tl.load(su_rows + g, mask=n_mask, other=0.0).to(tl.float32)
                    zo = tl.load(zu_rows + g, mask=n_mask, other=0.0).to(tl.float32) - MAGIC * sc
                    if USE_DOT:
                        acc_u += part_u * sc[None, :] + xsum[:, None] * zo[None, :]
                        part_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    else:
                        acc_u += (tl.sum(part_u, 1) * sc)[None, :] + xsum[:, None] * zo[None, :]
                        part_u = tl.zeros([BLOCK_N, 16], dtype=tl.float32)
                xs = tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    store_rows(acc, acc_u, tl.sum(ssq, 1), m, n, m_mask, n_mask, b_ptr, res_ptr, out_ptr, stride_rm, stride_om,
               up_off, eps, dt, K, NORM, HAS_BIAS, GATED, HAS_RES)


@triton.jit
def _w4_row_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, eps,
    M, N, stride_xm, stride_wn, stride_sn, stride_rm, stride_om, up_off,
    K: tl.constexpr, RUNS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, RB: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    """One row per program (rows of a column block adjacent in the grid: they share its weight
    through L2). Each K step loads ``RB`` runs of 128 codes as one [BLOCK_N, RB, 16] word tile, then
    walks its 8 nibbles (16 consecutive codes per run each) against [RB, 16] slices of x."""
    pid = tl.program_id(0)
    row = pid % M
    pid = pid // M
    dt = s_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, RB)
    j = tl.arange(0, 16)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    w3 = w_ptr + n[:, None, None].to(tl.int64) * stride_wn + r[None, :, None] * 16 + j[None, None, :]
    u3 = w3 + up_off * stride_wn
    s2 = s_ptr + n[:, None].to(tl.int64) * stride_sn
    z2 = z_ptr + n[:, None].to(tl.int64) * stride_sn
    if PDL:
        pdl_prologue()

    acc = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, RB], dtype=tl.float32)
    ssq = tl.zeros([RB, 16], dtype=tl.float32)
    for b0 in range(0, RUNS, RB):
        rv = (b0 + r) < RUNS
        wm = n_mask[:, None, None] & rv[None, :, None]
        wd = tl.load(w3 + b0 * 16, mask=wm, other=0)
        if GATED:
            wu = tl.load(u3 + b0 * 16, mask=wm, other=0)
        part = tl.zeros([BLOCK_N, RB, 16], dtype=tl.float32)
        part_u = tl.zeros([BLOCK_N, RB, 16], dtype=tl.float32)
        xs = tl.zeros([RB, 16], dtype=tl.float32)
        for i in tl.static_range(8):
            k = (b0 + r)[:, None] * 128 + i * 16 + j[None, :]
            km = (k < K) & rv[:, None]
            xv = tl.load(x_row + k, mask=km, other=0.0)
            if NORM:
                xf = xv.to(tl.float32)
                ssq += xf * xf
                nw = tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
                xv = (xf * nw).to(dt)
            xf = xv.to(tl.float32)
            xs += xf
            part += _codes_f32(wd, i) * xf[None, :, :]
            if GATED:
                part_u += _codes_f32(wu, i) * xf[None, :, :]
            if ((i + 1) * 16) % GROUP == 0:  # a group ends: its scale and offset, once per column
                g = ((b0 + r) * 128 + i * 16) // GROUP
                gm = n_mask[:, None] & rv[None, :]
                xsum = tl.sum(xs, 1)[None, :]
                sc = tl.load(s2 + g[None, :], mask=gm, other=0.0).to(tl.float32)
                zo = tl.load(z2 + g[None, :], mask=gm, other=0.0).to(tl.float32)
                acc += tl.sum(part, 2) * sc + xsum * zo
                part = tl.zeros([BLOCK_N, RB, 16], dtype=tl.float32)
                if GATED:
                    sc = tl.load(s2 + up_off * stride_sn + g[None, :], mask=gm, other=0.0).to(tl.float32)
                    zo = tl.load(z2 + up_off * stride_sn + g[None, :], mask=gm, other=0.0).to(tl.float32)
                    acc_u += tl.sum(part_u, 2) * sc + xsum * zo
                    part_u = tl.zeros([BLOCK_N, RB, 16], dtype=tl.float32)
                xs = tl.zeros([RB, 16], dtype=tl.float32)
    m = row + tl.arange(0, 1)
    store_rows(tl.sum(acc, 1)[None, :], tl.sum(acc_u, 1)[None, :], tl.sum(tl.sum(ssq, 1), 0, keep_dims=True),
               m, n, m < M, n_mask, b_ptr, res_ptr, out_ptr, stride_rm, stride_om, up_off, eps, dt, K, NORM,
               HAS_BIAS, GATED, HAS_RES)


# Up to this many rows: one program per row (each re-expands the codes: time grows ~linearly with
# rows); above, 16-row tensor-core tiles (~flat up to 16 rows). H200, 8B shapes (gpu_w4_gemv.py,
# 2026-12-02): 4 rows per-row 28-130 µs vs tiles 67-209 µs; 16 rows per-row 99-500 µs vs tiles 70-217.
ROW_KERNEL_ROWS = 6
_MAGIC = {torch.bfloat16: 128.0, torch.float16: 1024.0}  # what _codes_dot adds to each code


def w4_config(m: int, n: int, k: int, dot: bool) -> tuple[int, int, int, int]:
    """(BLOCK_N, runs of 128 codes per K step, num_warps, num_stages) for an [m, k] x [n, k]^T int4
    product (``n``: weight rows). Tiles: ``dot`` 16 rows x BLOCK_N, one run per step."""
    if dot:
        return 16, 1, 4, 3
    # one row: best of a sweep on the H200 (benchmarks/gpu_w4_gemv.py, 2026-12-02) at the 8B shapes
    rb = min(8, triton.next_power_of_2(-(-k // 128)))
    return (8, rb, 8, 3) if n <= 8192 else (16, rb, 4, 2)


def w4_gemv(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, gated: bool, residual: torch.Tensor | None, out: torch.Tensor,
            config: tuple[int, int, int, int] | None, invariant: bool) -> None:
    """Launch for ``triton_gemv.gemv`` (arguments checked there): up to ``ROW_KERNEL_ROWS`` rows one
    program per row on the CUDA cores; more rows, or batch-invariant mode, 16-row tensor-core tiles."""
    mrows, kin = x.shape
    nout = out.shape[1]
    use_dot = invariant or mrows > ROW_KERNEL_ROWS
    block_n, rb, warps, stages = config or w4_config(mrows, w.shape[0], kin, use_dot)
    if gated and config is None:
        block_n = max(8, block_n // 2)
    pdl = pdl_enabled(x.device)
    runs = w.qweight.shape[1] // 16
    bias_ = bias if bias is not None else out
    nw_ = norm_weight if norm_weight is not None else out
    common = dict(K=kin, RUNS=runs, GROUP=w.group, HAS_BIAS=bias is not None, NORM=norm_weight is not None,
                  GATED=gated, HAS_RES=residual is not None, PDL=pdl, num_warps=warps, num_stages=stages,
                  **launch_kwargs(pdl))
    args = (x, w.qweight, w.scale, w.offset, bias_, nw_, out, out, eps, mrows, nout, x.stride(0),
            w.qweight.stride(0), w.scale.stride(0), out.stride(0), out.stride(0), nout if gated else 0)
    if not use_dot:
        _w4_row_kernel[(triton.cdiv(nout, block_n) * mrows,)](*args, BLOCK_N=block_n, RB=rb, **common)
        return
    block_n = max(block_n, 16)
    _w4_kernel[(triton.cdiv(nout, block_n) * triton.cdiv(mrows, 16),)](
        *args, BLOCK_M=16, BLOCK_N=block_n, USE_DOT=True, MAGIC=_MAGIC.get(w.dtype, 0.0), **common)
