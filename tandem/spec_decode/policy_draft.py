"""A model proposer's drafting cost for the goodput policy: a fixed part per proposal plus a part per draft step.

The speculator times each model proposal on the host (``Speculator._timed_drafts``); the policy
takes it in units of D(B), the decode step of its batch size, as ``x`` for a proposal of ``steps``
draft steps. On CUDA an EAGLE proposal is one host staging and one graph replay whatever its
length (``GpuHeadRunner.forward_proposal``), so most of what the host waits for is fixed per
proposal. Priced per draft step (an EWMA of x / steps), grants of 1–2 drafts had measured 0.78
decode steps per draft on the H100 (chat, SmolLM2's head, docs/performance.md §53): a third draft
looked as dear as the first two, and the policy kept granting 1–2 where 3 paid.

So the cost is a line, ``x = fixed + per_step · steps``: a ridge least-squares fit with exponential
forgetting (``FORGET`` per proposal, a few dozen proposals of memory), pulled towards no fixed part
and, before anything was timed, towards the prior per step, both parts ≥ 0. While every proposal
has the same length their mean is priced per step (as an EWMA of x / steps had); grants of other
lengths separate the two parts.
A proposer that declares its cost (``draft_step_cost``) is not measured: that cost per step, nothing fixed.
"""

from __future__ import annotations

FORGET = 0.95  # per proposal timed
# ridge weights, in proposals: towards no fixed part, and (before any proposal was timed) towards the
# prior per step. While proposals have one length (the policy's grant) their mean is priced per step,
# as before; the few of other lengths tell the parts apart.
PRIOR_WEIGHT_FIXED = 0.3
PRIOR_WEIGHT_STEP = 0.01


class DraftCost:
    def __init__(self, per_step: float, *, measured: bool) -> None:
        if per_step < 0:
            raise ValueError(f"a draft step's cost must be >= 0, got {per_step}")
        self.prior_step = per_step
        self.measured = measured
        self.fixed, self.per_step = 0.0, per_step
        self._sums = [0.0] * 5  # weighted sums of (1, s, x, s², s·x) over the proposals timed

    def of(self, steps: int) -> float:
        """A proposal of ``steps`` draft steps, in decode steps (none: 0)."""
        return self.fixed + self.per_step * steps if steps > 0 else 0.0

    def observe(self, steps: int, x: float) -> None:
        """A proposal of ``steps`` draft steps took ``x`` decode steps (nothing learnt where the cost
        was declared, or the sample says nothing)."""
        if not self.measured or steps <= 0 or x <= 0:
            return
        s = float(steps)
        self._sums = [v * FORGET + d for v, d in zip(self._sums, (1.0, s, x, s * s, s * x))]
        w, ss, sx, sss, ssx = self._sums
        a11, a12, a22 = w + PRIOR_WEIGHT_FIXED, ss, sss + PRIOR_WEIGHT_STEP
        r1, r2 = sx, ssx + PRIOR_WEIGHT_STEP * self.prior_step
        det = a11 * a22 - a12 * a12
        fixed, per = (r1 * a22 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det
        if fixed < 0:  # no fixed part: the line through 0 (per step), pulled towards the prior
            fixed, per = 0.0, r2 / a22
        elif per < 0:  # longer proposals never cost less: the mean as fixed
            fixed, per = r1 / a11, 0.0
        self.fixed, self.per_step = fixed, per
