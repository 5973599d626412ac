"""StepOutput: what one runner forward returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepOutput:
    logits: torch.Tensor  # [R, V] float32 for the requested rows
    aux_hidden: list[torch.Tensor]  # per requested aux layer: [T, H] for every query row (not just R)
