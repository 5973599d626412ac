"""Test configuration: GPU-only tests skip cleanly on machines without CUDA; CPU tests use one
intra-op thread.

One thread: on the 2-core CI machine the suite runs server subprocesses beside the test process, and
two OpenMP pools contending for two cores made steps 10x slower (measured: engine + speculation +
prefix-cache tests 7 min with 2 threads under contention, 43 s with 1). Speed is measured in
benchmarks/, not here. Subprocesses inherit OMP_NUM_THREADS.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
