"""One input packer: a step's SeqChunks → one int64 buffer of token ids, positions, KV slots and
attention metadata, shared by every runner (the torch runner on CPU and the CUDA runner alike).

Layout of the buffer for T tokens, B requests, block-table width W (padded: T = B·q):
``[ids T | positions T | slots T | seq_lens B | query_start B+1 | query_lens B | tables B·W | rows R]``.
Padding tokens: id 0, position 0, slot -1 (no KV write); padding requests: query length 0, context
0. ``rows`` (optional) are the padded rows whose logits are wanted. Two implementations write the same
bytes: numpy for large steps, plain Python loops for a few short requests (~70 → ~15 µs for one
decode); tests/test_input_packer.py checks they agree.

``pack_fed`` / ``feed_rows``: query rows whose ids are on the device only (``FedTokens``) — their
index lists go after the packed step, and the ids are written on the device after the copy.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, chain

import numpy as np
import torch

from tandem.worker.attn_metadata import AttentionMetadata
from tandem.worker.batch import FedTokens, SeqChunk

# Steps of at most this many requests and tokens are packed by plain Python loops (pack_small).
SMALL_PACK_REQS = 8
SMALL_PACK_TOKENS = 64


ALIGN = 2  # int64 elements: every section starts on a 16-byte boundary


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout(t: int, b: int, w: int) -> tuple[int, int, int, int, int, int, int, int]:
    """Offsets of ids, positions, slots, seq_lens, query_start, query_lens, tables, and the end.
    Every section starts 16-byte aligned, whatever ``t`` and ``b``: Triton specialises a kernel on
    whether each pointer argument is, so unaligned views would make the same kernel compile again
    for steps of another token or request count (a compile while serving)."""
    o_ids, o_pos = 0, _up(t)
    o_slot = o_pos + _up(t)
    o_seq = o_slot + _up(t)
    o_qs = o_seq + _up(b)
    o_ql = o_qs + _up(b + 1)
    o_bt = o_ql + _up(b)
    end = o_bt + _up(b * w)
    return o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end


def _longs(seqs: Sequence[Sequence[int]]) -> np.ndarray:
    return np.frombuffer(array("q", chain.from_iterable(seqs)), dtype=np.int64)


class HostStaging:
    """``count`` pinned int64 buffers used in turn; each waits for its last copy before reuse. A
    runner that queues several steps before the device reaches them (an EAGLE head's k steps,
    launched behind a verify still computing) needs more than two: with two, packing its third
    step waited for its first step's copy, i.e. for the verify ahead of it."""

    def __init__(self, device: torch.device, count: int = 2) -> None:
        self.device = device
        self.pin = device.type == "cuda"
        self.bufs: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * count
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.i = 0

    def acquire(self, n: int) -> tuple[int, np.ndarray]:
        self.i = (self.i + 1) % len(self.bufs)
        i = self.i
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
        if self.bufs[i].numel() < n:
            self.bufs[i] = torch.empty(max(n, 2 * self.bufs[i].numel(), 4096), dtype=torch.int64,
                                       pin_memory=self.pin)
        return i, self.bufs[i].numpy()

    def send(self, i: int, n: int, dst: torch.Tensor) -> None:
        dst[:n].copy_(self.bufs[i][:n], non_blocking=self.pin)
        if self.pin:
            ev = self.events[i] or torch.cuda.Event()
            if self.device.index in (None, torch.cuda.current_device()):
                ev.record()  # the current stream of the current device: the copy's (cheaper lookup)
            else:
                ev.record(torch.cuda.current_stream(self.device))
            self.events[i] = ev


def pack(block_size: int, buf: np.ndarray, chunks: Sequence[SeqChunk], qlens: list[int], b: int,
          q_pad: int | None, w: int, rows: Sequence[int] | None) -> tuple[int, int, int, bool]:
    """Fill buf; return (length incl. rows, T, rows offset, rows are the identity)."""
    if 0 < len(chunks) <= SMALL_PACK_REQS and sum(qlens) <= SMALL_PACK_TOKENS:
        return pack_small(block_size, buf, chunks, qlens, b, q_pad, w, rows)
    return pack_numpy(block_size, buf, chunks, qlens, b, q_pad, w, rows)

def pack_numpy(block_size: int, buf: np.ndarray, chunks: Sequence[SeqChunk], qlens: list[int], b: int,
                q_pad: int | None, w: int, rows: Sequence[int] | None) -> tuple[int, int, int, bool]:
    n = len(chunks)
    bs = block_size
    ql = np.asarray(qlens, dtype=np.int64)
    total = int(ql.sum()) if n else 0
    if q_pad is not None:
        t = b * q_pad
        qstart = np.arange(b + 1, dtype=np.int64) * q_pad
    else:
        t = total
        qstart = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(ql, out=qstart[1:n + 1])
    o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end = layout(t, b, w)
    buf[o_ids:o_slot] = 0  # ids and positions of padding
    buf[o_slot:o_seq] = -1  # padding tokens write no KV
    buf[o_seq:end] = 0
    buf[o_qs:o_qs + b + 1] = qstart
    r_off = end
    if n == 0:
        return end, t, r_off, False
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
    nb = np.fromiter((len(c.block_ids) for c in chunks), dtype=np.int64, count=n)
    ends = starts + ql
    if (ends > nb * bs).any():
        i = int(np.argmax(ends > nb * bs))
        raise RuntimeError(f"sequence of {int(ends[i])} tokens exceeds its {int(nb[i])} KV blocks")
    table = buf[o_bt:o_bt + b * w].reshape(b, w)
    nbt = int(nb.sum())
    if nbt:
        cum_b = np.zeros(n, dtype=np.int64)
        np.cumsum(nb[:-1], out=cum_b[1:])
        table[np.repeat(np.arange(n), nb), np.arange(nbt) - np.repeat(cum_b, nb)] = _longs(
            [c.block_ids for c in chunks])
    tok_req = np.repeat(np.arange(n), ql)
    cum_q = np.zeros(n, dtype=np.int64)
    np.cumsum(ql[:-1], out=cum_q[1:])
    within = np.arange(total) - np.repeat(cum_q, ql)
    trow = qstart[tok_req] + within  # padded row of each real token
    pos = starts[tok_req] + within
    buf[o_ids + trow] = _longs([c.token_ids for c in chunks])
    buf[o_pos + trow] = pos
    buf[o_slot + trow] = table[tok_req, pos // bs] * bs + pos % bs
    buf[o_seq:o_seq + n] = ends
    buf[o_ql:o_ql + n] = ql
    if rows is None:
        return end, t, r_off, True
    r = np.fromiter(rows, dtype=np.int64)
    prow = trow[r] if len(r) else r
    identity = len(prow) == t and bool((prow == np.arange(t)).all())
    if not identity:
        buf[r_off:r_off + len(prow)] = prow
        return r_off + len(prow), t, r_off, False
    return r_off, t, r_off, True

def pack_small(block_size: int, buf: np.ndarray, chunks: Sequence[SeqChunk], qlens: list[int], b: int,
                q_pad: int | None, w: int, rows: Sequence[int] | None) -> tuple[int, int, int, bool]:
    """``pack`` for a few short requests (decode / verify steps at small batch) with plain Python
    loops: the same bytes, without numpy's per-call overhead (~70 → ~15 µs for one decode)."""
    bs = block_size
    if q_pad is not None:
        t = b * q_pad
        qstart = [i * q_pad for i in range(b + 1)]
    else:
        t = sum(qlens)
        qstart = [0] * (b + 1)
        for i, q in enumerate(qlens):
            qstart[i + 1] = qstart[i] + q
    o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end = layout(t, b, w)
    buf[o_ids:o_slot] = 0
    buf[o_slot:o_seq] = -1
    buf[o_seq:end] = 0
    buf[o_qs:o_qs + b + 1] = qstart
    trows: list[int] = []
    for i, (c, q) in enumerate(zip(chunks, qlens)):
        blocks = c.block_ids
        stop = c.start + q
        if stop > len(blocks) * bs:
            raise RuntimeError(f"sequence of {stop} tokens exceeds its {len(blocks)} KV blocks")
        if blocks:
            buf[o_bt + i * w:o_bt + i * w + len(blocks)] = blocks
        row = qstart[i]
        for j, tok in enumerate(c.token_ids):
            pos = c.start + j
            buf[o_ids + row] = tok
            buf[o_pos + row] = pos
            buf[o_slot + row] = blocks[pos // bs] * bs + pos % bs
            trows.append(row)
            row += 1
        buf[o_seq + i] = stop
        buf[o_ql + i] = q
    if rows is None:
        return end, t, end, True
    prow = [trows[r] for r in rows]
    if len(prow) == t and prow == list(range(t)):
        return end, t, end, True
    buf[end:end + len(prow)] = prow
    return end + len(prow), t, end, False


def locate(qlens: Sequence[int], flat_rows: Sequence[int]) -> list[tuple[int, int]]:
    """(chunk, index within its query) of each flat query row."""
    starts = list(accumulate(qlens, initial=0))
    return [(i, f - starts[i]) for f in flat_rows for i in (bisect_right(starts, f) - 1,)]


def padded_rows(qlens: Sequence[int], q: int, flat_rows: Sequence[int]) -> list[int]:
    """Rows in the padded layout (request i's tokens at i·q, i·q + 1, ...) of flat query rows."""
    return [i * q + j for i, j in locate(qlens, flat_rows)]


def step_tensors(buf: torch.Tensor, t: int, b: int, w: int, block_size: int, max_query_len: int,
                 num_kv_splits: int = 1) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids [T], positions [T] and the attention metadata, as views of a packed buffer (host or
    device) laid out by ``layout(t, b, w)``."""
    o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end = layout(t, b, w)
    meta = AttentionMetadata(
        num_tokens=t, block_size=block_size, slot_mapping=buf[o_slot:o_slot + t],
        block_tables=buf[o_bt:o_bt + b * w].view(b, w), seq_lens=buf[o_seq:o_seq + b],
        query_start=buf[o_qs:o_qs + b + 1], query_lens=buf[o_ql:o_ql + b], max_query_len=max_query_len,
        num_kv_splits=num_kv_splits,
    )
    return buf[o_ids:o_ids + t], buf[o_pos:o_pos + t], meta


def advance_one(buf: torch.Tensor, b: int, w: int, block_size: int) -> None:
    """In place, a packed step of one query row per request (``layout(b, b, w)``) becomes the step at
    the next position: each real request (query length 1) one position further, its context one
    longer, its KV slot looked up in its block table; padding requests (query length 0) unchanged.
    Torch ops only, so a CUDA graph can hold it (an EAGLE head's chain steps in one graph:
    ``GpuHeadRunner.forward_chain``); the ids are the caller's."""
    _, o_pos, o_slot, o_seq, _, o_ql, o_bt, _ = layout(b, b, w)
    real = buf[o_ql:o_ql + b]
    pos = buf[o_pos:o_pos + b]
    pos.add_(real)
    buf[o_seq:o_seq + b].add_(real)
    col = torch.div(pos, block_size, rounding_mode="floor").clamp_(max=w - 1)
    block = buf[o_bt:o_bt + b * w].view(b, w).gather(1, col.unsqueeze(1)).squeeze(1)
    slot = buf[o_slot:o_slot + b]
    slot.copy_(torch.where(real > 0, block * block_size + pos % block_size, slot))


def pack_fed(buf: np.ndarray, length: int, fed: FedTokens | None, rows: Sequence[int]) -> int:
    """Append the fed tokens' source indices and (buffer) rows after a packed step; the new end."""
    if fed is None:
        return length
    m = len(rows)
    buf[length:length + m] = fed.src
    buf[length + m:length + 2 * m] = rows
    return length + 2 * m


def feed_rows(dev: torch.Tensor, t: int, length: int, fed: FedTokens | None) -> None:
    """On the device: ids[rows] = values[src], both index lists sent with the step's inputs (at
    ``length``: ``pack_fed``). On CUDA one launch (``triton_feed.py``)."""
    if fed is None or not fed.rows:
        return
    m = len(fed.rows)
    if dev.is_cuda:
        from tandem.worker.triton_feed import feed_rows_cuda

        feed_rows_cuda(dev, fed.values, length, m)
        return
    dev[:t].index_copy_(0, dev[length + m:length + 2 * m], fed.values.index_select(0, dev[length:length + m]))
