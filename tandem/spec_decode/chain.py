"""Draft chains read back in one host transfer (draft model, EAGLE).

A greedy chain runs step by step on the device; step ``j`` drafts one token for each request in its
``live`` list (those still wanting more). ``collect_chain`` reads every step's ids at once and
appends them to the per-request draft lists in step order.
"""

from __future__ import annotations

import torch


def collect_chain(steps: list[tuple[list[int], torch.Tensor]], drafts: list[list[int]]) -> None:
    """``steps``: per step, (indices of the requests it drafted for, their token ids on the device)."""
    flat = torch.cat([t for _, t in steps]).tolist()
    pos = 0
    for live, _ in steps:
        for i in live:
            drafts[i].append(flat[pos])
            pos += 1
