"""A chained step's inputs fixed on the device (worker/chain.py), on CPU tensors: packed before the
verify it follows was read (as if every draft were accepted, first token a placeholder), then fixed
from that verify's row argmaxes, it holds exactly the bytes of the step packed where the verify's
outcome puts it (ids, positions, KV slots, context lengths; padding untouched), in the padded and the
eager layout."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem.sample.rejection import accept_matching
from tandem.worker.batch import ChainedFrom, SeqChunk
from tandem.worker.chain import chain_fixup, chain_width, pack_chain
from tandem.worker.input_packer import layout, pack


def _case(seed: int):
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    n = rng.randint(1, 6)
    drafts = [[rng.randrange(3) for _ in range(rng.randint(0, 7))] for _ in range(n)]
    rows = [rng.randrange(3) for d in drafts for _ in range(len(d) + 1)]  # a small vocabulary: matches happen
    offsets = [sum(len(d) + 1 for d in drafts[:i]) for i in range(n)]
    outcome = accept_matching(rows, drafts)
    real, assumed, qlens = [], [], []
    for d, toks, a in zip(drafts, outcome.token_ids, outcome.num_accepted):
        q = rng.randint(1, 8)
        start = rng.randint(0, 60)
        blocks = rng.sample(range(1000), -(-(start + len(d) - a + q) // bs))  # allocated for the assumed positions
        tail = [rng.randrange(50000) for _ in range(q - 1)]
        real.append(SeqChunk([toks[-1], *tail], start, blocks))
        assumed.append(SeqChunk([0, *tail], start + len(d) - a, blocks))
        qlens.append(q)
    chain = ChainedFrom(torch.tensor(rows), tuple(offsets), tuple(tuple(d) for d in drafts))
    return bs, n, real, assumed, qlens, chain, rng


@pytest.mark.parametrize("seed", range(40))
def test_chained_step_equals_the_step_packed_where_it_lands(seed: int) -> None:
    bs, n, real, assumed, qlens, chain, rng = _case(seed)
    w = max(len(c.block_ids) for c in real)
    b = n + rng.randint(0, 3)
    q_pad = max(qlens) if rng.random() < 0.5 else None
    if q_pad is None:
        b = n
    want = np.zeros(8192, dtype=np.int64)
    end, t, _, _ = pack(bs, want, real, qlens, b, q_pad, w, None)
    got = np.zeros(8192, dtype=np.int64)
    length, _, _, _ = pack(bs, got, assumed, qlens, b, q_pad, w, None)
    stop, off = pack_chain(got, length, chain, qlens, q_pad)
    assert stop == length + n * chain_width(chain) and end == layout(t, b, w)[-1]
    chain_fixup(torch.from_numpy(got), t, b, w, bs, off, n, chain_width(chain), chain.row_tokens, max(qlens))
    assert np.array_equal(got[:end], want[:end])


@pytest.mark.parametrize("seed", range(20))
def test_chain_select_moves_each_selected_row_back_by_its_rejected_count(seed: int) -> None:
    """An EAGLE head's chained catch-up (spec_decode/eagle.py) selects each chunk's last row as if
    the verify accepted everything; ``chain_select`` moves it back by what the verify rejected."""
    from tandem.worker.chain import chain_select

    _, n, _, _, _, chain, rng = _case(seed)
    buf = np.zeros(256, dtype=np.int64)
    end, off = pack_chain(buf, 0, chain, [1] * n, None)
    sel = [rng.randrange(100, 200) for _ in range(n)]
    buf[end:end + n] = sel
    dev = torch.from_numpy(buf)
    chain_select(dev, end, off, n, chain_width(chain), chain.row_tokens)
    rows = chain.row_tokens.tolist()
    for i, (o, d) in enumerate(zip(chain.offsets, chain.drafts)):
        accepted = accept_matching(rows[o:o + len(d) + 1], [list(d)]).num_accepted[0]
        assert int(dev[end + i]) == sel[i] - (len(d) - accepted)
