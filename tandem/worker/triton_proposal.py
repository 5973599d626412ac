"""An EAGLE proposal graph's step-to-step bookkeeping on CUDA, one Triton launch each.

Inside ``GpuHeadRunner.forward_proposal``'s graph the chain's entry step (``_derive_chain``: the
selected drafts and feedback rows, each request's position, KV slot and context one further, the
block table carried over) was ~15 small torch kernels, and each later chain step's advance
(``advance_one`` with the ids and hidden rows fed from the step before) ~11. The round was partly
bound by the device after §52, so those launches' device time counts: here each is one program per
request. The torch ops stay the reference (and the path off CUDA): tests/worker/test_triton_interpret.py
checks these kernels write what they write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker.input_packer import layout

_INTS = ["s_pos", "s_ql", "s_bt", "s_sel", "d_pos", "d_slot", "d_seq", "d_qs", "d_ql", "d_bt",
         "b", "w", "bs", "hdim", "fb_stride", "h_stride"]


@triton.jit(do_not_specialize=_INTS)
def _chain_entry_kernel(src, dst, tok, fb, hidden, draft_out, s_pos, s_ql, s_bt, s_sel,
                        d_pos, d_slot, d_seq, d_qs, d_ql, d_bt, b, w, bs, hdim, fb_stride, h_stride,
                        BW: tl.constexpr, BH: tl.constexpr):
    i = tl.program_id(0)
    sel = tl.load(src + s_sel + i)
    draft = tl.load(tok + sel)
    real = tl.minimum(tl.load(src + s_ql + i), 1)
    pos = (tl.load(src + s_pos + sel) + 1) * real
    col = tl.minimum(pos // bs, w - 1)
    block = tl.load(src + s_bt + i * w + col)
    tl.store(dst + i, draft)  # (ids first in the layout)
    tl.store(draft_out + i, draft)
    tl.store(dst + d_pos + i, pos)
    tl.store(dst + d_slot + i, tl.where(real > 0, block * bs + pos % bs, -1))
    tl.store(dst + d_seq + i, (pos + 1) * real)
    tl.store(dst + d_qs + i + 1, i + 1)
    tl.store(dst + d_qs, 0)  # (every program: the same value)
    tl.store(dst + d_ql + i, real)
    j = tl.arange(0, BW)
    tl.store(dst + d_bt + i * w + j, tl.load(src + s_bt + i * w + j, mask=j < w), mask=j < w)
    h = tl.arange(0, BH)
    row = tl.load(fb + sel * fb_stride + h, mask=h < hdim)
    tl.store(hidden + i * h_stride + h, row, mask=h < hdim)


def chain_entry_cuda(src: torch.Tensor, dst: torch.Tensor, tok: torch.Tensor, fb: torch.Tensor,
                     hidden: torch.Tensor, b: int, q: int, w: int, block_size: int) -> torch.Tensor:
    """``GpuHeadRunner._derive_chain`` in one launch: from a first step of ``b`` requests × ``q`` rows
    packed in ``src`` (its selected rows after the layout's end), the first chain step packed in
    ``dst`` (``layout(b, b, w)``) and its hidden rows in ``hidden``. Returns the selected drafts [b]."""
    o1, o2 = layout(b * q, b, w), layout(b, b, w)
    draft = torch.empty(b, dtype=tok.dtype, device=tok.device)
    hdim = fb.shape[1]
    _chain_entry_kernel[(b,)](src, dst, tok, fb, hidden, draft, o1[1], o1[5], o1[6], o1[7],
                              o2[1], o2[2], o2[3], o2[4], o2[5], o2[6], b, w, block_size, hdim,
                              fb.stride(0), hidden.stride(0), BW=triton.next_power_of_2(w),
                              BH=triton.next_power_of_2(hdim), num_warps=1)
    return draft


@triton.jit(do_not_specialize=["o_pos", "o_slot", "o_seq", "o_ql", "o_bt", "w", "bs", "hdim", "fb_stride",
                               "h_stride"])
def _advance_kernel(buf, tok, fb, hidden, o_pos, o_slot, o_seq, o_ql, o_bt, w, bs, hdim, fb_stride, h_stride,
                    BH: tl.constexpr):
    i = tl.program_id(0)
    real = tl.load(buf + o_ql + i)
    pos = tl.load(buf + o_pos + i) + real
    tl.store(buf + o_pos + i, pos)
    tl.store(buf + o_seq + i, tl.load(buf + o_seq + i) + real)
    col = tl.minimum(pos // bs, w - 1)
    block = tl.load(buf + o_bt + i * w + col)
    slot = tl.load(buf + o_slot + i)
    tl.store(buf + o_slot + i, tl.where(real > 0, block * bs + pos % bs, slot))
    tl.store(buf + i, tl.load(tok + i))  # (ids first in the layout)
    h = tl.arange(0, BH)
    tl.store(hidden + i * h_stride + h, tl.load(fb + i * fb_stride + h, mask=h < hdim), mask=h < hdim)


def advance_one_cuda(buf: torch.Tensor, tok: torch.Tensor, fb: torch.Tensor, hidden: torch.Tensor, b: int,
                     w: int, block_size: int) -> None:
    """A chain step's next one in one launch: ids ← ``tok``, hidden rows ← ``fb`` and
    ``input_packer.advance_one`` (each real request one position further, context one longer, KV slot
    from its block table; padding requests unchanged)."""
    _, o_pos, o_slot, o_seq, _, o_ql, o_bt, _ = layout(b, b, w)
    hdim = fb.shape[1]
    _advance_kernel[(b,)](buf, tok, fb, hidden, o_pos, o_slot, o_seq, o_ql, o_bt, w, block_size, hdim,
                          fb.stride(0), hidden.stride(0), BH=triton.next_power_of_2(hdim), num_warps=1)
