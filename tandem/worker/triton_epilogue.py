"""The skinny matmuls' shared epilogue (``triton_gemv.py`` float weights, ``triton_w4.py`` int4): the
fused RMSNorm's row scale, bias, silu(gate)·up, the in-place residual add, the store.

Numerics: ``acc`` / ``acc_u`` are float32 sums of ``x ⊙ w_norm`` (rounded to the model dtype) times
the weight; the row scale ``rstd`` multiplies them afterwards; outputs, silu and the residual add
round in the model dtype as the unfused ops do (``triton_ops.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_rows(acc, acc_u, ssq, m, n, m_mask, n_mask, b_ptr, res_ptr, out_ptr, stride_rm, stride_om, up_off,
               eps, dt: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr, HAS_BIAS: tl.constexpr,
               GATED: tl.constexpr, HAS_RES: tl.constexpr):
    """acc, acc_u: [BLOCK_M, BLOCK_N] float32; ssq: [BLOCK_M] sum of x² over K (NORM only)."""
    if NORM:
        rstd = 1.0 / tl.sqrt(ssq / K + eps)
        acc = acc * rstd[:, None]
        acc_u = acc_u * rstd[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_u += tl.load(b_ptr + up_off + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(out_ptr.dtype.element_ty)  # dt, or float32 logits (``out_dtype``)
    if GATED:  # silu(gate) * up, rounded as the unfused matmul + silu_mul would
        g = y.to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        y = (a * acc_u.to(dt).to(tl.float32)).to(dt)
    om = m_mask[:, None] & n_mask[None, :]
    if HAS_RES:
        r_ptrs = res_ptr + m[:, None].to(tl.int64) * stride_rm + n[None, :]
        r = tl.load(r_ptrs, mask=om, other=0.0).to(tl.float32)
        y = (r + y.to(tl.float32)).to(dt)
        tl.store(r_ptrs, y, mask=om)
    else:
        tl.store(out_ptr + m[:, None].to(tl.int64) * stride_om + n[None, :], y, mask=om)
