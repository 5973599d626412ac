"""The input packer (worker/input_packer.py), on CPU: the plain-Python path for small steps writes
exactly what the numpy path writes (every layout: padded buckets, eager, logits-row selection); a
packed one-row step advanced on the device (``advance_one``) is the next position's packed step."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tandem.worker.batch import SeqChunk
from tandem.worker.input_packer import advance_one, layout, pack_numpy, pack_small


@pytest.mark.parametrize("seed", range(40))
def test_small_pack_equals_numpy_pack(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    n = rng.randint(1, 8)
    padded = rng.random() < 0.5
    chunks, qlens = [], []
    for _ in range(n):
        q = rng.randint(1, 8 if padded else 6)
        start = rng.randint(0, 60)
        blocks = rng.sample(range(1000), -(-(start + q) // bs) + rng.randint(0, 2))
        chunks.append(SeqChunk([rng.randrange(50000) for _ in range(q)], start, blocks))
        qlens.append(q)
    w = max(len(c.block_ids) for c in chunks) + 1
    b = n + (rng.randint(0, 3) if padded else 0)
    q_pad = max(qlens) if padded else None
    total = sum(qlens)
    kind = rng.choice(["none", "all", "last", "subset"])
    rows = {"none": None, "all": list(range(total)), "last": [total - 1],
            "subset": sorted(rng.sample(range(total), rng.randint(1, total)))}[kind]
    a = np.full(4096, 7, dtype=np.int64)
    c = a.copy()
    got = pack_small(bs, a, chunks, qlens, b, q_pad, w, rows)
    want = pack_numpy(bs, c, chunks, qlens, b, q_pad, w, rows)
    assert got == want
    assert np.array_equal(a[: got[0]], c[: want[0]])


def test_small_pack_rejects_overflowing_block_table() -> None:
    buf = np.zeros(1024, dtype=np.int64)
    with pytest.raises(RuntimeError, match="exceeds its 1 KV blocks"):
        pack_small(16, buf, [SeqChunk([1, 2], 15, [3])], [2], 1, 2, 4, [1])


def test_flat_rows_located_in_their_chunks_and_padded_layout() -> None:
    from tandem.worker.input_packer import locate, padded_rows

    qlens = [3, 1, 4]
    assert locate(qlens, [0, 2, 3, 4, 7]) == [(0, 0), (0, 2), (1, 0), (2, 0), (2, 3)]
    assert padded_rows(qlens, 4, [0, 2, 3, 4, 7]) == [0, 2, 4, 8, 11]


@pytest.mark.parametrize("seed", range(20))
def test_advanced_one_row_step_is_the_next_positions_step(seed: int) -> None:
    """A chain of one-row steps (an EAGLE head's drafts 2..k): advancing a packed step j times on the
    device gives, past the ids, exactly what packing the step j positions on gives — across block
    boundaries, with padding requests (bucket > requests) left as padding."""
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    n = rng.randint(1, 6)
    b = n + rng.randint(0, 3)
    steps = rng.randint(1, 5)
    starts = [rng.randint(0, 40) for _ in range(n)]
    blocks = [rng.sample(range(1000), -(-(s + steps + 1) // bs)) for s in starts]
    w = max(len(x) for x in blocks) + 1
    size = layout(b, b, w)[-1]

    def packed(j: int) -> torch.Tensor:
        buf = np.zeros(size, dtype=np.int64)
        pack_small(bs, buf, [SeqChunk([0], s + j, x) for s, x in zip(starts, blocks)], [1] * n, b, 1, w, None)
        return torch.from_numpy(buf)

    dev = packed(0)
    for j in range(1, steps + 1):
        advance_one(dev, b, w, bs)
        assert torch.equal(dev[b:], packed(j)[b:]), j  # (the ids, dev[:b], are the caller's)
