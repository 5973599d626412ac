"""Learning-rate schedule: linear warmup, then cosine to zero over the planned steps.

With a time budget the plan shrinks to the steps that fit (``fit_total``: steps done plus what the
remaining time buys at the measured seconds per step), so the cosine still ends at the budget.
"""

from __future__ import annotations

import math


def lr_factor(step: int, total: int, warmup_fraction: float) -> float:
    """Multiplier of the base learning rate for optimizer step ``step`` (0-based) of ``total``."""
    total = max(1, total)
    warmup = max(1, round(warmup_fraction * total)) if warmup_fraction > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def fit_total(planned: int, done: int, elapsed_s: float, remaining_s: float) -> int:
    """The number of steps that fit: ``planned``, or fewer when the time left cannot buy them."""
    if done < 5 or elapsed_s <= 0:
        return planned
    per_step = elapsed_s / done
    return max(done + 1, min(planned, done + int(remaining_s / per_step)))
