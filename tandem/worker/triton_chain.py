"""``chain.chain_fixup`` on CUDA: one Triton program per request of the chained step, one launch.

A chained verify at batch 1 on the H200 spends its time on the host (the GPU computes a SmolLM2
verify in ~0.5 ms); the same fix-up in torch ops was ~25 small launches. Program i reads its
descriptor (``chain.pack_chain``), counts the accepted drafts against the verify's row argmaxes,
writes the emitted token as its first id and moves its rows back by the rejected count.
``chain_select_cuda``: the same count moves a selected output row back (an EAGLE head's chained
first step). Both take a step's fed rows (``input_packer.feed_rows``: ids[rows] = values[src]) in the
same launch, one program more (a chained verify's EAGLE drafts, a chained catch-up's verify
argmaxes: ``triton_feed.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker import triton_feed
from tandem.worker.batch import FedTokens
from tandem.worker.input_packer import layout
from tandem.worker.triton_feed import feed_args, feed_program


@triton.jit
def _accepted(d, rows_ptr, HEAD: tl.constexpr, KP: tl.constexpr):
    """A descriptor's (``d``) verify rows' offset, draft count and accepted count."""
    base = tl.load(d + 2)
    k = tl.load(d + 3)
    j = tl.arange(0, KP)
    valid = j < k
    g = tl.load(rows_ptr + base + j, mask=valid, other=-2)
    drafts = tl.load(d + HEAD + j, mask=valid, other=-1)
    return base, k, tl.min(tl.where(valid & (g != drafts), j, k), 0)  # the first mismatch, else k


# (offsets and counts vary with the step's shape, the values' view with the proposal: unspecialised,
# so no step compiles a variant while serving)
@triton.jit(do_not_specialize=["vals_ptr", "o_ids", "o_pos", "o_slot", "o_seq", "o_bt", "w", "bs", "off", "stride",
                               "n", "f_off", "m"])
def _chain_fixup_kernel(dev_ptr, rows_ptr, vals_ptr, o_ids, o_pos, o_slot, o_seq, o_bt, w, bs, off, stride, n,
                        f_off, m, HEAD: tl.constexpr, KP: tl.constexpr, QP: tl.constexpr, FB: tl.constexpr):
    i = tl.program_id(0)
    if i < n:
        d = dev_ptr + off + i * stride
        first = tl.load(d)
        qlen = tl.load(d + 1)
        base, k, accepted = _accepted(d, rows_ptr, HEAD, KP)
        emitted = tl.load(rows_ptr + base + accepted)
        shift = k - accepted
        tl.store(dev_ptr + o_ids + first, emitted)
        r = tl.arange(0, QP)
        real = r < qlen
        where = first + r
        p = tl.load(dev_ptr + o_pos + where, mask=real, other=0) - shift
        tl.store(dev_ptr + o_pos + where, p, mask=real)
        block = tl.load(dev_ptr + o_bt + i * w + p // bs, mask=real, other=0)
        tl.store(dev_ptr + o_slot + where, block * bs + p % bs, mask=real)
        seq = tl.load(dev_ptr + o_seq + i)
        tl.store(dev_ptr + o_seq + i, seq - shift)
    else:  # (launched only with rows to feed: the fed drafts, which the chained rows never overlap)
        feed_program(dev_ptr, vals_ptr, f_off, m, FB)


def chain_fixup_cuda(dev: torch.Tensor, t: int, b: int, w: int, block_size: int, off: int, n: int, stride: int,
                     head: int, row_tokens: torch.Tensor, max_query_len: int,
                     fed: FedTokens | None = None, fed_at: int = 0) -> None:
    """``head``: descriptor fields before the drafts (``chain.HEAD``); ``fed``: rows fed in the same
    launch (``pack_fed``'s indices at ``fed_at``). (One compiled variant covers every step of
    at most 8 query rows and 8 drafts per request: ``GpuModelRunner.compile_kernels`` compiles it at start.)"""
    o_ids, o_pos, o_slot, o_seq, _, _, o_bt, _ = layout(t, b, w)
    vals, f_off, m = feed_args(dev, fed, fed_at)
    _chain_fixup_kernel[(n + (m > 0),)](dev, row_tokens, vals, o_ids, o_pos, o_slot, o_seq, o_bt, w, block_size,
                                        off, stride, n, f_off, m, HEAD=head,
                                        KP=max(8, triton.next_power_of_2(stride - head)),
                                        QP=max(8, triton.next_power_of_2(max_query_len)),
                                        FB=triton_feed.FEED_BLOCK, num_warps=1)


@triton.jit(do_not_specialize=["vals_ptr", "sel_off", "off", "stride", "n", "f_off", "m"])
def _chain_select_kernel(dev_ptr, rows_ptr, vals_ptr, sel_off, off, stride, n, f_off, m, HEAD: tl.constexpr,
                         KP: tl.constexpr, FB: tl.constexpr):
    i = tl.program_id(0)
    if i < n:
        _, k, accepted = _accepted(dev_ptr + off + i * stride, rows_ptr, HEAD, KP)
        sel = tl.load(dev_ptr + sel_off + i)
        tl.store(dev_ptr + sel_off + i, sel - (k - accepted))
    else:
        feed_program(dev_ptr, vals_ptr, f_off, m, FB)


def chain_select_cuda(dev: torch.Tensor, sel_off: int, off: int, n: int, stride: int, head: int,
                      row_tokens: torch.Tensor, fed: FedTokens | None = None, fed_at: int = 0) -> None:
    """``fed`` as ``chain_fixup_cuda``'s. (One compiled variant for up to 8 drafts per request:
    ``GpuHeadRunner.warm_up`` compiles it.)"""
    vals, f_off, m = feed_args(dev, fed, fed_at)
    _chain_select_kernel[(n + (m > 0),)](dev, row_tokens, vals, sel_off, off, stride, n, f_off, m, HEAD=head,
                                         KP=max(8, triton.next_power_of_2(stride - head)),
                                         FB=triton_feed.FEED_BLOCK, num_warps=1)
