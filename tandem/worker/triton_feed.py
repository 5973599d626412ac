"""``input_packer.feed_rows`` on CUDA: ids[rows] = values[src] in one Triton program.

The indices sit in the step's input buffer (``pack_fed``: ``src`` then ``rows``), the values on the
device (an EAGLE proposal's drafts, a verify's row argmaxes). Torch's gather and scatter were two
launches per step; the chained fix-ups (``triton_chain.py``) run ``feed_program`` as one more
program of their own launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.worker.batch import FedTokens

FEED_BLOCK = 64  # fed rows per loop iteration of the feeding program


@triton.jit
def feed_program(dev_ptr, vals_ptr, f_off, m, FB: tl.constexpr):
    """ids[rows[j]] = vals[src[j]] for j < m; ``src`` then ``rows`` at ``f_off`` (``pack_fed``; ids first
    in the layout)."""
    for s in range(0, m, FB):
        j = s + tl.arange(0, FB)
        ok = j < m
        src = tl.load(dev_ptr + f_off + j, mask=ok, other=0)
        row = tl.load(dev_ptr + f_off + m + j, mask=ok, other=0)
        tl.store(dev_ptr + row, tl.load(vals_ptr + src, mask=ok, other=0), mask=ok)


def feed_args(dev: torch.Tensor, fed: FedTokens | None, fed_at: int) -> tuple[torch.Tensor, int, int]:
    """A kernel's feed arguments: (values, offset of the indices, count); nothing to feed: (dev, 0, 0)."""
    return (fed.values, fed_at, len(fed.rows)) if fed is not None and fed.rows else (dev, 0, 0)


@triton.jit(do_not_specialize=["vals_ptr", "f_off", "m"])
def _feed_kernel(dev_ptr, vals_ptr, f_off, m, FB: tl.constexpr):
    feed_program(dev_ptr, vals_ptr, f_off, m, FB)


def feed_rows_cuda(dev: torch.Tensor, values: torch.Tensor, f_off: int, m: int) -> None:
    """``input_packer.feed_rows`` in one launch (one compiled variant: ``GpuModelRunner.compile_kernels``)."""
    _feed_kernel[(1,)](dev, values, f_off, m, FB=FEED_BLOCK, num_warps=1)
