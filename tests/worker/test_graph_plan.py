"""What the CUDA runner captures at start and how a step picks its graph, and the packed layout's
alignment (CPU: no graph is captured here)."""

from __future__ import annotations

import pytest
import torch

from tandem.worker.cuda_graphs import BATCH_BUCKETS, GraphCache, warm_up_plan
from tandem.worker.input_packer import layout


def test_warm_up_plan_covers_every_bucket_up_to_max_num_seqs():
    assert warm_up_plan(256, 256, 5) == [([1, 2, 4, 8], [1, 2, 3, 4, 5]),
                                         ([b for b in BATCH_BUCKETS if b > 8], [1, 5])]
    assert warm_up_plan(3, 256, 1) == [([1, 2, 4], [1])]
    assert warm_up_plan(40, 256, 4)[1] == ([12, 16, 24, 32, 40], [1, 4])
    assert warm_up_plan(1000, 64, 1)[1][0][-1] == 64  # capped by the largest graph batch


def test_every_step_shape_fits_a_planned_graph_and_the_fit_is_memoised():
    cache = GraphCache(torch.device("cpu"))
    for sizes, qs in warm_up_plan(64, 256, 4):
        for b in sizes:
            for q in qs:
                cache.graphs[(b, q)] = None  # type: ignore[assignment]
    for b in (1, 3, 9, 17, 50, 64):
        for q in (1, 2, 3, 4):
            fit = cache.best_fit(b, q)
            assert fit is not None and fit[0] >= b and fit[1] >= q
    assert cache.best_fit(17, 2) == (24, 4) and cache.best_fit(3, 2) == (4, 2)
    cache.graphs[(24, 2)] = None  # type: ignore[assignment]
    assert cache.best_fit(17, 2) == (24, 4)  # memoised until the next capture clears it
    cache._fits.clear()
    assert cache.best_fit(17, 2) == (24, 2)
    assert cache.best_fit(65, 1) is None


@pytest.mark.parametrize("t,b,w", [(1, 1, 3), (7, 3, 5), (13, 5, 1), (64, 7, 9)])
def test_packed_sections_start_16_byte_aligned(t, b, w):
    offs = layout(t, b, w)
    assert all(o % 2 == 0 for o in offs)  # int64 elements: 16 bytes
    o_ids, o_pos, o_slot, o_seq, o_qs, o_ql, o_bt, end = offs
    assert (o_pos - o_ids >= t and o_slot - o_pos >= t and o_seq - o_slot >= t and o_qs - o_seq >= b
            and o_ql - o_qs >= b + 1 and o_bt - o_ql >= b and end - o_bt >= b * w)
