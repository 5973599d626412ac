"""Split-K for the tensor-core skinny matmuls (``triton_dot.py`` float weights, ``triton_w4.py`` int4):
when a weight has too few column blocks to keep every SM busy, ``SPLIT`` programs share a column
block's K range. Each writes its float32 partial sums (and, with a fused RMSNorm, its partial sum of
squares of x) to a workspace; the last one to finish — an atomic counter per (column block, row
block), reset by that program — adds the partials in split order and runs the shared epilogue
(``triton_epilogue.store_rows``). Deterministic: no float atomics, a fixed order of the sum.
``finish_split`` does this for ``triton_dot.py``'s [BLOCK_N, BLOCK_M] accumulators; ``triton_w4.py``
keeps its partials per lane (MMA fragments), so it stores them itself and runs the same counter and
in-order sum over this workspace.

The workspace and the counters are per device and made on first use, normally in the warm-up
before a CUDA graph is captured (a first use during capture would zero the counters only when the
graph replays). Launches on one stream only: two streams running split-K products at once would
share the counters. ``row_chunks`` bounds the workspace: a product of many rows (a prefill in
batch-invariant mode) runs as several launches of at most ``CHUNK_ROWS`` rows each, which changes no
row's result (rows never depend on each other).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker.triton_epilogue import store_rows

CHUNK_ROWS = 64  # rows per split-K launch (workspace: SPLIT x 64 x N float32)
_COUNTERS = 1 << 16
_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_KEEP: list[torch.Tensor] = []  # workspaces replaced by larger ones: captured CUDA graphs may still use them


def workspace(device: torch.device, floats: int, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 workspace of at least ``floats``, int32 counters for ``blocks`` (column, row) blocks,
    zero between launches)."""
    if blocks > _COUNTERS:
        raise ValueError(f"split-K: {blocks} column/row blocks exceed the {_COUNTERS} counters")
    ws, cnt = _WORKSPACE.get(device, (None, None))
    if cnt is None:
        cnt = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    if ws is None or ws.numel() < floats:
        if ws is not None:
            _KEEP.append(ws)
        ws = torch.empty(max(floats, 1 << 20), dtype=torch.float32, device=device)
    _WORKSPACE[device] = (ws, cnt)
    return ws, cnt


def row_chunks(rows: int, split: int) -> list[tuple[int, int]]:
    """[start, end) row ranges, one launch each: all rows at once without split-K."""
    step = rows if split == 1 else CHUNK_ROWS
    return [(r, min(rows, r + step)) for r in range(0, max(rows, 1), max(step, 1))]


@triton.jit
def finish_split(acc, acc_u, ss, sp, nb, mb, mblocks, m, n, m_mask, n_mask, ws_ptr, cnt_ptr, b_ptr, res_ptr,
                 out_ptr, stride_rm, stride_om, up_off, N, eps, dt: tl.constexpr, K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
                 HAS_BIAS: tl.constexpr, GATED: tl.constexpr, HAS_RES: tl.constexpr):
    """acc, acc_u: [BLOCK_N, BLOCK_M] float32 partial sums of split ``sp`` (weight rows × x rows);
    ss: [BLOCK_M] its partial sum of squares of x (NORM). Stores the result once every split is in."""
    if SPLIT == 1:
        store_rows(tl.trans(acc), tl.trans(acc_u), ss, m, n, m_mask, n_mask, b_ptr, res_ptr, out_ptr, stride_rm,
                   stride_om, up_off, eps, dt, K, NORM, HAS_BIAS, GATED, HAS_RES)
    else:
        # workspace: [SPLIT, rows, N + up_off] float32 partial sums, then [SPLIT, rows] sums of squares
        mp = mblocks * BLOCK_M
        width = N + up_off
        part_at = ws_ptr + (sp * mp + m[None, :]).to(tl.int64) * width + n[:, None]
        om = n_mask[:, None] & m_mask[None, :]
        tl.store(part_at, acc, mask=om)
        if GATED:
            tl.store(part_at + N, acc_u, mask=om)
        if NORM:  # the same values from every column block: any one will do
            tl.store(ws_ptr + SPLIT * mp * width + sp * mp + m, ss, mask=m_mask)
        tl.debug_barrier()  # every thread's partials written before the release below
        cnt = cnt_ptr + nb * mblocks + mb
        if tl.atomic_add(cnt, 1, sem="acq_rel") == SPLIT - 1:  # the last split of this block: finish it
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            ss = tl.zeros([BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT):  # in split order: deterministic
                at = ws_ptr + (s * mp + m[None, :]).to(tl.int64) * width + n[:, None]
                acc += tl.load(at, mask=om, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_u += tl.load(at + N, mask=om, other=0.0, cache_modifier=".cg")
                if NORM:
                    ss += tl.load(ws_ptr + SPLIT * mp * width + s * mp + m, mask=m_mask, other=0.0,
                                  cache_modifier=".cg")
            tl.atomic_xchg(cnt, 0)  # ready for the next launch
            store_rows(tl.trans(acc), tl.trans(acc_u), ss, m, n, m_mask, n_mask, b_ptr, res_ptr, out_ptr,
                       stride_rm, stride_om, up_off, eps, dt, K, NORM, HAS_BIAS, GATED, HAS_RES)
