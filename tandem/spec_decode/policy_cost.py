"""Step-cost model for the goodput policy: a step's wall time as a function of batch size and query tokens.

Per batch-size bucket (powers of two: 1, 2, 4, …) the model keeps

- ``decode``: an EWMA of the wall time of steps where every request decoded one token (D(B));
- a linear fit (over its last verify steps, refitted against the current D(B)) of a verify step's
  *relative* overhead over that decode time, ``t / D(B) − 1 = σ + β · n / B`` with ``n`` the draft
  tokens in the step (query tokens − B): σ is what a verify step costs for being a verify (on CUDA
  it runs synchronously while plain decode steps overlap the host's work), β the price of one more
  query token per request. The fit is a
  ridge least-squares fit with exponential forgetting (per verify step, and with age: 0.995 per timed
  step, so a measurement nobody repeats fades), pulled towards the prior (σ₀, β₀) (which is all
  there is before a verify and a decode step were timed) and overridden by measurements within a
  few dozen steps. A bucket's first verify step is not used (new shapes: a cold start, not a cost).

On an asynchronous engine a verify step also costs the steps around it: the pipeline of chained
decode steps drains before it and restarts after it, so those plain steps take longer than a steady
one. Only *steady* decode steps (not a drain or restart of the pipeline; every step of a synchronous
engine) are decode samples; a transition step's excess over D(B) is charged to the last verify step
when it was at most ``TRANSITION_SPAN`` steps ago (the restart after it; a drain before a verify
costs no more than a steady step: it launches nothing).

A step's cost need not be linear in its draft tokens: on the CPU, torch's int4 kernel works in blocks
of four rows, so a 5-row verify cost 2.57 decodes where a 4-row one cost 1.75 (docs/performance.md
§34). So at small batch (≤ ``RESIDUAL_MAX_BATCH``, where the same step shapes recur) the fit keeps,
per (batch size, draft tokens) the bucket has verified, the weighted mean of what the line missed
there (shrunk towards 0, weight ``RESIDUAL_PRIOR_WEIGHT``), and the prediction for that exact step
adds it; draft counts never seen get the line alone. (There the first verify of each (batch, draft
tokens) is a cold start too and is not used.)

A bucket without measurements borrows the nearest measured bucket's fit, and its decode time from
its neighbours (scaled with B). Everything the policy compares is a ratio to D(B), so it can decide
before any step was timed. (A model-based proposer's draft cost is the policy's ``draft_cost``, per
draft step in units of D(B).)
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Priors: a verify step costs 10% more than a decode step plus 25% of a decode row per draft token
# per request. Conservative on purpose: with acceptance near zero, speculation never pays.
PRIOR_SIGMA = 0.10
# ... on an asynchronous engine: a verify's cycle was 2.05 decode cycles (1.07 vs 0.52 ms; H200,
# SmolLM2-135M, batch 1, benchmarks/spec_step_profile.py, 2026-12-02)
ASYNC_PRIOR_SIGMA = 1.0
PRIOR_BETA = 0.25
PRIOR_WEIGHT = 1.0  # ridge weight of the prior, in verify steps
FORGET = 0.95  # per verify observation: ~20 steps of memory
MAX_VERIFIES = 64  # verify steps kept per bucket
REFIT_EVERY = 8  # timed steps a fit is reused without a new verify (ageing moves weights by 0.995^8: 4 %)
AGE_DECAY = 0.995  # per timed step: a verify measured 140 steps ago weighs half (no verify since: the prior returns)
DECODE_ALPHA = 0.1
RESIDUAL_PRIOR_WEIGHT = 1.0  # a (batch, draft tokens) correction's pull towards 0, in verify steps
RESIDUAL_MAX_BATCH = 8  # corrections per exact step shape up to this batch (larger ones rarely repeat)
TRANSITION_SPAN = 2  # steps after a verify whose plain-step excess is the verify's


def bucket_of(batch: int) -> int:
    """The bucket of a batch size: the smallest power of two >= batch (1 for batch <= 1)."""
    return 1 if batch <= 1 else 1 << math.ceil(math.log2(batch))


@dataclass
class _Bucket:
    decode: float | None = None  # EWMA of decode-step seconds
    num_decode: int = 0
    num_verify: int = 0
    steps_since_decode: int = 0  # steps timed in this bucket since its last decode step (or probe)
    probed: bool = False  # a plain-decode probe was asked for
    steps_since_verify: int = 0  # steps timed in this bucket since its last verify step
    # (draft tokens per request x, seconds, step clock, batch, draft tokens n)
    verifies: deque[tuple[float, float, int, int, int]] = field(default_factory=lambda: deque(maxlen=MAX_VERIFIES))
    seen: set[tuple[int, int]] = field(default_factory=set)  # (batch, n) verified at least once
    fit: tuple[float, float] | None = None  # (σ, β) cached ...
    fit_at: int = -1  # ... since this value of the model's step clock (the data age with every timed step)
    fit_verifies: int = -1  # ... and this many verify steps (a new one: refit)
    residuals: dict[tuple[int, int], float] = field(default_factory=dict)  # per (batch, n), with the fit


class StepCostModel:
    def __init__(self, *, prior_sigma: float = PRIOR_SIGMA, prior_beta: float = PRIOR_BETA,
                 forget: float = FORGET, decode_alpha: float = DECODE_ALPHA, max_k: int = 4) -> None:
        if prior_sigma < 0 or prior_beta < 0:
            raise ValueError(f"cost priors must be >= 0, got sigma={prior_sigma}, beta={prior_beta}")
        self.prior_sigma, self.prior_beta = prior_sigma, prior_beta
        self.forget, self.decode_alpha, self.max_k = forget, decode_alpha, max(1, max_k)
        self._buckets: dict[int, _Bucket] = {}
        self._steps = 0  # timed steps, all buckets: the clock verify observations age by

    # ---- measurements ------------------------------------------------------------------------------
    def observe(self, batch: int, num_query_tokens: int, seconds: float, steady: bool = True) -> None:
        """One timed step of ``batch`` requests each decoding (``num_query_tokens == batch``) or
        verifying drafts (more query tokens). ``steady`` False: a plain step that drained or
        restarted an asynchronous pipeline (its excess over D(B) is charged to a verify)."""
        if batch <= 0 or seconds <= 0 or num_query_tokens < batch:
            return
        b = self._bucket(batch)
        n = num_query_tokens - batch
        self._steps += 1  # (every cached fit is stale now: the data aged)
        if n == 0 and not steady:
            b.steps_since_verify += 1
            b.steps_since_decode += 1
            if b.decode is not None and b.verifies and self._steps - b.verifies[-1][2] <= TRANSITION_SPAN:
                x, t, step, vb, vn = b.verifies[-1]
                b.verifies[-1] = (x, t + max(0.0, seconds - b.decode), step, vb, vn)
                b.fit = None  # (its data changed)
            return
        if n == 0:
            b.decode = seconds if b.decode is None else (1 - self.decode_alpha) * b.decode + self.decode_alpha * seconds
            b.num_decode += 1
            b.steps_since_decode = 0
            b.steps_since_verify += 1
            return
        b.steps_since_decode += 1
        b.steps_since_verify = 0
        b.num_verify += 1
        # a bucket's first verify step, and at small batch its first of each (batch, draft tokens),
        # is a cold start (new shapes), not a cost
        small = batch <= RESIDUAL_MAX_BATCH
        if b.num_verify > 1 and (not small or (batch, n) in b.seen):
            b.verifies.append((n / batch, seconds, self._steps, batch, n))
        if small:
            b.seen.add((batch, n))

    # ---- predictions -------------------------------------------------------------------------------
    def decode_seconds(self, batch: int) -> float | None:
        """D(B): measured for B's bucket, else interpolated / scaled from the measured buckets."""
        key = bucket_of(batch)
        b = self._buckets.get(key)
        if b is not None and b.decode is not None:
            return b.decode
        known = sorted((k, v.decode) for k, v in self._buckets.items() if v.decode is not None)
        if not known:
            return None
        lo = [(k, d) for k, d in known if k < key]
        hi = [(k, d) for k, d in known if k > key]
        if lo and hi:
            (k0, d0), (k1, d1) = lo[-1], hi[0]
            return d0 + (d1 - d0) * (key - k0) / (k1 - k0)
        k0, d0 = (lo[-1] if lo else hi[0])
        return d0 * key / k0 if lo else d0  # larger batches: proportional (pessimistic), smaller: the same

    def overhead(self, batch: int) -> tuple[float, float]:
        """(σ, β) for ``batch``: the bucket's fit, else the nearest fitted bucket's, else the prior."""
        key = bucket_of(batch)
        fitted = [k for k, v in self._buckets.items() if v.verifies and v.decode is not None]
        if not fitted:
            return self.prior_sigma, self.prior_beta
        near = min(fitted, key=lambda k: (abs(math.log2(k) - math.log2(key)), k))
        b = self._buckets[near]
        if b.fit is None or b.fit_verifies != b.num_verify or self._steps - b.fit_at >= REFIT_EVERY:
            b.fit, b.fit_at, b.fit_verifies = self._solve(b), self._steps, b.num_verify
        return b.fit

    def residuals(self, batch: int) -> dict[int, float]:
        """Draft tokens -> what the line misses for a step of exactly ``batch`` requests with that
        many drafts (measured ones only; fitted with ``overhead``)."""
        b = self._buckets.get(bucket_of(batch))
        if b is None or b.fit is None:
            return {}
        return {n: r for (vb, n), r in b.residuals.items() if vb == batch}

    def ratio(self, batch: int, num_draft_tokens: int) -> float:
        """Predicted step time with ``num_draft_tokens`` drafts over the batch, in units of D(B)."""
        if num_draft_tokens <= 0:
            return 1.0
        sigma, beta = self.overhead(batch)
        over = sigma + beta * num_draft_tokens / max(batch, 1) + self.residuals(batch).get(num_draft_tokens, 0.0)
        return 1.0 + max(0.0, over)

    def decode_is_stale(self, batch: int, every: int) -> bool:
        """Whether ``batch``'s bucket needs a plain decode step timed: verify steps were timed but no
        decode step yet (from the second one, once), or none for ``every`` steps."""
        b = self._buckets.get(bucket_of(batch))
        if b is None:
            return False
        return b.steps_since_decode >= (2 if b.decode is None and not b.probed else every)

    def verify_is_stale(self, batch: int, every: int) -> bool:
        """Whether ``batch``'s bucket has timed ``every`` or more steps since its last verify step (its
        fit has faded towards the prior: the policy may explore a verify)."""
        b = self._buckets.get(bucket_of(batch))
        return b is None or b.steps_since_verify >= every

    def prior_overhead(self) -> tuple[float, float]:
        return self.prior_sigma, self.prior_beta

    def probing(self, batch: int) -> None:
        """The policy decodes plainly for a few steps now; ask again only ``every`` steps later, even
        if those steps were not timed as plain decode steps (prefill mixed in)."""
        b = self._bucket(batch)
        b.probed, b.steps_since_decode = True, 0

    # ---- internals --------------------------------------------------------------------------------
    def _bucket(self, batch: int) -> _Bucket:
        key = bucket_of(batch)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket()
        return b

    def _solve(self, b: _Bucket) -> tuple[float, float]:
        """Ridge least squares of ``t / D − 1 = σ + β x`` over the bucket's recent verify steps (the
        newest weighing most: ``forget`` per step), pulled towards the prior (σ₀, β₀) with weight
        ``PRIOR_WEIGHT`` each: when every step had the same draft count, the data fix σ + β x there
        and the prior splits it, instead of a degenerate or wild line."""
        d = b.decode
        assert d is not None
        lam = PRIOR_WEIGHT
        w = sx = sy = sxx = sxy = 0.0
        weight = 1.0
        points = []
        for x, t, step, vb, vn in reversed(b.verifies):
            y = t / d - 1.0
            wt = weight * AGE_DECAY ** (self._steps - step)
            if vb <= RESIDUAL_MAX_BATCH:
                points.append((x, y, wt, (vb, vn)))
            w, sx, sy, sxx, sxy = w + wt, sx + wt * x, sy + wt * y, sxx + wt * x * x, sxy + wt * x * y
            weight *= self.forget
        a11, a12, a22 = w + lam, sx, sxx + lam
        r1, r2 = sy + lam * self.prior_sigma, sxy + lam * self.prior_beta
        det = a11 * a22 - a12 * a12
        sigma, beta = (r1 * a22 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det
        if beta < 0:  # more tokens never make a step cheaper: the mean overhead, beta = 0
            sigma, beta = r1 / a11, 0.0
        sums: dict[tuple[int, int], list[float]] = {}
        for x, y, wt, key in points:
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += wt * (y - sigma - beta * x)
            acc[1] += wt
        b.residuals = {key: r / (wsum + RESIDUAL_PRIOR_WEIGHT) for key, (r, wsum) in sums.items()}
        return sigma, beta
