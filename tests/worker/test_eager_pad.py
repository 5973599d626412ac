"""The CUDA head runner's eager steps from the features (a catch-up over positions the head idled
through, its first step after a prompt) pad every request to a power of two, so their matmul shapes
repeat and the ones up to ``EAGER_WARM_Q`` rows ran at start: cuBLAS's first call of a new row count
had cost a catch-up 2.6-9.8 ms of host time on the H100 (docs/performance.md §51). (That the padded
step drafts what the torch head runner drafts: tests/worker/test_gpu_eagle.py, on CUDA.)"""

from __future__ import annotations

from tandem.worker.cuda_kernels import MAX_ROWS
from tandem.worker.gpu_head_runner import EAGER_WARM_Q, eager_pad


def test_eager_steps_from_the_features_pad_to_few_shapes():
    assert eager_pad([MAX_ROWS]) is None and eager_pad([3, MAX_ROWS]) is None  # skinny kernels: any row count
    assert eager_pad([MAX_ROWS + 1]) == 2 * MAX_ROWS
    shapes = {eager_pad([q]) for q in range(MAX_ROWS + 1, EAGER_WARM_Q + 1)}
    # every padded shape up to EAGER_WARM_Q is one of the few that warm-up runs
    assert shapes == {1 << i for i in range(MAX_ROWS.bit_length(), EAGER_WARM_Q.bit_length())}
    assert eager_pad([129, 5]) == 256 and eager_pad([512]) == 512 and eager_pad([513]) == 1024
