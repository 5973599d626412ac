"""Paged attention over the flat-slot KV cache in Triton: prefill chunks, decodes and verifies.

One kernel serves every step shape. A program owns (request, query tile, kv head, kv split): the
tile's rows are ``BLOCK_M`` (query token, head-in-group) pairs, so the G query heads that share a
KV head (GQA) read each K/V tile once. Decode (q = 1) and verify (q = k + 1) are the small-tile
cases; prefill chunks use several query tiles.

Layout and metadata (device tensors, see ``AttentionMetadata``):
- K/V cache per layer ``[num_slots, kv_heads, head_dim]``; slot = block_id * block_size + offset;
  any block size (a key tile may span several blocks: each key's block is looked up).
- ``query_start[i]``: first row of request i in the ``[T, heads, head_dim]`` activations;
  ``query_lens[i]``: its real query tokens. Rows ``query_start[i] + query_lens[i] ..
  query_start[i+1] - 1`` are padding (CUDA-graph buckets pad every request to one query length):
  they are written as zeros. ``seq_lens[i]``: context length including the new tokens, so query row
  r sits at position ``seq_lens[i] - query_lens[i] + r`` (causal offset).
- Sliding window w (> 0): key j visible from position p iff p - w < j <= p (as HF Gemma3/Mistral).

Batch invariance (``fixed_tiles`` and one split): a row's scores and its softmax-weighted sum come
from tl.dot tiles of fixed shape, over key tiles at fixed offsets from 0; key tiles past a row's
position (other rows of its query tile reach further) are fully masked and change nothing
(rescaling by exp2(0) = 1, adding exact zeros), so a decode row, the same row in a verify and in a
prefill chunk compute the same bits.

Split-KV ("flash decoding"): with few requests the (request × kv head) grid leaves most SMs idle,
so the key range is cut into ``num_splits`` pieces whose partial (max, sum, acc) are merged by a
second small kernel. The split count is a launch argument (not a compile-time constant), so a
CUDA graph captured for a batch bucket works for any context length; empty splits write neutral
partials. Softmax runs in base 2 with the scale folded in, in float32, from a finite -1e30 start
so fully masked (padding) rows give 0, never NaN.

``TRITON_INTERPRET=1`` runs these kernels on CPU tensors (slowly) for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue

LOG2E = 1.4426950408889634
MAX_SPLITS = 16
_NEG = tl.constexpr(-1.0e30)


# The split count changes with the context length on eager steps: it is neither specialised nor a
# compile-time constant (the merge always spans MAX_SPLITS), so a new prompt length never compiles a
# new variant mid-serving (that was a 0.55-0.9 s first-token stall on real prompts, docs/gpu_notes.md).
# Nor is the block-table row stride: graphs use the runner's full table width, eager steps the step's
# widest table, and Triton would otherwise compile one variant for widths divisible by 16 and another
# for the rest (a compile mid-serving the warm-up cannot foresee).
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    mpart_ptr, lpart_ptr, apart_ptr,
    bt_ptr, seq_lens_ptr, qstart_ptr, qlens_ptr,
    qk_scale, window, num_splits,
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_bt,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):
    # Metadata and block tables are uploaded before the step's first kernel; no kernel writes them, so
    # with PDL they are read before the wait (pdl.py). Queries and K/V come after it.
    req = tl.program_id(0)
    qtile = tl.program_id(1)
    pid2 = tl.program_id(2)
    kvh = pid2 // num_splits
    split = pid2 % num_splits

    q_start = tl.load(qstart_ptr + req)
    q_span = tl.load(qstart_ptr + req + 1) - q_start  # padded rows of this request
    q0 = qtile * BLOCK_Q
    if q0 >= q_span:
        return
    q_len = tl.load(qlens_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    qi = q0 + offs_m // G  # query index within the request
    head = kvh * G + offs_m % G
    in_tile = (offs_m // G) < BLOCK_Q
    row_real = in_tile & (qi < q_len)
    row_store = in_tile & (qi < q_span)
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D

    tok = (q_start + qi).to(tl.int64)
    qpos = seq_len - q_len + qi  # [BLOCK_M]

    # Key range of the tile: up to its last real query (causal), from the window's start.
    n_real = tl.minimum(tl.maximum(q_len - q0, 0), BLOCK_Q)
    kv_hi = tl.where(n_real > 0, seq_len - q_len + q0 + n_real, 0)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(seq_len - q_len + q0 - window + 1, 0)
    kv_lo = tl.minimum(kv_lo, kv_hi)
    chunk = tl.cdiv(tl.cdiv(kv_hi - kv_lo, num_splits), BLOCK_N) * BLOCK_N
    s_lo = kv_lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, kv_hi)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    # block ids of the next key tile, loaded one iteration ahead
    offs_n = s_lo + tl.arange(0, BLOCK_N)
    blk = tl.load(bt_row + offs_n // PAGE, mask=offs_n < s_hi, other=0).to(tl.int64)
    if PDL:
        pdl_prologue()

    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_real[:, None] & dmask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    for start in range(s_lo, s_hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        nmask = offs_n < s_hi
        slot = blk * PAGE + offs_n % PAGE
        nxt = offs_n + BLOCK_N
        blk = tl.load(bt_row + nxt // PAGE, mask=nxt < s_hi, other=0).to(tl.int64)
        kt = tl.load(k_ptr + slot[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                     mask=nmask[None, :] & dmask[:, None], other=0.0)  # [D_PAD, BLOCK_N]
        s = tl.dot(q, kt) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        vis = nmask[None, :] & (offs_n[None, :] <= qpos[:, None]) & row_real[:, None]
        if HAS_WINDOW:
            vis = vis & (offs_n[None, :] > qpos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                    mask=nmask[:, None] & dmask[None, :], other=0.0)  # [BLOCK_N, D_PAD]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        # partials [T, H, S] and [T, H, S, D]; rows of padding get neutral partials too
        base = (tok * H + head) * num_splits + split
        tl.store(mpart_ptr + base, m_i, mask=row_store)
        tl.store(lpart_ptr + base, l_i, mask=row_store)
        tl.store(apart_ptr + base[:, None] * D + offs_d[None, :], acc,
                 mask=row_store[:, None] & dmask[None, :])
    else:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(o_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_store[:, None] & dmask[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(
    o_ptr, mpart_ptr, lpart_ptr, apart_ptr, num_splits,
    stride_ot, stride_oh,
    H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see pdl.py: nothing read or written before this
        pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    smask = offs_s < num_splits
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d < D
    base = (t * H + h) * num_splits
    m = tl.load(mpart_ptr + base + offs_s, mask=smask, other=_NEG)
    l = tl.load(lpart_ptr + base + offs_s, mask=smask, other=0.0)
    mx = tl.max(m, 0)
    w = tl.exp2(m - mx)
    total = tl.sum(w * l, 0)
    a = tl.load(apart_ptr + (base + offs_s)[:, None] * D + offs_d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    num = tl.sum(w[:, None] * a, 0)
    out = tl.where(total > 0, num / tl.maximum(total, 1e-30), 0.0)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_k, stride_v, stride_kc, stride_vc,
    E: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:  # see pdl.py: nothing read or written before this
        pdl_prologue()
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token of a CUDA-graph bucket
        return
    offs = tl.arange(0, BLOCK)
    mask = offs < E
    k = tl.load(k_ptr + t.to(tl.int64) * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_v + offs, mask=mask)
    tl.store(kc_ptr + slot * stride_kc + offs, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + slot * stride_vc + offs, v.to(vc_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v [T, kv_heads, head_dim] (token stride free, inner dims contiguous) → cache slots; slot < 0 skipped."""
    t = k.shape[0]
    if t == 0:
        return
    e = k.shape[1] * k.shape[2]
    if k.stride(2) != 1 or k.stride(1) != k.shape[2]:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != v.shape[2]:
        v = v.contiguous()
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), k_cache.stride(0), v_cache.stride(0),
        E=e, BLOCK=triton.next_power_of_2(e), num_warps=4 if e >= 1024 else 2,
        PDL=(pdl := pdl_enabled(k.device)), **launch_kwargs(pdl),
    )


def pick_num_splits(num_reqs: int, kv_heads: int, q_tiles: int, max_seq_len: int | None,
                    num_sms: int) -> int:
    """Split the key range when (requests × tiles × kv heads) programs would leave SMs idle."""
    base = max(1, num_reqs * kv_heads * q_tiles)
    if base >= num_sms:
        return 1
    s = min(MAX_SPLITS, -(-2 * num_sms // base))
    if max_seq_len is not None:  # eager steps know the context: no split shorter than 64 keys
        s = min(s, max(1, -(-max_seq_len // 64)))
    return max(1, s)


def tile_shape(max_query_len: int, group: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows per tile (power of 2, 16..64) and query tokens per tile."""
    block_m = max(16, triton.next_power_of_2(max(1, max_query_len) * group))
    block_m = min(block_m, 64 if group <= 64 else triton.next_power_of_2(group))
    return block_m, max(1, block_m // group)


_SM_COUNT: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def paged_attention_triton(
    q: torch.Tensor,  # [T, heads, head_dim]; token stride free, head/dim strides (head_dim, 1)
    k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_reqs]
    query_start: torch.Tensor,  # [num_reqs + 1] (padded layout)
    query_lens: torch.Tensor,  # [num_reqs] real query tokens
    block_size: int,
    scale: float,
    max_query_len: int,
    num_splits: int,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    fixed_tiles: bool = False,  # batch-invariant mode: query tiles that do not depend on the step
) -> torch.Tensor:  # [T, heads, head_dim]
    t, heads, d = q.shape
    kvh = k_cache.shape[1]
    g = heads // kvh
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty((t, heads, d), dtype=q.dtype, device=q.device)
    if t == 0 or num_reqs == 0:
        return out
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    if q.stride(2) != 1 or q.stride(1) != d:
        q = q.contiguous()
    block_m, block_q = tile_shape(1, g) if fixed_tiles else tile_shape(max_query_len, g)
    q_tiles = -(-max_query_len // block_q)
    d_pad = triton.next_power_of_2(d)
    block_n = 64 if d_pad <= 128 else 32
    split = num_splits > 1
    if split:
        mpart = torch.empty((t, heads, num_splits), dtype=torch.float32, device=q.device)
        lpart = torch.empty_like(mpart)
        apart = torch.empty((t, heads, num_splits, d), dtype=torch.float32, device=q.device)
    else:
        mpart = lpart = apart = out  # unused
    window = int(sliding_window) if sliding_window else 0
    pdl = pdl_enabled(q.device)
    _attn_kernel[(num_reqs, q_tiles, kvh * num_splits)](
        q, k_cache, v_cache, out, mpart, lpart, apart,
        block_tables, seq_lens, query_start, query_lens,
        scale * LOG2E, window, num_splits,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        H=heads, G=g, D=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        PAGE=block_size, SPLIT=split, HAS_WINDOW=window > 0,
        num_warps=4, num_stages=2, PDL=pdl, **launch_kwargs(pdl),
    )
    if split:
        _merge_kernel[(t, heads)](
            out, mpart, lpart, apart, num_splits, out.stride(0), out.stride(1),
            H=heads, D=d, D_PAD=d_pad, S_PAD=MAX_SPLITS, num_warps=1 if d_pad <= 64 else 2,
            PDL=pdl, **launch_kwargs(pdl),
        )
    return out


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_tables: list[list[int]], seq_lens: list[int], query_start: list[int],
                        query_lens: list[int], block_size: int, scale: float,
                        sliding_window: int | None = None) -> torch.Tensor:
    """Float64 plain-torch reference with the same metadata (padded rows → 0), for tests."""
    t, heads, d = q.shape
    kvh = k_cache.shape[1]
    g = heads // kvh
    out = torch.zeros((t, heads, d), dtype=torch.float64, device=q.device)
    for i, (L, qs, ql) in enumerate(zip(seq_lens, query_start, query_lens)):
        if ql == 0:
            continue
        pos = torch.arange(L, device=q.device)
        slots = torch.tensor([block_tables[i][p // block_size] * block_size + p % block_size for p in range(L)],
                             device=q.device)
        k = k_cache[slots].double().repeat_interleave(g, dim=1)  # [L, heads, d]
        v = v_cache[slots].double().repeat_interleave(g, dim=1)
        qq = q[qs:qs + ql].double()  # [ql, heads, d]
        s = torch.einsum("qhd,khd->hqk", qq, k) * scale
        qpos = L - ql + torch.arange(ql, device=q.device)
        mask = pos[None, :] <= qpos[:, None]
        if sliding_window:
            mask = mask & (pos[None, :] > qpos[:, None] - sliding_window)
        s = s.masked_fill(~mask[None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        out[qs:qs + ql] = torch.einsum("hqk,khd->qhd", p, v)
    return out


__all__ = ["paged_attention_triton", "write_kv_triton", "pick_num_splits", "tile_shape", "num_sms",
           "reference_attention", "MAX_SPLITS"]
