"""The tensor-core skinny matmul for float weights: ``out[M, N] = x[M, K] @ W[N, K]^T`` for a few rows
(verify steps, small batches) and for every row count in batch-invariant mode, with the fusions of
``triton_gemv.py`` (RMSNorm of x, silu(gate)·up over a packed [gate | up] weight, in-place residual
add, bias).

Roles swapped ("swap AB", as ``triton_w4.py``'s int4 kernel): each program computes
``out^T[BLOCK_N, 16] = W[BLOCK_N, K] · x^T[K, 16]`` for ``BLOCK_N`` weight rows and a tile of 16 x
rows, so the weight fills the tensor cores' 64-row operand and x, padded with zeros to 16 rows, the
narrow one: 2 and 16 rows cost about the same, close to what streaming the weight once costs. When
the column blocks alone are too few for the SMs, K is split across programs (``splitk.py``: float32
partials, the last program adds them in split order).

The configuration (``dot_config``) depends on the weight's shape only, never on the row count, and a
row's result never depends on the other rows (the padded rows are zeros; each output element is its
own dot product in a fixed K order): a row gives the same bits at every row count. Batch-invariant
mode relies on that; the default mode uses this kernel for 2–16 rows of models too big for the
per-row kernel (``cuda_kernels.default_row_rows``).

Numerics: float32 accumulation; the fused norm multiplies x by the norm weight (rounded to the model
dtype) and applies the row scale after the product, as the per-row kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue
from tandem.worker.splitk import finish_split, row_chunks, workspace


@triton.jit
def _dot_kernel(
    x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, ws_ptr, cnt_ptr, eps,
    M, N, stride_xm, stride_wn, stride_rm, stride_om, up_off,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    EVEN: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (column block, split, row block), row blocks fastest, then splits: the programs that
    share a column block's weight run together (L2). ``EVEN``: N and K fill whole blocks and splits
    (no weight masks)."""
    pid = tl.program_id(0)
    mblocks = tl.cdiv(M, BLOCK_M)
    mb = pid % mblocks
    pid = pid // mblocks
    sp = pid % SPLIT
    nb = pid // SPLIT
    dt = w_ptr.dtype.element_ty
    STEPS: tl.constexpr = (K + SPLIT * BLOCK_K - 1) // (SPLIT * BLOCK_K)  # K steps per split
    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < M
    kk = tl.arange(0, BLOCK_K)
    k_lo = sp * (STEPS * BLOCK_K)
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm + k_lo
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn + k_lo
    u_rows = w_rows + up_off * stride_wn  # GATED: the "up" half of a packed [gate | up] weight
    nw_at = nw_ptr + k_lo
    if PDL:  # see pdl.py: x, the residual, the output and the workspace only after this
        pdl_prologue()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    ssq = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for i in range(STEPS):
        k = i * BLOCK_K + kk
        km = (k_lo + k) < K
        xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & km[None, :], other=0.0)
        if NORM:  # rms(x) · (W @ (x ⊙ w_norm)): the row scale is applied in the epilogue
            xf = xv.to(tl.float32)
            ssq += xf * xf
            nw = tl.load(nw_at + k, mask=km, other=0.0).to(tl.float32)
            xv = (xf * nw[None, :]).to(dt)
        xt = tl.trans(xv)  # [BLOCK_K, BLOCK_M]
        if EVEN:
            w = tl.load(w_rows + k[None, :])
        else:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & km[None, :], other=0.0)
        if dt == tl.float32:  # the interpreter's tests and any float32 model: exact products
            acc += tl.dot(w, xt, input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
        if GATED:
            if EVEN:
                wu = tl.load(u_rows + k[None, :])
            else:
                wu = tl.load(u_rows + k[None, :], mask=n_mask[:, None] & km[None, :], other=0.0)
            if dt == tl.float32:
                acc_u += tl.dot(wu, xt, input_precision="ieee")
            else:
                acc_u += tl.dot(wu, xt)
    finish_split(acc, acc_u, tl.sum(ssq, 1), sp, nb, mb, mblocks, m, n, m_mask, n_mask, ws_ptr, cnt_ptr, b_ptr,
                 res_ptr, out_ptr, stride_rm, stride_om, up_off, N, eps, dt, K, BLOCK_M, BLOCK_N, SPLIT, NORM,
                 HAS_BIAS, GATED, HAS_RES)


# (weight rows, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT): the fastest config at 16 rows of
# `benchmarks/gpu_gemv.py --sweep-dot-rows 16` on the H200 (2026-12-02, each shape with its fusion; gated
# shapes as both halves), µs: 8B qkv 16.3, o 10.9, gate_up 62.8, down 31.5 (the one-row decode kernel:
# 16.5 / 9.9 / 59.1 / 29.1); 1B 8.7 / 5.8 / 22.2 / 11.5; SmolLM2 3.9 / 2.8 / 5.8 / 4.2.
MEASURED = {
    (6144, 4096): (64, 256, 4, 3, 1), (4096, 4096): (64, 256, 4, 4, 1),  # Llama-3.1-8B
    (28672, 4096): (128, 128, 4, 3, 1), (4096, 14336): (64, 256, 4, 4, 2),
    (3072, 2048): (64, 128, 4, 4, 4), (2048, 2048): (128, 128, 4, 4, 4),  # Llama-3.2-1B
    (16384, 2048): (128, 64, 4, 4, 1), (2048, 8192): (64, 256, 4, 3, 4),
    (960, 576): (64, 64, 4, 4, 1), (576, 576): (32, 128, 4, 4, 1),  # SmolLM2-135M
    (3072, 576): (128, 64, 4, 4, 1), (576, 1536): (64, 128, 4, 3, 4),
}


def dot_config(n: int, k: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT) for an [m, k] x [n, k]^T product (``n``: weight
    rows; gated: both halves). Depends on the shape only, never on the row count (batch invariance).
    Measured shapes take their sweep's best (``MEASURED``); others: split-K (up to 8) while there are
    fewer than ~one program per SM (H200: 132) and each split keeps at least two K steps (the sweep's
    winners run 64-224 programs)."""
    if (n, k) in MEASURED:
        return MEASURED[(n, k)]
    block_n = 64 if n <= 4096 else 128
    block_k = 128  # 4 stages of a 128 x 128 weight tile: 128 KiB of shared memory (H200: 227 KiB)
    split = 1
    while -(-n // block_n) * split < 128 and split < 8 and k // (2 * split) >= 2 * block_k:
        split *= 2
    return block_n, block_k, 4, 4, split


def dot_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
             eps: float, gated: bool, residual: torch.Tensor | None, out: torch.Tensor,
             config: tuple[int, ...] | None) -> None:
    """Launch for ``triton_gemv.gemv`` (arguments checked there)."""
    mrows, kin = x.shape
    nout = out.shape[1]
    block_n, block_k, warps, stages, split = config or dot_config(w.shape[0], kin)
    if gated:  # each program reads block_n gate rows and block_n up rows
        block_n = max(16, block_n // 2)
    block_k = min(block_k, max(16, triton.next_power_of_2(kin)))
    block_m = 16
    nblocks = triton.cdiv(nout, block_n)
    width = nout * (2 if gated else 1)
    even = nout % block_n == 0 and kin % (split * block_k) == 0
    pdl = pdl_enabled(x.device)
    for r0, r1 in row_chunks(mrows, split):
        rows = r1 - r0
        mblocks = triton.cdiv(rows, block_m)
        ws, cnt = (workspace(x.device, split * mblocks * block_m * (width + 1), nblocks * mblocks) if split > 1
                   else (out, out))
        res = residual[r0:r1] if residual is not None else out[r0:r1]
        o = out[r0:r1]
        _dot_kernel[(nblocks * split * mblocks,)](
            x[r0:r1], w, bias if bias is not None else o, norm_weight if norm_weight is not None else o, res, o,
            ws, cnt, eps, rows, nout, x.stride(0), w.stride(0), res.stride(0), o.stride(0),
            nout if gated else 0,
            K=kin, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split, EVEN=even,
            HAS_BIAS=bias is not None, NORM=norm_weight is not None, GATED=gated, HAS_RES=residual is not None,
            PDL=pdl, num_warps=warps, num_stages=stages, **launch_kwargs(pdl))


__all__ = ["dot_config", "dot_gemv"]
