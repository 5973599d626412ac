"""Row-wise argmax of logits in Triton: the greedy token of every row in two short kernels.

torch's argmax reduces a single long row with one thread block: 36 µs for one row of a 128k
vocabulary on an H200 (profiled in the engine's decode loop, docs/gpu_notes.md), ~4 % of a 1B
decode step. Here each row is cut into ``CHUNK``-element pieces: one program per (row, piece) finds
the piece's maximum and its first index, and a second kernel picks, per row, the first piece holding
the row's maximum. Same result as ``torch.argmax`` (the lowest index among equal maxima) for rows
without NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker.pdl import launch_kwargs, pdl_enabled, pdl_prologue

CHUNK = 4096


@triton.jit
def _partial_argmax_kernel(x_ptr, pmax_ptr, pidx_ptr, V, stride_x, S, CHUNK: tl.constexpr,
                           PDL: tl.constexpr):
    if PDL:
        pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    piece = tl.program_id(1)
    offs = piece * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_ptr + row * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    m, i = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(pmax_ptr + row * S + piece, m)
    tl.store(pidx_ptr + row * S + piece, piece * CHUNK + i)


@triton.jit
def _final_argmax_kernel(pmax_ptr, pidx_ptr, out_ptr, S, S_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_PAD)
    m = tl.load(pmax_ptr + row * S + s, mask=s < S, other=float("-inf"))
    best = tl.max(m, 0)
    # the first piece holding the maximum holds its first index
    first = tl.min(tl.where(m == best, s, S_PAD), 0)
    tl.store(out_ptr + row, tl.load(pidx_ptr + row * S + first).to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a CUDA [rows, vocab] tensor (unit stride along the vocabulary)."""
    rows, v = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    s = triton.cdiv(v, CHUNK)
    pmax = torch.empty((rows, s), dtype=torch.float32, device=x.device)
    pidx = torch.empty((rows, s), dtype=torch.int32, device=x.device)
    pdl = pdl_enabled(x.device)
    _partial_argmax_kernel[(rows, s)](x, pmax, pidx, v, x.stride(0), s, CHUNK=CHUNK, PDL=pdl, num_warps=4,
                                      **launch_kwargs(pdl))
    _final_argmax_kernel[(rows,)](pmax, pidx, out, s, S_PAD=max(2, triton.next_power_of_2(s)), PDL=pdl,
                                  num_warps=1, **launch_kwargs(pdl))
    return out


__all__ = ["argmax_rows", "CHUNK"]
