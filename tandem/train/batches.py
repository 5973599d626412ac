"""Padded batches of whole sequences, about ``batch_tokens`` padded tokens each.

Sequences are sorted by length and cut into consecutive groups (little padding); the group order
is shuffled per epoch with ``seed + epoch``, so epoch ``e`` always visits the same batches in the
same order (what makes a resumed run continue exactly where the stopped one was). Sequences longer
than ``batch_tokens`` are truncated to it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tandem.train.data import Sequence


@dataclass(frozen=True)
class Batch:
    ids: torch.Tensor  # [B, L] int64, right-padded with 0
    lengths: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.ids.shape[0]), int(self.ids.shape[1])

    def to(self, device: torch.device) -> Batch:
        return Batch(self.ids.to(device, non_blocking=True), self.lengths.to(device), self.prompt_lens.to(device))


def make_batch(seqs: list[Sequence], max_len: int) -> Batch:
    n = min(max_len, max(len(s.tokens) for s in seqs))
    ids = torch.zeros(len(seqs), n, dtype=torch.long)
    lengths = torch.zeros(len(seqs), dtype=torch.long)
    for i, s in enumerate(seqs):
        t = s.tokens[:n]
        ids[i, :len(t)] = t
        lengths[i] = len(t)
    prompt_lens = torch.tensor([min(s.prompt_len, n) for s in seqs], dtype=torch.long)
    return Batch(ids, lengths, prompt_lens)


def group_by_length(seqs: list[Sequence], batch_tokens: int) -> list[list[int]]:
    """Indices of ``seqs`` in groups whose padded size (count × longest) stays ≤ ``batch_tokens``."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i].tokens), i))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        n = min(len(seqs[i].tokens), batch_tokens)
        if cur and (len(cur) + 1) * n > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    return groups


def epoch_batches(seqs: list[Sequence], batch_tokens: int, seed: int, epoch: int) -> list[list[int]]:
    groups = group_by_length(seqs, batch_tokens)
    random.Random(seed * 7919 + epoch).shuffle(groups)
    return groups
