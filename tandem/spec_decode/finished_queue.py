"""Finished requests' outputs on their way to the proposer, within a share of the host's time.

The suffix proposer caches every finished output in its global tree (``SuffixProposer.forget``):
~2–4 µs of Python per token on the 2-core CPU. Handed over whole, the outputs of a batch that
finishes together cost a step ~0.8 ms each on the H200's host (docs/performance.md §36); handed
over a fixed number of tokens per step plus 1/64 of the queue (§36 to §42) they still cost 120–180
µs per step at batch 32–64 on that CPU — and an engine whose steps are bound by the host's work, as
SmolLM2's are at batch 32–64 on an H100 (§43: the GPU kernels of a batch-64 step take ~1.2 ms of its
~2.3), pays that on every step, drafting or not: the suffix engine configured never to draft ran
at 0.81× of plain decoding at batch 32 (§43).

So the hand-over is paid from a time credit (``time_credit.py``; a speculator's goodput policy
shares it): each step earns ``HOST_SHARE`` of its wall time (at most ``HOST_CREDIT_MAX`` saved), and
``hand_over`` passes outputs while the credit is positive and the call has spent less than
``FORGET_CALL_MAX``, charging the time each one took (the last one may overdraw; later steps repay
it). At batch 1 an output finishes every few hundred steps, so the saved credit passes it over at
once — the next request's lookups see it, as before. When outputs finish faster than the credit
allows, the queue keeps the newest ``FORGET_QUEUE_TOKENS`` tokens and drops the oldest outputs
(counted in ``num_dropped``): the global tree is a cache of recent outputs whose upkeep must not
cost the steps it is meant to speed up. ``drain`` (the engine switching speculators) hands
everything over.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from tandem.spec_decode.time_credit import TimeCredit

# One call spends at most this (seconds; the output it started may overrun it): a burst is spread
# over several steps, none of which stalls much longer than the outputs' longest insertion.
FORGET_CALL_MAX = 0.0005
# Output tokens queued at most: beyond, the oldest queued outputs are dropped (never handed over).
FORGET_QUEUE_TOKENS = 8192


class FinishedQueue:
    """(request id, output tokens) of finished requests, oldest first, and the time credit that
    pays for handing them to the proposer."""

    def __init__(self, credit: TimeCredit | None = None, max_tokens: int = FORGET_QUEUE_TOKENS,
                 call_max: float = FORGET_CALL_MAX) -> None:
        self.max_tokens, self.call_max = max_tokens, call_max
        # (``credit``: one shared with other optional work, whose owner earns it; else its own,
        # ``HOST_SHARE`` of each step, ``HOST_CREDIT_MAX`` saved)
        self._credit = credit if credit is not None else TimeCredit()
        self._queue: deque[tuple[str, Sequence[int]]] = deque()
        self.num_tokens = 0  # queued output tokens (+ 1 per output)
        self.num_dropped = 0  # outputs dropped unseen (the queue was full)

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, request_id: str, output: Sequence[int]) -> None:
        self._queue.append((request_id, output))
        self.num_tokens += len(output) + 1
        while self.num_tokens > self.max_tokens and len(self._queue) > 1:
            _, old = self._queue.popleft()
            self.num_tokens -= len(old) + 1
            self.num_dropped += 1

    @property
    def credit(self) -> float:
        """Seconds of host time the hand-over may spend now (negative: overdrawn)."""
        return self._credit.credit

    @credit.setter
    def credit(self, seconds: float) -> None:
        self._credit.credit = seconds

    def earn(self, step_seconds: float) -> None:
        """A step ran for ``step_seconds``: its share joins the credit."""
        self._credit.earn(step_seconds)

    def hand_over(self, forget: Callable[[str, Sequence[int]], None], drain: bool = False) -> None:
        """Pass queued outputs to ``forget`` in finishing order while the credit lasts and this
        call has spent less than ``call_max`` (all with ``drain``, uncharged)."""
        queue, credit = self._queue, self._credit
        spent = 0.0
        while queue and (drain or (credit.available and spent < self.call_max)):
            rid, output = queue.popleft()
            self.num_tokens -= len(output) + 1
            t0 = credit.clock()
            forget(rid, output)
            if not drain:
                dt = credit.clock() - t0
                credit.charge(dt)
                spent += dt
