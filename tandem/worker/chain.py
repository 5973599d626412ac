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

``chain_select`` serves an EAGLE head's first step chained on a verify (spec_decode/eagle.py): from
the same descriptors it moves each chunk's selected output row back by the rejected count.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tandem.worker.batch import ChainedFrom, FedTokens, HeadChain
from tandem.worker.input_packer import feed_rows, layout

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


def _accepted(dev: torch.Tensor, off: int, n: int, stride: int, row_tokens: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(torch) Per chunk: its descriptor, its verify rows' tokens (k + 1, padded) and accepted count."""
    desc = dev[off:off + n * stride].view(n, stride)
    base, k = desc[:, 2], desc[:, 3]
    width = stride - HEAD
    j = torch.arange(width + 1, device=dev.device)
    rows = row_tokens.index_select(0, (base.unsqueeze(1) + torch.minimum(j, k.unsqueeze(1))).reshape(-1)).view(n, -1)
    match = (rows[:, :width] == desc[:, HEAD:]) & (j[:width] < k.unsqueeze(1))
    return desc, rows, match.long().cumprod(1).sum(1)


def chain_fixup(dev: torch.Tensor, t: int, b: int, w: int, block_size: int, off: int, n: int, stride: int,
                row_tokens: torch.Tensor, max_query_len: int, fed: FedTokens | None = None, fed_at: int = 0) -> None:
    """On the device: the chained step's first ids, positions, KV slots and context lengths, from
    the descriptors ``pack_chain`` wrote at ``off`` (``n`` chunks of ``stride``) and the verify's
    ``row_tokens``; and its ``fed`` rows (``feed_rows``, indices at ``fed_at``), in the same launch
    on CUDA (they never overlap a chunk's first row)."""
    if dev.is_cuda:
        from tandem.worker.triton_chain import chain_fixup_cuda

        chain_fixup_cuda(dev, t, b, w, block_size, off, n, stride, HEAD, row_tokens, max_query_len, fed, fed_at)
        return
    feed_rows(dev, t, fed_at, fed)
    o_ids, o_pos, o_slot, o_seq, _, _, o_bt, _ = layout(t, b, w)
    desc, rows, accepted = _accepted(dev, off, n, stride, row_tokens)
    first, qlen, k = desc[:, 0], desc[:, 1], desc[:, 3]
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


def chain_select(dev: torch.Tensor, sel_off: int, off: int, n: int, stride: int, row_tokens: torch.Tensor,
                 t: int = 0, fed: FedTokens | None = None, fed_at: int = 0) -> None:
    """On the device: ``dev[sel_off + i] -= k_i - accepted_i`` for the ``n`` chunks described at
    ``off`` (``pack_chain``): a selected output row moves back by its request's rejected count; and
    a step of ``t`` rows' ``fed`` rows as ``chain_fixup`` feeds them."""
    if dev.is_cuda:
        from tandem.worker.triton_chain import chain_select_cuda

        chain_select_cuda(dev, sel_off, off, n, stride, HEAD, row_tokens, fed, fed_at)
        return
    feed_rows(dev, t, fed_at, fed)
    desc, _, accepted = _accepted(dev, off, n, stride, row_tokens)
    dev[sel_off:sel_off + n].sub_(desc[:, 3] - accepted)


def verify_rows_fed(chain: HeadChain, qlens: Sequence[int]) -> FedTokens | None:
    """A chained catch-up's fed rows (``HeadChain``): chunk i's last k_i + 1 flat query rows take
    its verify rows' argmaxes."""
    if not chain.catch_up:
        return None
    src: list[int] = []
    rows: list[int] = []
    end = 0
    for q, off, d in zip(qlens, chain.verify.offsets, chain.verify.drafts):
        end += q
        src.extend(range(off, off + len(d) + 1))
        rows.extend(range(end - len(d) - 1, end))
    return FedTokens(chain.verify.row_tokens, tuple(src), tuple(rows))


def head_chain_room(chain: HeadChain | None, fed: FedTokens | None, n: int) -> int:
    """Input buffer room after a packed head step for its fed indices and descriptors."""
    return (2 * len(fed.rows) if fed is not None else 0) + (n * chain_width(chain.verify) if chain else 0)


def head_chain_fixup(dev: torch.Tensor, chain: HeadChain, fed: FedTokens | None, t: int, b: int, w: int,
                     block_size: int, length: int, c_off: int, sel: int | None, max_query_len: int) -> None:
    """On the device, a head step chained on a verify (``HeadChain``), after its input copy: a
    catch-up's fed rows and its selected rows (at ``sel``; None: every row, so none moves) moved
    back; a chain step's rows moved back. ``length``: where ``pack_fed`` put the fed indices;
    ``c_off``: where ``pack_chain`` put the descriptors."""
    n, stride, rows = len(chain.verify.offsets), chain_width(chain.verify), chain.verify.row_tokens
    if chain.catch_up:
        if sel is not None:
            chain_select(dev, sel, c_off, n, stride, rows, t, fed, length)
        else:
            feed_rows(dev, t, length, fed)
    else:
        chain_fixup(dev, t, b, w, block_size, c_off, n, stride, rows, max_query_len)
