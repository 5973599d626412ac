"""The skinny matmul for int4 weights (``W4Weight``, layout in models/quant/w4_weight.py): ``out[M, N] =
x[M, K] @ W[N, K]^T`` streamed from the packed codes, with the fusions of ``triton_gemv.py`` (RMSNorm
of x, silu(gate)·up over a packed [gate | up] weight, in-place residual add, bias).

Two kernels:

- ``_w4_kernel``, 2+ rows and every row count in batch-invariant mode: tensor cores with the roles
  swapped ("swap AB"). Each program computes ``out^T[BLOCK_N, 16] = W[BLOCK_N, K] · x^T[K, 16]`` for
  ``BLOCK_N`` weight rows and a tile of 16 x rows (fewer rows are padded with zeros, so 2 to 16 rows
  cost about the same), one group of codes per ``tl.dot``:

  - unpack: one shift and one mask of a word give two codes at once as 16-bit floats ``1 + q/16``
    (bf16 ``0x3F80 | q << 3``, fp16 ``0x3C00 | q << 6``: exact, no int→float conversion), nibbles
    ``t`` and ``t + 4`` of the word (codes ``16·2t + j`` and ``16·(2t + 1) + j`` of its run); the
    group's ``[BLOCK_N, group]`` tile is these pairs joined in whatever order they come, and x is
    permuted to the same K order (a sum does not care);
  - per group, ``P = Σ (1 + q/16)·x`` comes from one ``tl.dot`` (float32 accumulation) and the
    group's scale and offset are applied to it once:

        Σ_k (q_k·s + z)·x_k  =  16·s·P  +  (z − 16·s)·Σ_k x_k

  - split-K (``splitk.py``): ``SPLIT`` programs share a column block's K range when the column blocks
    alone are too few for the 132 SMs; the last to finish adds the partial sums in split order and
    runs the epilogue. Deterministic: no float atomics.

- ``_w4_row_kernel``, one row (decode) in the default mode: one program per row on the CUDA cores,
  ``RB`` runs per K step; codes become float32 exactly with ``bitcast(q | 0x4B000000) − 2^23``.

Numerics: float32 accumulation; ``1 + q/16`` and its products with bf16/fp16 x are exact, so both
kernels give the product with the dequantized float32 weight up to summation order (not bit for bit
the bf16 kernel on ``W4Weight.dequantize()``). A row's result never depends on the other rows; the
tensor-core kernel's configuration depends on the weight's shape only, so there a row gives the same
bits at every row count (batch-invariant mode uses it for every row count).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.models.quant.w4_weight import W4Weight, tile_rows
from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue
from tandem.worker.splitk import finish_split, row_chunks, workspace
from tandem.worker.triton_epilogue import store_rows


@triton.jit
def _pair_bits(wd, t: tl.constexpr, dt: tl.constexpr):
    """Nibbles t and t + 4 of each word as one int32 holding two 16-bit floats 1 + q/16 (low, high)."""
    if dt == tl.bfloat16:  # q to bits 3..6 of each half: 0x3F80 | q << 3 = 1 + q/16
        if t == 0:
            v = wd << 3
        else:
            v = wd >> (4 * t - 3)
        return (v & 0x00780078) | 0x3F803F80
    else:  # fp16: 0x3C00 | q << 6
        if t == 0:
            v = wd << 6
        elif t == 1:
            v = wd << 2
        else:
            v = wd >> (4 * t - 6)
        return (v & 0x03C003C0) | 0x3C003C00


@triton.jit
def _half(v, h: tl.constexpr, dt: tl.constexpr):
    if h == 1:
        v = v >> 16
    return v.to(tl.int16).to(dt, bitcast=True)


@triton.jit
def _codes(wd, t: tl.constexpr, h: tl.constexpr, dt: tl.constexpr):
    """Code i = 2t + h of each word's run (nibble t + 4h) as 1 + q/16 in dt."""
    if dt == tl.float32:  # the interpreter's tests and any float32 model: plain arithmetic
        return ((wd >> (4 * t + 16 * h)) & 15).to(tl.float32) * 0.0625 + 1.0
    else:
        return _half(_pair_bits(wd, t, dt), h, dt)


@triton.jit
def _group_tile(wd, gi: tl.constexpr, GROUP: tl.constexpr, dt: tl.constexpr):
    """Group gi of each word's run as a [BLOCK_N, GROUP] tile of 1 + q/16. Column c holds code
    ``16·(i0 + c % NI) + c // NI`` of the run (NI = GROUP / 16, i0 = gi·NI): the low and high half of
    one word stay neighbours (one 32-bit register for the tensor cores)."""
    BN: tl.constexpr = wd.shape[0]
    if GROUP == 16:  # i = gi: one half of pair gi // 2
        return _codes(wd, gi // 2, gi % 2, dt)
    elif GROUP == 32:  # t = gi; column 2j + h
        return tl.reshape(tl.join(_codes(wd, gi, 0, dt), _codes(wd, gi, 1, dt)), [BN, 32])
    elif GROUP == 64:  # t = 2gi + e; column 4j + 2e + h
        lo = tl.join(_codes(wd, 2 * gi, 0, dt), _codes(wd, 2 * gi + 1, 0, dt))
        hi = tl.join(_codes(wd, 2 * gi, 1, dt), _codes(wd, 2 * gi + 1, 1, dt))
        return tl.reshape(tl.join(lo, hi), [BN, 64])
    else:  # 128: t = 2e + f; column 8j + 4e + 2f + h
        lo = tl.join(tl.join(_codes(wd, 0, 0, dt), _codes(wd, 2, 0, dt)),
                     tl.join(_codes(wd, 1, 0, dt), _codes(wd, 3, 0, dt)))
        hi = tl.join(tl.join(_codes(wd, 0, 1, dt), _codes(wd, 2, 1, dt)),
                     tl.join(_codes(wd, 1, 1, dt), _codes(wd, 3, 1, dt)))
        return tl.reshape(tl.join(lo, hi), [BN, 128])


@triton.jit
def _row_words(n, RUNS: tl.constexpr, TN: tl.constexpr):
    """Word offset of run 0 of row(s) n in the tiled layout (w4_weight.py); run b is b · TN · 16 on."""
    n = n.to(tl.int64)
    return (n // TN) * (RUNS * TN * 16) + (n % TN) * 16


@triton.jit
def _w4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, eps,
    M, N, stride_xm, stride_wn, stride_sn, stride_rm, stride_om, up_off,
    K: tl.constexpr, RUNS: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    RB: tl.constexpr, SPLIT: tl.constexpr, TN: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    """Program (column block, split, row block), row blocks fastest, then splits: the programs that
    share a column block's weight run together (L2). ``RB`` runs of 128 codes per K step."""
    pid = tl.program_id(0)
    mblocks = tl.cdiv(M, BLOCK_M)
    mb = pid % mblocks
    pid = pid // mblocks
    sp = pid % SPLIT
    nb = pid // SPLIT
    dt = s_ptr.dtype.element_ty
    NI: tl.constexpr = GROUP // 16
    GPR: tl.constexpr = 128 // GROUP  # groups per run
    RPS: tl.constexpr = (RUNS + SPLIT - 1) // SPLIT  # runs per split
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    j = tl.arange(0, 16)
    ii = tl.arange(0, NI)
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + _row_words(n, RUNS, TN)[:, None]
    u_rows = w_ptr + _row_words(n + up_off, RUNS, TN)[:, None]  # GATED: the "up" half of [gate | up]
    s_rows = s_ptr + n.to(tl.int64) * stride_sn
    z_rows = z_ptr + n.to(tl.int64) * stride_sn
    b_lo = sp * RPS
    b_hi = tl.minimum(b_lo + RPS, RUNS)
    if PDL:  # see pdl.py: x, the residual, the output and the workspace only after this
        pdl_prologue()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_M, NI, 16], dtype=tl.float32)
    for b0 in range(b_lo, b_hi, RB):
        for r in tl.static_range(RB):
            b = b0 + r
            gm = n_mask & ((n * 0 + b) < b_hi)  # (a [BLOCK_N] mask: the interpreter mishandles scalar ones)
            wd = tl.load(w_rows + b * (TN * 16) + j[None, :], mask=gm[:, None], other=0)
            if GATED:
                wu = tl.load(u_rows + b * (TN * 16) + j[None, :], mask=gm[:, None], other=0)
            for gi in tl.static_range(GPR):
                # x for the group in natural order (16-byte loads), then permuted to the tile's columns
                k3 = b * 128 + gi * GROUP + 16 * ii[:, None] + j[None, :]  # [NI, 16]
                km = (k3 < K) & (k3 < b_hi * 128)
                xv = tl.load(x_rows[:, :, None] + k3[None, :, :], mask=m_mask[:, None, None] & km[None, :, :],
                             other=0.0)
                if NORM:  # rms(x) · (W @ (x ⊙ w_norm)): the row scale is applied in the epilogue
                    xf = xv.to(tl.float32)
                    ssq += xf * xf
                    nw = tl.load(nw_ptr + k3, mask=km, other=0.0).to(tl.float32)
                    xv = (xf * nw[None, :, :]).to(dt)
                xt = tl.trans(tl.reshape(tl.permute(xv, (0, 2, 1)), [BLOCK_M, GROUP]))  # [GROUP, BLOCK_M]
                xs = tl.sum(tl.sum(xv.to(tl.float32), 2), 1)[None, :]  # Σ x over the group, per row
                g = b * GPR + gi
                if dt == tl.float32:
                    part = tl.dot(_group_tile(wd, gi, GROUP, dt), xt, input_precision="ieee")
                else:
                    part = tl.dot(_group_tile(wd, gi, GROUP, dt), xt)
                sc = tl.load(s_rows + g, mask=gm, other=0.0).to(tl.float32) * 16.0
                zo = tl.load(z_rows + g, mask=gm, other=0.0).to(tl.float32) - sc
                acc += part * sc[:, None] + zo[:, None] * xs
                if GATED:
                    if dt == tl.float32:
                        part = tl.dot(_group_tile(wu, gi, GROUP, dt), xt, input_precision="ieee")
                    else:
                        part = tl.dot(_group_tile(wu, gi, GROUP, dt), xt)
                    sc = tl.load(s_rows + up_off * stride_sn + g, mask=gm, other=0.0).to(tl.float32) * 16.0
                    zo = tl.load(z_rows + up_off * stride_sn + g, mask=gm, other=0.0).to(tl.float32) - sc
                    acc_u += part * sc[:, None] + zo[:, None] * xs
    finish_split(acc, acc_u, tl.sum(tl.sum(ssq, 2), 1), sp, nb, mb, mblocks, m, n, m_mask, n_mask, ws_ptr, cnt_ptr,
                 b_ptr, res_ptr, out_ptr, stride_rm, stride_om, up_off, N, eps, dt, K, BLOCK_M, BLOCK_N, SPLIT, NORM,
                 HAS_BIAS, GATED, HAS_RES)


@triton.jit
def _codes_f32(wd, p: tl.constexpr):
    """Nibble p of each word as an exact float32 (0..15)."""
    bits = ((wd >> (4 * p)) & 15) | 0x4B000000
    return bits.to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _w4_row_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, eps,
    M, N, stride_xm, stride_sn, stride_rm, stride_om, up_off,
    K: tl.constexpr, RUNS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, RB: tl.constexpr,
    TN: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr,
):
    """One row per program on the CUDA cores (one-row decode). Each K step loads ``RB`` runs of 128
    codes as one [BLOCK_N, RB, 16] word tile, then walks the 8 codes of each word (16 consecutive
    codes per run each) against [RB, 16] slices of x: codes become float32 exactly with the exponent
    trick ``bitcast(q | 0x4B000000) − 2^23``; scale and offset once per group and column."""
    pid = tl.program_id(0)
    row = pid % M
    pid = pid // M
    dt = s_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    r = tl.arange(0, RB)
    j = tl.arange(0, 16)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    w3 = w_ptr + _row_words(n, RUNS, TN)[:, None, None] + r[None, :, None] * (TN * 16) + j[None, None, :]
    u3 = w_ptr + _row_words(n + up_off, RUNS, TN)[:, None, None] + r[None, :, None] * (TN * 16) + j[None, None, :]
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
        wd = tl.load(w3 + b0 * (TN * 16), mask=wm, other=0)
        if GATED:
            wu = tl.load(u3 + b0 * (TN * 16), mask=wm, other=0)
        part = tl.zeros([BLOCK_N, RB, 16], dtype=tl.float32)
        part_u = tl.zeros([BLOCK_N, RB, 16], dtype=tl.float32)
        xs = tl.zeros([RB, 16], dtype=tl.float32)
        for i in tl.static_range(8):  # code i of each word: nibble i // 2 + 4 (i % 2) (w4_weight.NIBBLE)
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
            part += _codes_f32(wd, i // 2 + 4 * (i % 2)) * xf[None, :, :]
            if GATED:
                part_u += _codes_f32(wu, i // 2 + 4 * (i % 2)) * xf[None, :, :]
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



# Rows up to which the default (not batch-invariant) mode runs the per-row CUDA-core kernel. H200, 8B
# shapes, µs (2026-12-02): one row per-row 11.6 / 11.7 / 37.4 / 36.5 (qkv / o / gate_up / down) vs
# tensor cores 17.3 / 13.6 / 76 / 38.5 (w4_config); two rows tensor cores 17.7 / 16.8 / 82.7 / 41.2
# (with the previous split rule; the per-row kernel at 2 rows was not timed; at 4 rows it cost 2.3-3.4x
# its one row, docs/performance.md §20).
ROW_KERNEL_ROWS = 1


def row_config(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, runs per K step, num_warps, num_stages) for ``_w4_row_kernel``: best of a sweep on
    the H200 at the 8B shapes (benchmarks/gpu_w4_gemv.py, 2026-12-02; for gate_up (16, 8, 4, 3) and
    (16, 8, 4, 2) tie within 0.3 %). Gated: BLOCK_N / 2 columns of each half."""
    return (8, 8, 8, 3) if n <= 8192 else (16, 8, 4, 2)


def w4_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, runs of 128 codes per K step, num_warps, num_stages, SPLIT) for the tensor-core kernel
    on an [m, k] x [n, k]^T int4 product (``n``: weight rows; gated: both halves). Depends on the shape
    only, never on the row count (batch invariance). Split-K (up to 8) while there are fewer than 640
    programs. From a sweep on the H200 at the 8B shapes (benchmarks/gpu_w4_gemv.py, 2026-12-02): qkv
    (128, 1, 4, 3, 8), o (128, 1, 8, 3, 8), gate_up (128, 1, 4, 3, 4), down (128, 2, 4, 3, 8) best
    or within 4 % of it."""
    runs = -(-k // 128)
    block_n, stages = 128, 3
    rb = 2 if runs >= 64 else 1
    warps = 8 if n <= 4096 and rb == 1 else 4
    split = 1
    while -(-n // block_n) * split < 640 and split < 8 and runs // (2 * split) >= rb:
        split *= 2
    return block_n, rb, warps, stages, split


def w4_gemv(x: torch.Tensor, w: W4Weight, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
            eps: float, gated: bool, residual: torch.Tensor | None, out: torch.Tensor,
            config: tuple[int, ...] | None, invariant: bool) -> None:
    """Launch for ``triton_gemv.gemv`` (arguments checked there): up to ``ROW_KERNEL_ROWS`` rows
    (default mode) the per-row kernel, otherwise, and at every row count with ``invariant``, the
    tensor-core kernel. ``config``: a 4-tuple forces the per-row kernel (``row_config``), a 5-tuple the
    tensor-core one (``w4_config``)."""
    mrows, kin = x.shape
    nout = out.shape[1]
    pdl = pdl_enabled(x.device)
    runs = w.qweight.shape[1] // 16
    if (config is not None and len(config) == 4) or (config is None and mrows <= ROW_KERNEL_ROWS and not invariant):
        block_n, rb, warps, stages = config or row_config(w.shape[0], kin)
        if gated and config is None:
            block_n = max(8, block_n // 2)
        _w4_row_kernel[(triton.cdiv(nout, block_n) * mrows,)](
            x, w.qweight, w.scale, w.offset, bias if bias is not None else out,
            norm_weight if norm_weight is not None else out, out, out, eps, mrows, nout, x.stride(0),
            w.scale.stride(0), out.stride(0), out.stride(0), nout if gated else 0,
            K=kin, RUNS=runs, GROUP=w.group, BLOCK_N=block_n, RB=min(rb, triton.next_power_of_2(runs)),
            TN=tile_rows(w.qweight.shape[0]), HAS_BIAS=bias is not None, NORM=norm_weight is not None,
            GATED=gated, HAS_RES=residual is not None, PDL=pdl, num_warps=warps, num_stages=stages,
            **launch_kwargs(pdl))
        return
    block_n, rb, warps, stages, split = config or w4_config(w.shape[0], kin)
    if gated:  # each program reads block_n gate rows and block_n up rows
        block_n = max(16, block_n // 2)
    block_m = 16
    nblocks = triton.cdiv(nout, block_n)
    width = nout * (2 if gated else 1)
    for r0, r1 in row_chunks(mrows, split):
        rows = r1 - r0
        mblocks = triton.cdiv(rows, block_m)
        ws, cnt = (workspace(x.device, split * mblocks * block_m * (width + 1), nblocks * mblocks) if split > 1
                   else (out, out))
        o = out[r0:r1]
        _w4_kernel[(nblocks * split * mblocks,)](
            x[r0:r1], w.qweight, w.scale, w.offset, bias if bias is not None else o,
            norm_weight if norm_weight is not None else o, o, o, ws, cnt, eps, rows, nout, x.stride(0),
            w.qweight.stride(0), w.scale.stride(0), o.stride(0), o.stride(0), nout if gated else 0,
            K=kin, RUNS=runs, GROUP=w.group, BLOCK_M=block_m, BLOCK_N=block_n, RB=rb, SPLIT=split,
            TN=tile_rows(w.qweight.shape[0]),
            HAS_BIAS=bias is not None, NORM=norm_weight is not None, GATED=gated, HAS_RES=residual is not None,
            PDL=pdl, num_warps=warps, num_stages=stages, **launch_kwargs(pdl))
