"""Fused elementwise kernels for the CUDA fast path (Triton): fewer, larger launches per layer.

At batch 1 a decoder layer's four matmuls read ~0.5 GB (8B shape) in ~110 µs, while each extra
tiny kernel costs ~2 µs of launch and tail even inside a CUDA graph; the unfused torch code spends
~25 small kernels per layer on norms, rope and the KV write. These kernels cut that to four:

- ``rmsnorm`` / ``add_rmsnorm``: (residual += x) then RMSNorm, one pass over the row;
- ``rope_write_kv``: rotary on q (in place, inside the packed qkv output) and k, optional per-head
  q/k RMSNorm first (Qwen3), and the K/V cache write, in one launch;
- ``silu_mul``: act(gate) * up of the packed gate_up output.

Numerics follow the torch modules they replace (``layers.py``): float32 reductions, the product
with the norm weight rounded in the model dtype, residual adds rounded in the model dtype. Rotary
runs in float32 and rounds once (torch rounds after each of its bf16 ops), so bf16 results differ
by rounding only. CPU tensors work under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, eps,
    stride_x, stride_r, stride_o,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see pdl.py: nothing read or written before this
        pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = xf * rstd
    if OFFSET:
        out = y * (1.0 + w)
    else:
        out = y.to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            offset: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of x [T, N]; with ``residual``: residual += x in place first, and normalise that."""
    t, n = x.shape
    if out is None:
        out = torch.empty_like(x)
    if t == 0:
        return out
    res = residual if residual is not None else x
    block = triton.next_power_of_2(n)
    _rmsnorm_kernel[(t,)](
        x, res, weight, out, eps, x.stride(0), res.stride(0), out.stride(0),
        N=n, BLOCK=block, HAS_RES=residual is not None, OFFSET=offset,
        num_warps=max(1, min(16, block // 512)), PDL=(pdl := pdl_enabled(x.device)), **launch_kwargs(pdl),
    )
    return out


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, qw_ptr, kw_ptr, eps,
    stride_qkv, stride_cos, stride_kc, stride_vc,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    H_PAD: tl.constexpr, KVH_PAD: tl.constexpr, E_PAD: tl.constexpr,
    QK_NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = qkv_ptr + t * stride_qkv
    # positions and slots are uploaded before the step's first kernel, cos/sin are constants: with PDL
    # they are read before the wait (pdl.py); qkv and the caches after it
    pos = tl.load(pos_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + i)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cos + i)[None, :]
    if PDL:
        pdl_prologue()
    dt = qkv_ptr.dtype.element_ty

    # q heads, in place
    h = tl.arange(0, H_PAD)
    hm = (h < H)[:, None]
    p1 = row + h[:, None] * D + i[None, :]
    x1 = tl.load(p1, mask=hm, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=hm, other=0.0).to(tl.float32)
    if QK_NORM:
        r = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + eps)[:, None]
        w1 = tl.load(qw_ptr + i).to(tl.float32)[None, :]
        w2 = tl.load(qw_ptr + HALF + i).to(tl.float32)[None, :]
        if NORM_OFFSET:
            x1 = (x1 * r * (1.0 + w1)).to(dt).to(tl.float32)
            x2 = (x2 * r * (1.0 + w2)).to(dt).to(tl.float32)
        else:
            x1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            x2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(dt), mask=hm)
    tl.store(p1 + HALF, (x2 * cos + x1 * sin).to(dt), mask=hm)

    # k heads → cache (slot < 0: padding token, nothing written)
    kh = tl.arange(0, KVH_PAD)
    km = ((kh < KVH)[:, None]) & (slot >= 0)
    pk = row + H * D + kh[:, None] * D + i[None, :]
    y1 = tl.load(pk, mask=km, other=0.0).to(tl.float32)
    y2 = tl.load(pk + HALF, mask=km, other=0.0).to(tl.float32)
    if QK_NORM:
        r = 1.0 / tl.sqrt((tl.sum(y1 * y1, 1) + tl.sum(y2 * y2, 1)) / D + eps)[:, None]
        w1 = tl.load(kw_ptr + i).to(tl.float32)[None, :]
        w2 = tl.load(kw_ptr + HALF + i).to(tl.float32)[None, :]
        if NORM_OFFSET:
            y1 = (y1 * r * (1.0 + w1)).to(dt).to(tl.float32)
            y2 = (y2 * r * (1.0 + w2)).to(dt).to(tl.float32)
        else:
            y1 = ((y1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
            y2 = ((y2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    ck = kc_ptr + slot * stride_kc + kh[:, None] * D + i[None, :]
    ety = kc_ptr.dtype.element_ty
    tl.store(ck, (y1 * cos - y2 * sin).to(dt).to(ety), mask=km)
    tl.store(ck + HALF, (y2 * cos + y1 * sin).to(dt).to(ety), mask=km)

    # v → cache
    e = tl.arange(0, E_PAD)
    em = (e < KVH * D) & (slot >= 0)
    v = tl.load(row + (H + KVH) * D + e, mask=em, other=0.0)
    tl.store(vc_ptr + slot * stride_vc + e, v.to(vc_ptr.dtype.element_ty), mask=em)


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D], q rotated in place
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_pos, D] float32 (HF layout: two equal halves)
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T], < 0 = skip
    k_cache: torch.Tensor,  # [slots, KVH, D]
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    norm_offset: bool = False,
) -> None:
    t = qkv.shape[0]
    if t == 0:
        return
    d = head_dim
    if d & (d - 1) or qkv.stride(1) != 1 or cos.stride(1) != 1:
        raise ValueError("rope_write_kv needs a power-of-2 head_dim and contiguous rows")
    qk_norm = q_norm is not None
    _rope_kv_kernel[(t,)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache,
        q_norm if qk_norm else qkv, k_norm if qk_norm else qkv, eps,
        qkv.stride(0), cos.stride(0), k_cache.stride(0), v_cache.stride(0),
        H=num_heads, KVH=num_kv_heads, D=d, HALF=d // 2,
        H_PAD=triton.next_power_of_2(num_heads), KVH_PAD=triton.next_power_of_2(num_kv_heads),
        E_PAD=triton.next_power_of_2(num_kv_heads * d), QK_NORM=qk_norm, NORM_OFFSET=norm_offset,
        num_warps=4, PDL=(pdl := pdl_enabled(qkv.device)), **launch_kwargs(pdl),
    )


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, I: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # see pdl.py: nothing read or written before this
        pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(gu_ptr + row * stride_gu + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + I + offs, mask=mask, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    a = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (a * u).to(dt), mask=mask)


def silu_mul(gu: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] → [T, I]."""
    t = gu.shape[0]
    out = torch.empty((t, intermediate), dtype=gu.dtype, device=gu.device)
    if t == 0:
        return out
    block = min(2048, triton.next_power_of_2(intermediate))
    _silu_mul_kernel[(t, triton.cdiv(intermediate, block))](
        gu, out, gu.stride(0), out.stride(0), I=intermediate, BLOCK=block, num_warps=4,
        PDL=(pdl := pdl_enabled(gu.device)), **launch_kwargs(pdl),
    )
    return out
