"""A step chained on a launched verify: its inputs fixed on the device once that verify is known there.

A chained step (engine/async_decode.py) is scheduled and packed while the verify before it is still
on the device, as if that verify accepted every draft, with a placeholder for each request's first
token. ``ChainedFrom`` says where that verify's row argmaxes are and which drafts they checked;
``chain_fixup`` then, on the device and without a host read, per request: counts the accepted drafts
(``accept_matching``: while a draft equals its row's argmax), writes the emitted token (the argmax
after them) as the chunk's first id, and moves its query rows back by the rejected count —
positions, KV slots (looked up again in the block table, which covers the packed positions and so the
shifted ones) and context length. Padding rows are not touched.

Per chunk, ``pack_chain`` appends a descriptor to the step's one input copy:
``[first row, query length, offset of its rows in the verify, k, drafts (k_max, padded)]``. On CUDA
one Triton program per request does the rest (``triton_chain.py``: one launch); elsewhere torch ops
do the same (the CPU tests' reference).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.worker.batch import ChainedFrom
from tandem.worker.input_packer import layout

HEAD = 4  # descriptor fields before the drafts


def chain_width(chain: ChainedFrom) -> int:
    """Descriptor length per chunk."""
    return HEAD + max(1, max((len(d) for d in chain.drafts), default=1))


def pack_chain(buf: np.ndarray, end: int, chain: ChainedFrom, qlens: Sequence[int], q_pad: int | None
               ) -> tuple[int, int]:
    """Append the chunks' descriptors after a packed step: (new end, their offset)."""
    stride = chain_width(chain)
    n = len(qlens)
    desc = buf[end:end + n * stride].reshape(n, stride)
    desc[:] = -1  # (past k: never a token id)
    start = 0
    for i, (q, off, d) in enumerate(zip(qlens, chain.offsets, chain.drafts)):
        desc[i, 0] = i * q_pad if q_pad is not None else start
        desc[i, 1] = q
        desc[i, 2] = off
        desc[i, 3] = len(d)
        desc[i, HEAD:HEAD + len(d)] = d
        start += q
    return end + n * stride, end


def chain_fixup(dev: torch.Tensor, t: int, b: int, w: int, block_size: int, off: int, n: int, stride: int,
                row_tokens: torch.Tensor, max_query_len: int) -> None:
    """On the device: the chained step's first ids, positions, KV slots and context lengths, from
    the descriptors ``pack_chain`` wrote at ``off`` (``n`` chunks of ``stride``) and the verify's
    ``row_tokens``."""
    if dev.is_cuda:
        from tandem.worker.triton_chain import chain_fixup_cuda

        chain_fixup_cuda(dev, t, b, w, block_size, off, n, stride, HEAD, row_tokens, max_query_len)
        return
    o_ids, o_pos, o_slot, o_seq, _, _, o_bt, _ = layout(t, b, w)
    desc = dev[off:off + n * stride].view(n, stride)
    first, qlen, base, k = desc[:, 0], desc[:, 1], desc[:, 2], desc[:, 3]
    width = stride - HEAD
    j = torch.arange(width + 1, device=dev.device)
    rows = row_tokens.index_select(0, (base.unsqueeze(1) + torch.minimum(j, k.unsqueeze(1))).reshape(-1)).view(n, -1)
    match = (rows[:, :width] == desc[:, HEAD:]) & (j[:width] < k.unsqueeze(1))
    accepted = match.long().cumprod(1).sum(1)
    shift = k - accepted
    dev[o_ids:o_ids + t].index_copy_(0, first, rows.gather(1, accepted.unsqueeze(1)).squeeze(1))
    q = int(qlen.max())
    r = torch.arange(q, device=dev.device)
    real = r.unsqueeze(0) < qlen.unsqueeze(1)  # [n, q]
    owner = torch.arange(n, device=dev.device).unsqueeze(1).expand(n, q)[real]
    where = (first.unsqueeze(1) + r)[real]
    pos = dev[o_pos:o_pos + t]
    p = pos.index_select(0, where) - shift.index_select(0, owner)
    pos.index_copy_(0, where, p)
    table = dev[o_bt:o_bt + b * w].view(b, w)
    blocks = table[owner, torch.div(p, block_size, rounding_mode="floor")]
    dev[o_slot:o_slot + t].index_copy_(0, where, blocks * block_size + p.remainder(block_size))
    dev[o_seq:o_seq + n].sub_(shift)
