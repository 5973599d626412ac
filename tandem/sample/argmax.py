"""The greedy token of each row of a logits matrix: one function for every greedy path.

Plain decode (synchronous and asynchronous), greedy drafting and greedy verification all pick
``argmax`` over the vocabulary, lowest id on ties. On CUDA a two-pass Triton kernel does it
(``worker/triton_argmax.py``: torch's single-block reduction over a 128k-entry row takes ~36 µs on an
H200); elsewhere ``torch.argmax``. Both return the same ids for rows without NaN.
"""

from __future__ import annotations

import torch


def greedy_ids(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` for [rows, vocab] logits, on the logits' device (int64)."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1:
        from tandem.worker.triton_argmax import argmax_rows

        return argmax_rows(logits)
    return logits.argmax(dim=-1)


__all__ = ["greedy_ids"]
