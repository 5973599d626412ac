"""The EAGLE-3 draft vocabulary: the ``N`` target ids seen most often in the generated tokens.

``kept`` is sorted ascending; ``d2t = kept - arange(N)`` (the offset map the loaders read: target id
= draft id + d2t[draft id]) and ``t2d`` is the boolean mask of kept target ids. Ties in frequency
go to the lower id; ids never generated fill the remainder (lowest first) when fewer than ``N``
distinct ids occur. ``coverage`` is the share of generated tokens the draft vocabulary can express.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    kept: torch.Tensor  # [N] int64, sorted target ids
    target_vocab_size: int
    coverage: float

    @property
    def size(self) -> int:
        return int(self.kept.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.kept - torch.arange(self.size, device=self.kept.device)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool, device=self.kept.device)
        mask[self.kept] = True
        return mask


def _counts(generated: list[torch.Tensor], target_vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(target_vocab_size, dtype=torch.float64)
    for g in generated:
        counts += torch.bincount(g.long(), minlength=target_vocab_size).to(torch.float64)
    return counts


def _covering(kept: torch.Tensor, counts: torch.Tensor) -> DraftVocab:
    total = float(counts.sum())
    return DraftVocab(kept, counts.numel(), float(counts[kept].sum()) / total if total else 0.0)


def build_draft_vocab(generated: list[torch.Tensor], target_vocab_size: int, size: int) -> DraftVocab:
    """Top-``size`` most frequent ids of ``generated`` (the loss-masked tokens)."""
    size = min(size, target_vocab_size)
    counts = _counts(generated, target_vocab_size)
    # stable sort on -count: equal counts keep ascending id order
    order = torch.sort(-counts, stable=True).indices
    return _covering(torch.sort(order[:size]).values, counts)


def given_vocab(kept: torch.Tensor, generated: list[torch.Tensor], target_vocab_size: int) -> DraftVocab:
    """The draft vocabulary of an existing head (its draft ids' target ids, in draft-id order), with
    its coverage of ``generated``."""
    return _covering(kept.long().cpu(), _counts(generated, target_vocab_size))


def full_vocab(target_vocab_size: int) -> DraftVocab:
    """The identity map (EAGLE-1 heads predict the full vocabulary)."""
    return DraftVocab(torch.arange(target_vocab_size), target_vocab_size, 1.0)
