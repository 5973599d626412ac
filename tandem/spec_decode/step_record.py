"""What the speculator and the engine hand each other per step (``speculator.py``): a request's
``Draft``, the step's kind, and the ``StepRecord`` the engine builds after every step of a
speculating engine (none for ``NoSpeculation``: a plain engine builds no records)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tandem.request import Request
from tandem.scheduler import SchedulerOutput


class StepKind(enum.Enum):
    VERIFY = "verify"  # some request verified drafts
    DECODE = "decode"  # every request decoded one token
    OTHER = "other"  # prefill chunks, mixed steps, nothing scheduled: not timed


def step_kind(sched: SchedulerOutput) -> StepKind:
    if any(s.spec_token_ids for s in sched.scheduled):
        return StepKind.VERIFY
    if sched.scheduled and all(s.num_new_tokens == 1 and s.samples for s in sched.scheduled):
        return StepKind.DECODE
    return StepKind.OTHER


@dataclass(frozen=True)
class Draft:
    token_ids: tuple[int, ...]  # target token ids, at most the k chosen for the request (0 allowed)
    probs: torch.Tensor | None = None  # [len(token_ids), V] draft q when the proposer sampled


NO_DRAFT = Draft(())


class SampledTokens(NamedTuple):
    """A request that got tokens in a step: ``num_drafted`` drafts verified, ``num_accepted`` kept.
    (A tuple: one per request per step, built in half a frozen dataclass's time.)"""

    request: Request
    num_drafted: int
    num_accepted: int


@dataclass(frozen=True)
class StepRecord:
    kind: StepKind
    seconds: float  # wall time of the engine step
    sampled: tuple[SampledTokens, ...]
    finished: tuple[Request, ...]  # requests finished (stopped, length, aborted) since the last record
    num_requests: int = 0  # requests in the timed step's batch
    num_query_tokens: int = 0  # its query tokens (drafts included)
    # False: a plain step that drained or restarted the asynchronous pipeline (around a verify)
    steady: bool = True

    @property
    def num_tokens(self) -> int:
        """Tokens the step emitted (accepted drafts + one per request that sampled)."""
        return sum(s.num_accepted + 1 for s in self.sampled)
