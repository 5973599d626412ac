"""Skinny matmuls for decode / verify steps (few rows): ``out[M, N] = x[M, K] @ W[N, K]^T`` in Triton,
with the neighbouring elementwise work fused in.

At batch 1 a decoder layer is four weight reads (qkv, o, gate_up, down) and a handful of tiny
kernels between them. cuBLAS reads the big weights at ~4.0–4.1 TB/s but the small ones at ~3.1 TB/s
and adds a split-K reduce kernel to o_proj and down_proj; each extra kernel costs ~2 µs inside a
CUDA graph. This kernel streams W once (one program per ``BLOCK_N`` output columns, the whole K) and
fuses:

- ``norm_weight``: RMSNorm of x first, as ``rstd · (W @ (x ⊙ w_norm))``: the sum of squares is
  accumulated in the same pass over x and the row scale applied at the end, so ``rmsnorm → matmul``
  is one launch with no extra latency;
- ``gated``: W is a packed ``[gate | up]`` weight; each program computes matching gate and up columns
  and writes ``silu(gate) * up`` (``gate_up matmul → silu_mul`` in one launch);
- ``residual``: ``residual += x @ W^T`` in place (the decoder's ``x = x + f(x)``), so the residual
  stream needs no separate add.

Numerics: float32 accumulation; matmul outputs, silu and the residual add round in the model dtype as
the unfused ops do (``triton_ops.py``). The fused norm rounds ``x ⊙ w_norm`` (not ``x · rstd``, then
``· w_norm``) to the model dtype before the product: same math, different bf16 rounding points
(differences at the level of bf16 noise, see tests/test_gpu.py). Rows up to ``MAX_ROWS``; callers
use cuBLAS above that. Several rows run one program per (row, column block), rows adjacent so a
column block's programs share its weight tile through L2, each row computed exactly as a 1-row
product: a verify row's logits equal the 1-row decode's bit for bit up to attention. That costs
~rows × one row on big weights (bandwidth) but little more than one row on small models (latency);
``dot=True`` instead runs ``triton_dot.py``'s tensor-core kernel (weight rows × 16-row tiles of x,
split-K; any row count). CPU tensors work under ``TRITON_INTERPRET=1`` (tests).

Int4 weights (``W4Weight``) take the same call and fusions and run ``triton_w4.py``'s kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.models.quant.w4_weight import W4Weight
from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue
from tandem.worker.triton_dot import dot_gemv
from tandem.worker.triton_epilogue import store_rows
from tandem.worker.triton_w4 import w4_gemv, w4_runs

MAX_ROWS = 16  # one program per row; ``dot=True`` takes any row count
# Deferred reduction (element-wise partial sums, one cross-thread reduction after the K loop) pays for
# narrow column blocks (BLOCK_N <= 4: 1B o/down 8-12 % faster, SmolLM2 down 22 %) and loses for wider
# ones (8B: 4-12 % slower), measured on the H200 (docs/gpu_notes.md). ``gemv(defer=...)``
# (RunnerConfig.skinny_defer) forces it off/on for every shape. Both orders accumulate exactly in float32.


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, out_ptr, eps,
    M, N, stride_xm, stride_wn, stride_rm, stride_om, up_off,
    K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr,
    DEFER: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    # one row per program, rows fastest: the M programs of a column block run together, so the
    # weight tile comes from HBM once and from L2 for the rest
    row0 = pid % M
    pid = pid // M
    dt = w_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    m = row0 + tl.arange(0, 1)
    m_mask = m < M
    x_rows = x_ptr + m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + n[:, None].to(tl.int64) * stride_wn
    u_rows = w_rows + up_off * stride_wn  # GATED: the "up" half of a packed [gate | up] weight
    if PDL:  # see pdl.py: x, the residual and the output only after this
        pdl_prologue()

    acc = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([1, BLOCK_N], dtype=tl.float32)
    # DEFER: element-wise partial sums in registers, reduced across threads once after the loop
    # (instead of a cross-warp reduction per K tile). The norm's sum of squares is always deferred
    # (8B qkv 19.7 -> 17.8 µs, gate_up 63.0 -> 59.9 µs with the norm fused; docs/gpu_notes.md).
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss2 = tl.zeros([1, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        xv = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if NORM:  # rms(x) · (W @ (x ⊙ w_norm)): the row scale is applied after the loop
            xf = xv.to(tl.float32)
            ss2 += xf * xf
            nw = tl.load(nw_ptr + k, mask=k_mask, other=0.0).to(tl.float32)
            xv = (xf * nw[None, :]).to(dt)
        wm = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k[None, :], mask=wm, other=0.0)
        if DEFER:  # multiply-add on the CUDA cores
            acc2 += w.to(tl.float32) * xv.to(tl.float32)
        else:
            acc += tl.sum(w.to(tl.float32) * xv.to(tl.float32), 1)[None, :]
        if GATED:
            wu = tl.load(u_rows + k[None, :], mask=wm, other=0.0)
            if DEFER:
                acc2_u += wu.to(tl.float32) * xv.to(tl.float32)
            else:
                acc_u += tl.sum(wu.to(tl.float32) * xv.to(tl.float32), 1)[None, :]
    if DEFER:
        acc = tl.sum(acc2, 1)[None, :]
        acc_u = tl.sum(acc2_u, 1)[None, :]

    store_rows(acc, acc_u, tl.sum(ss2, 1), m, n, m_mask, n_mask, b_ptr, res_ptr, out_ptr, stride_rm, stride_om,
               up_off, eps, dt, K, NORM, HAS_BIAS, GATED, HAS_RES)


def gemv_config(m: int, n: int, k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [m, k] x [n, k]^T product, one program per row.

    Enough programs to keep every SM streaming (~384+ column blocks), long K tiles. Tuned on an H200
    with ``benchmarks/gpu_gemv.py --sweep`` (e.g. 8B: qkv (16, 1024, 8), o and down (8, 1024, 8),
    gate_up (32, 512, 4), each as fast as or faster than cuBLAS). The same config at every row count:
    each row is computed exactly as a 1-row product. (``dot=True``: ``triton_dot.dot_config``.)
    """
    block_n = 4
    while block_n < 32 and n // (2 * block_n) >= 384:
        block_n *= 2
    block_k = min(1024, 16384 // block_n, triton.next_power_of_2(k))
    return block_n, block_k, 8 if block_k >= 1024 else 4


# Per-row configs (BLOCK_N, BLOCK_K, num_warps, deferred reduction) for weight shapes where
# ``gemv_config``'s rule is not the fastest, by (N, K, fusion). SmolLM2-135M's qkv / o / gate_up: the
# rule's 1024-wide K tiles leave 44 % of a 576-wide row masked, and its 4-column gate_up programs made
# a k = 4 verify launch 5 x 384 of them. Measured on an H200 (`benchmarks/gpu_gemv.py --sweep-small
# 1,2,4,5,6`, then sets of configs over whole steps with `benchmarks/gpu_step_kernels.py`;
# docs/performance.md §34): decode unchanged (0.463 ms graph replay), 5-row verify 0.776 -> 0.619 ms,
# batch-4 decode 0.665 -> 0.589 ms. The same config at every row count keeps verify rows bitwise their
# 1-row decode.
SHAPE_CONFIGS: dict[tuple[int, int, str], tuple[int, int, int, bool]] = {
    (960, 576, "norm"): (8, 256, 8, True),
    (576, 576, "res"): (4, 128, 8, True),
    (3072, 576, "norm+gated"): (4, 1024, 2, True),
}


def fusion_key(norm: bool, gated: bool, residual: bool) -> str:
    """The fusion part of a ``SHAPE_CONFIGS`` key: "norm", "norm+gated", "res", "plain", ..."""
    return "+".join(name for name, on in (("norm", norm), ("gated", gated), ("res", residual)) if on) or "plain"


def _defer(block_n: int, forced: bool | None) -> bool:
    return block_n <= 4 if forced is None else forced


def gemv(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor | W4Weight,  # [N, K]; gated: [2I, K] packed gate | up
    bias: torch.Tensor | None = None,
    *,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    residual: torch.Tensor | None = None,  # [M, N], updated in place and returned
    config: tuple[int, ...] | None = None,  # gemv_config / triton_dot.dot_config / triton_w4's configs
    dot: bool = False,  # 2+ rows on the tensor-core kernel (triton_dot.py)
    defer: bool | None = None,  # deferred reduction: None = per shape (see _defer)
    invariant: bool = False,  # with dot: 16-row tiles at every row count (batch-invariant mode)
    out_dtype: torch.dtype | None = None,  # e.g. float32 logits: the accumulator stored unrounded
) -> torch.Tensor:  # [M, N] (gated: [M, I] = silu(x W_gate^T) * (x W_up^T))
    mrows, kin = x.shape
    nw_rows = weight.shape[0]
    nout = nw_rows // 2 if gated else nw_rows
    if mrows > MAX_ROWS and not dot and not isinstance(weight, W4Weight):
        raise ValueError(f"gemv handles at most {MAX_ROWS} rows (dot=True: any), got {mrows}")
    wt = weight.qweight if isinstance(weight, W4Weight) else weight  # what the kernel streams
    w4 = isinstance(weight, W4Weight)
    if weight.shape[1] != kin or x.stride(1) != 1 or (not w4 and wt.stride(1) != 1) or (gated and nw_rows % 2):
        raise ValueError(f"gemv: x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}")
    if residual is not None:
        if residual.shape != (mrows, nout) or residual.stride(1) != 1:
            raise ValueError(f"gemv: residual {tuple(residual.shape)} is not [{mrows}, {nout}]")
        out = residual
    else:
        if out_dtype is not None and gated:
            raise ValueError("gemv: out_dtype applies to plain products only")
        out = torch.empty((mrows, nout), dtype=out_dtype or weight.dtype, device=wt.device)
    if mrows == 0:
        return out
    if isinstance(weight, W4Weight):
        if w4_runs(x, weight, nout):
            w4_gemv(x, weight, bias, norm_weight, eps, gated, residual, out, config)
            return out
        weight, dot, invariant, config = weight.dequantize(), True, True, None  # no 16-bit MMA: float kernel
    if dot and (mrows > 1 or invariant):
        dot_gemv(x, weight, bias, norm_weight, eps, gated, residual, out, config)
        return out
    tuned = None if config else SHAPE_CONFIGS.get((nw_rows, kin, fusion_key(norm_weight is not None, gated,
                                                                             residual is not None)))
    if tuned is not None:
        block_n, block_k, warps, tuned_defer = tuned
        defer = tuned_defer if defer is None else defer
    else:
        block_n, block_k, warps = config or gemv_config(mrows, nw_rows, kin)
        if gated and config is None:  # each program reads block_n gate rows and block_n up rows
            block_n = max(4, block_n // 2)
    pdl = pdl_enabled(x.device)
    _gemv_kernel[(triton.cdiv(nout, block_n) * mrows,)](
        x, weight, bias if bias is not None else out,
        norm_weight if norm_weight is not None else out, out, out, eps,
        mrows, nout, x.stride(0), weight.stride(0), out.stride(0), out.stride(0), nout if gated else 0,
        K=kin, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, NORM=norm_weight is not None, GATED=gated,
        HAS_RES=residual is not None, DEFER=_defer(block_n, defer), PDL=pdl,
        num_warps=warps, **launch_kwargs(pdl),
    )
    return out
