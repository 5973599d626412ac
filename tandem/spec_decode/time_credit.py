"""A time credit: optional host work paid from a share of the steps' wall time.

An engine whose steps are bound by the host's work (SmolLM2 at batch 8–64 on an H100: the GPU
kernels of a batch-64 step take ~1.2 ms of its ~2.3, docs/performance.md §43) pays every microsecond
of Python a speculator adds to a step, drafting or not. Work that may wait or be skipped — handing
finished outputs to the proposer (``finished_queue.py``), the goodput policy's shadow drafts and
re-evaluations while nobody drafts (``policy.py``) — is paid from a credit instead: each step earns
``share`` of its wall time (at most ``credit_max`` saved), the work runs while the credit is
positive and is charged what it took (the last piece may overdraw; later steps repay it). So such
work costs at most ``share`` of the time on average, however expensive one piece of it is. A
speculator's policy and finished-output queue share one credit (``Speculator``): together they take
at most ``HOST_SHARE``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

HOST_SHARE = 0.01  # of each step's wall time: a speculator's optional host work on average
HOST_CREDIT_MAX = 0.004  # seconds saved at most: a burst after a quiet stretch (a lone output) goes at once


class TimeCredit:
    def __init__(self, share: float = HOST_SHARE, credit_max: float = HOST_CREDIT_MAX, clock: Callable[[], float] = time.perf_counter) -> None:
        self.share, self.credit_max, self.clock = share, credit_max, clock
        self.credit = credit_max  # seconds

    def earn(self, step_seconds: float) -> None:
        """A step ran for ``step_seconds``: its share joins the credit."""
        self.credit = min(self.credit_max, self.credit + self.share * max(0.0, step_seconds))

    @property
    def available(self) -> bool:
        return self.credit > 0

    def charge(self, seconds: float) -> None:
        self.credit -= seconds
