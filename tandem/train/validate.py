"""Held-out validation with the training unroll: per-position greedy acceptance and expected τ.

With teacher forcing, step ``j``'s agreement rate estimates the acceptance of draft ``j + 1``
given the earlier drafts were accepted, so a chain of ``k`` drafts is expected to yield
``τ = 1 + Σ_j Π_{i ≤ j} acc_i`` tokens per verify step (greedy target, greedy drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.models.eagle import EagleHead
from tandem.train.batches import group_by_length, make_batch
from tandem.train.data import Sequence
from tandem.train.device import autocast
from tandem.train.target import FrozenTarget
from tandem.train.ttt import TOP_WIDTHS, unroll


@dataclass(frozen=True)
class ValMetrics:
    loss: float
    acceptance: tuple[float, ...]  # per draft position (teacher-forced, conditional)
    rows: int
    # per width w of TOP_WIDTHS, per position: the target's argmax among the head's top-w
    top_acceptance: dict[int, tuple[float, ...]] = field(default_factory=dict)

    @property
    def tau(self) -> float:
        return expected_tau(self.acceptance)

    def line(self) -> str:
        acc = " ".join(f"{a:.3f}" for a in self.acceptance)
        top = "".join(f"  top-{w} [{' '.join(f'{a:.3f}' for a in rates)}]" for w, rates in self.top_acceptance.items())
        return f"val loss {self.loss:.4f}  acceptance per position [{acc}]  expected tau {self.tau:.3f}{top}"

    def to_dict(self) -> dict[str, object]:
        return {"loss": self.loss, "acceptance": list(self.acceptance), "expected_tau": self.tau, "rows": self.rows,
                "top_acceptance": {str(w): list(r) for w, r in self.top_acceptance.items()}}


def expected_tau(acceptance: tuple[float, ...] | list[float]) -> float:
    tau, run = 1.0, 1.0
    for a in acceptance:
        run *= a
        tau += run
    return tau


@torch.no_grad()
def validate(head: EagleHead, target: FrozenTarget, seqs: list[Sequence], batch_tokens: int,
             t2d: torch.Tensor | None, columns: torch.Tensor | None, steps: int, decay: float,
             device: torch.device) -> ValMetrics:
    was_training = head.training
    head.eval()
    correct = torch.zeros(steps, dtype=torch.long, device=device)
    top = torch.zeros(steps, len(TOP_WIDTHS), dtype=torch.long, device=device)
    counted = torch.zeros(steps, dtype=torch.long, device=device)
    loss = torch.zeros((), device=device)
    n_batches = 0
    for group in group_by_length(seqs, batch_tokens):
        batch = make_batch([seqs[i] for i in group], batch_tokens).to(device)
        with autocast(device):
            res = unroll(head, target, target.run(batch), batch, t2d, columns, steps, decay, grad=False)
        correct += torch.stack(res.correct)
        top += torch.stack(res.correct_top)
        counted += torch.stack(res.counted)
        loss += res.loss.float()
        n_batches += 1
    head.train(was_training)
    c, n = correct.tolist(), counted.tolist()
    acc = tuple(ci / ni if ni else 0.0 for ci, ni in zip(c, n))
    tops = {w: tuple(ti / ni if ni else 0.0 for ti, ni in zip(top[:, i].tolist(), n)) for i, w in enumerate(TOP_WIDTHS)}
    return ValMetrics(float(loss) / max(1, n_batches), acc, int(n[0]) if n else 0, tops)
