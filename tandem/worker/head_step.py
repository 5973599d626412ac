"""HeadStep: what one EAGLE head step returns (both head runners)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadStep:
    token_ids: torch.Tensor  # [R] int64 target ids: the greedy draft of each requested row
    feedback: torch.Tensor  # [R, H] the hidden input of the next draft step for those rows
    logits: torch.Tensor | None  # [R, draft_vocab] float32 (torch runner only: tests)
