"""A whole EAGLE proposal in one CUDA graph (``GpuHeadRunner.forward_proposal``) derives its first
chain step on the device from the first step's selected rows (``_derive_chain``). Here, on the CPU,
that derivation is checked against the packer: for random first steps (padded batches, ragged
query lengths, selected rows moved back by a chained verify's rejections, block tables out of
order) the derived step is byte for byte what ``pack`` writes for one-token chunks at the selected
positions + 1, with the selected drafts as ids and the selected feedback rows as hidden input.
(That the graph drafts what the torch head runner drafts: tests/worker/test_gpu_eagle.py, on CUDA.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem.worker.batch import SeqChunk
from tandem.worker.cuda_graphs import SMALL_BATCH
from tandem.worker.gpu_head_runner import GpuHeadRunner
from tandem.worker.input_packer import layout, pack, padded_rows


def _runner(block_size: int, w: int, hidden: int) -> GpuHeadRunner:
    """The fields ``_derive_chain`` reads (a CUDA runner's constructor needs a device)."""
    r = object.__new__(GpuHeadRunner)
    r.table_width, r.block_size = w, block_size
    r._chain_in = torch.zeros(layout(SMALL_BATCH, SMALL_BATCH, w)[-1], dtype=torch.int64)
    r._hidden_in = torch.zeros(SMALL_BATCH * 8, hidden)
    r._arange = torch.arange(SMALL_BATCH + 1)
    return r


def proposal_case(seed: int) -> tuple[GpuHeadRunner, dict]:
    """A random first step packed as ``_stage(select=True)`` packs it (padded batches, ragged query
    lengths, selected rows moved back by a chained verify's rejections as ``head_chain_fixup`` moves
    them, block tables out of order), in a stub runner's ``_static``; and what the test needs of it."""
    rng = random.Random(seed)
    bs, w, hidden = rng.choice([1, 4, 16]), 12, 8
    b = rng.choice([1, 2, 4, 8])
    n = rng.randint(1, b)
    q = rng.randint(1, 6)
    qlens = [q] + [rng.randint(1, q) for _ in range(n - 1)]
    rng.shuffle(qlens)
    chunks = []
    for ql in qlens:
        blocks = rng.sample(range(500), w)
        start = rng.randint(0, w * bs - ql - 2)
        chunks.append(SeqChunk([rng.randrange(1000) for _ in range(ql)], start, blocks))
    rows = [sum(qlens[:i + 1]) - 1 for i in range(n)]  # each request's last row
    buf = np.zeros(layout(b * q, b, w)[-1] + b, dtype=np.int64)
    pack(bs, buf, chunks, qlens, b, q, w, rows)
    o_end = layout(b * q, b, w)[-1]
    back = [rng.randint(0, ql - 1) for ql in qlens]
    buf[o_end:o_end + n] = [r - k for r, k in zip(padded_rows(qlens, q, rows), back)]
    buf[o_end + n:o_end + b] = 0
    runner = _runner(bs, w, hidden)
    runner._static = torch.from_numpy(buf)
    gen = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 1000, (b * q,), generator=gen)
    fb = torch.randn(b * q, hidden, generator=gen)
    return runner, dict(b=b, n=n, q=q, w=w, bs=bs, chunks=chunks, qlens=qlens, back=back, tok=tok, fb=fb,
                        sel=torch.from_numpy(buf[o_end:o_end + n]))


@pytest.mark.parametrize("seed", range(24))
def test_proposal_graph_derives_the_chain_step_the_packer_packs(seed: int) -> None:
    runner, c = proposal_case(seed)
    b, n, w, bs, tok, fb, sel = c["b"], c["n"], c["w"], c["bs"], c["tok"], c["fb"], c["sel"]
    draft = runner._derive_chain(b, c["q"], tok, fb)

    assert torch.equal(draft[:n], tok[sel])
    assert torch.equal(runner._hidden_in[:n], fb[sel])
    want = np.zeros(layout(b, b, w)[-1], dtype=np.int64)
    at = [ch.start + ql - 1 - k + 1 for ch, ql, k in zip(c["chunks"], c["qlens"], c["back"])]  # selected position + 1
    pack(bs, want, [SeqChunk([int(tok[s])], p, ch.block_ids) for s, p, ch in zip(sel, at, c["chunks"])], [1] * n,
         b, 1, w, None)
    got = runner._chain_in.numpy()
    o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, _ = layout(b, b, w)
    # every section (not the alignment gaps between them); a padding request's id is whatever its row 0
    # drafted (it writes no KV and is never read)
    for off, size in ((o_ids, n), (o_pos, b), (o_slot, b), (o_seq, b), (o_qs, b + 1), (o_ql, b), (o_bt, b * w)):
        assert np.array_equal(got[off:off + size], want[off:off + size]), (off, size)
