"""What the speculator and the engine hand each other per step (``speculator.py``): a request's
``Draft``, the step's kind, and the ``StepRecord`` the engine builds after every step of a
speculating engine (none for ``NoSpeculation``: a plain engine builds no records)."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.request import Request
from tandem.scheduler import ScheduledRequest, SchedulerOutput


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


class StepRows:
    """The requests that got tokens in a step, gathered for its ``StepRecord`` (``add`` after each
    step's output is read, before it is applied). Where nobody verified drafts, a list of requests:
    a tuple per request per step (the ``SampledTokens`` it replaced) had cost a host-bound engine
    ~4 % of a step at batch 64 on the H100 while nobody drafted (docs/performance.md §55)."""

    __slots__ = ("requests", "drafted", "accepted")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.drafted: list[int] = []  # per request: drafts verified (empty unless a verify was added)
        self.accepted: list[int] = []  # ... and kept

    def add(self, scheduled: Sequence[ScheduledRequest], sampled_token_ids: Sequence[Sequence[int]],
            num_accepted: Sequence[int], verifies: bool) -> None:
        """A step's rows: every scheduled request that got tokens and had not finished before."""
        if verifies:
            for s, toks, a in zip(scheduled, sampled_token_ids, num_accepted):
                if toks and not s.request.status.finished:
                    self.requests.append(s.request)
                    self.drafted.append(len(s.spec_token_ids))
                    self.accepted.append(a)
            return
        got = [s.request for s, toks in zip(scheduled, sampled_token_ids) if toks and not s.request.status.finished]
        if self.drafted:  # (after a verify's rows: keep the columns aligned)
            self.drafted += [0] * len(got)
            self.accepted += [0] * len(got)
        self.requests += got


@dataclass(frozen=True)
class StepRecord:
    kind: StepKind
    seconds: float  # wall time of the engine step
    requests: tuple[Request, ...]  # the requests that got tokens in the step
    finished: tuple[Request, ...]  # requests finished (stopped, length, aborted) since the last record
    num_requests: int = 0  # requests in the timed step's batch
    num_query_tokens: int = 0  # its query tokens (drafts included)
    # False: a plain step that drained or restarted the asynchronous pipeline (around a verify)
    steady: bool = True
    drafted: tuple[int, ...] = ()  # per request of ``requests``: drafts verified (empty: no verify)
    accepted: tuple[int, ...] = ()  # ... and accepted

    @classmethod
    def of(cls, kind: StepKind, seconds: float, rows: StepRows, finished: tuple[Request, ...],
           num_requests: int = 0, num_query_tokens: int = 0, steady: bool = True) -> StepRecord:
        return cls(kind, seconds, tuple(rows.requests), finished, num_requests, num_query_tokens, steady,
                   tuple(rows.drafted), tuple(rows.accepted))

    @property
    def num_tokens(self) -> int:
        """Tokens the step emitted (accepted drafts + one per request that sampled)."""
        return len(self.requests) + sum(self.accepted)
