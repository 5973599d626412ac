"""Draft chains: read back in one host transfer (draft model, EAGLE), or left on the device (EAGLE).

A greedy chain runs step by step on the device; step ``j`` drafts one token for each request in its
``live`` list (those still wanting more). ``flatten_chain`` gives every step's ids as one flat
device tensor and each request's positions in it (step order); ``collect_chain`` reads it at once
and appends the ids to the per-request draft lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Chain = Sequence[tuple[list[int], torch.Tensor]]  # per step: (indices of the requests it drafted for, their ids)


def flatten_chain(steps: Chain, num_requests: int) -> tuple[torch.Tensor, list[list[int]]]:
    """The chain's ids flat on the device, and per request index the positions of its drafts."""
    where: list[list[int]] = [[] for _ in range(num_requests)]
    pos = 0
    for live, _ in steps:
        for i in live:
            where[i].append(pos)
            pos += 1
    return torch.cat([t for _, t in steps]), where


def collect_chain(steps: Chain, drafts: list[list[int]]) -> None:
    """Append each request's drafts (one host read)."""
    ids, where = flatten_chain(steps, len(drafts))
    flat = ids.tolist()
    for d, pos in zip(drafts, where):
        d.extend(flat[p] for p in pos)
