"""Step-cost model for the goodput policy: a step's wall time as a function of batch size and query tokens.

Per batch-size bucket (powers of two: 1, 2, 4, …) the model keeps

- ``decode``: an EWMA of the wall time of steps where every request decoded one token (D(B));
- a linear fit (over its verify steps) of a verify step's *relative* overhead over that decode
  time, ``t / D(B) − 1 = σ + β · n / B`` with ``n`` the draft tokens in the step (query tokens − B):
  σ is what a verify step costs for being a verify (on CUDA it runs synchronously while plain decode
  steps overlap the host's work), β the price of one more query token per request. Each verify's
  overhead is taken against D(B) as it is when the verify is timed (none before a decode step was),
  not later: every step's time moves with the context (on the CPU a batch-1 SmolLM2 step at 1,300
  tokens cost ~1.6× one at 100), and seconds of verifies at a long context set against a later
  short context's D(B) had made σ 0.37 where it was 0.12 — an EAGLE head drafted nothing for three
  requests after a 1,226-token prompt (docs/performance.md §48). The fit is a
  ridge least-squares fit with exponential forgetting (per verify step, and with age: 0.995 per timed
  step, so a measurement nobody repeats fades), pulled towards the prior (σ₀, β₀) (which is all
  there is before a verify and a decode step were timed) and overridden by measurements within a
  few dozen steps. A bucket's first verify step is not used (new shapes: a cold start, not a cost).
  Both forgettings are exponential, so the fit keeps running weighted sums (of 1, x, y, x², x·y,
  scaled on each update) and solves in O(1): it is refitted on every verify step of a run, on the
  critical path of a synchronous step (a 64-step window re-summed in Python had cost ~90 µs there).

On an asynchronous engine a run of verify steps also costs the steps around it: the pipeline of
chained decode steps drains before it and restarts after it, so those plain steps take longer than a
steady one. Only *steady* decode steps (not a drain or restart of the pipeline; every step of a
synchronous engine) are decode samples. A transition step's excess over D(B), when the last verify
step was at most ``TRANSITION_SPAN`` steps ago (the restart after a run; a drain before a verify
costs no more than a steady step: it launches nothing), is the *restart* cost ρ (an EWMA per bucket,
in units of D(B): ``restart_ratio``), kept apart from the verify fit: it is paid once per run of
verifies, not per verify. So the policy weighs it only where a decision starts a run (asking for a
round while a decode step is in flight), spread over the run's expected length (``run_length``, an
EWMA of the verify steps between restarts); once the pipeline is drained, going on verifying costs
σ + β n / B and stopping pays the restart all the same. (Charging it to every verify had made a verify
cycle look like 2.6 decodes on the H200 where consecutive verifies cost 2.05: the policy drafted in
382 of ~1,850 steps of HumanEval at batch 1 and gained 1.14–1.19× where drafting every step gained
1.47–1.60×, docs/performance.md §34.)

On an asynchronous engine (``asynchronous``) the first verify of a run also runs after a drained
pipeline (and, for a model proposer, after its catch-up over the steps it idled): nothing overlaps
it, and on the H100 such verifies cost 2.4–4.6 decode steps where a steady chained one cost ~1.2
(docs/performance.md §51). Taken into the fit, they kept σ near 1 and an EAGLE head that paid
drafting every step idle on chat (§52). There a run's first verify's excess over the fit's
prediction is the run's *entry* cost (an EWMA per bucket, in units of D(B), ``RESTART_ALPHA``), which
``restart_ratio`` adds to the restart: both are paid once per run, where a decision starts one; the
fit takes none of that verify (taking it less the entry had let the fit confirm itself: an entry
measured against a fit faded to the pessimistic prior leaves exactly that prior, §54).

A step's cost need not be linear in its draft tokens: on the CPU, torch's int4 kernel works in blocks
of four rows, so a 5-row verify cost 2.57 decodes where a 4-row one cost 1.75 (docs/performance.md
§34). So at small batch (≤ ``RESIDUAL_MAX_BATCH``, where the same step shapes recur) the fit keeps,
per (batch size, draft tokens) the bucket has verified, the weighted mean of what the line missed
there (shrunk towards 0, weight ``RESIDUAL_PRIOR_WEIGHT``), and the prediction for that exact step
adds it; draft counts never seen get the line alone. (There the first verify of each (batch, draft
tokens) is a cold start too and is not used.)

A bucket without measurements borrows the nearest measured bucket's fit, and its decode time from
its neighbours (scaled with B). Everything the policy compares is a ratio to D(B), so it can decide
before any step was timed. (A model-based proposer's drafting cost is the policy's ``draft``,
``policy_draft.py``, in units of D(B).)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

# Priors: a verify step costs 10% more than a decode step plus 25% of a decode row per draft token
# per request. Conservative on purpose: with acceptance near zero, speculation never pays.
PRIOR_SIGMA = 0.10
# ... on an asynchronous engine: a verify's cycle was 2.05 decode cycles (1.07 vs 0.52 ms; H200,
# SmolLM2-135M, batch 1, benchmarks/spec_step_profile.py, 2026-12-02)
ASYNC_PRIOR_SIGMA = 1.0
# ... and restarting its pipeline after a run of verifies: a synchronous plain step's excess over a
# chained one (0.751 vs 0.522 ms, same profile)
ASYNC_PRIOR_RESTART = 0.45
PRIOR_BETA = 0.25
PRIOR_WEIGHT = 1.0  # ridge weight of the prior, in verify steps
FORGET = 0.95  # per verify observation: ~20 steps of memory
REFIT_EVERY = 8  # timed steps a fit is reused without a new verify (ageing moves weights by 0.995^8: 4 %)
AGE_DECAY = 0.995  # per timed step: a verify measured 140 steps ago weighs half (no verify since: the prior returns)
DECODE_ALPHA = 0.1
RESIDUAL_PRIOR_WEIGHT = 1.0  # a (batch, draft tokens) correction's pull towards 0, in verify steps
RESIDUAL_MAX_BATCH = 8  # corrections per exact step shape up to this batch (larger ones rarely repeat)
MIN_SHAPE_WEIGHT = 1e-3  # a step shape's correction below this weight is dropped (it is shrunk to ~0)
TRANSITION_SPAN = 2  # steps after a verify whose plain-step excess is the restart's
RESTART_ALPHA = 0.2  # EWMA step of the restart cost, per run of verifies


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
    # the verify steps' weighted sums of (1, x, y, x², x·y), x = draft tokens per request, y = the
    # step's overhead t / D(B) − 1 against D(B) when it was timed, as of step clock ``sums_at``; per
    # (batch, n) at small batch, of (1, x, y)
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)
    shape_sums: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    sums_at: int = 0
    seen: set[tuple[int, int]] = field(default_factory=set)  # (batch, n) verified at least once
    fit: tuple[float, float] | None = None  # (σ, β) cached ...
    fit_at: int = -1  # ... since this value of the model's step clock (the data age with every timed step)
    fit_verifies: int = -1  # ... and this many verify steps (a new one: refit)
    residuals: dict[tuple[int, int], float] = field(default_factory=dict)  # per (batch, n), with the fit
    last_verify: int = -(1 << 30)  # step clock of the bucket's last verify step
    restart: float | None = None  # EWMA of a run's restart excess, seconds
    restart_of: int = -1  # the verify (its step clock) whose restart the EWMA last took in ...
    restart_weight: float = 1.0  # ... with this weight (its later transition steps add theirs at it)
    run_verifies: int = 0  # verify steps since the last restart
    run_length: float | None = None  # EWMA of the verify steps a run had before its restart
    entry: float | None = None  # EWMA of a run's first verify's excess over the fit, in units of D(B)


class StepCostModel:
    def __init__(self, *, prior_sigma: float = PRIOR_SIGMA, prior_beta: float = PRIOR_BETA,
                 prior_restart: float = 0.0, forget: float = FORGET, decode_alpha: float = DECODE_ALPHA,
                 max_k: int = 4, asynchronous: bool = False) -> None:
        if prior_sigma < 0 or prior_beta < 0 or prior_restart < 0:
            raise ValueError(f"cost priors must be >= 0, got sigma={prior_sigma}, beta={prior_beta}, "
                             f"restart={prior_restart}")
        self.prior_sigma, self.prior_beta, self.prior_restart = prior_sigma, prior_beta, prior_restart
        self.forget, self.decode_alpha, self.max_k = forget, decode_alpha, max(1, max_k)
        self.asynchronous = asynchronous  # a run's first verify follows a drained pipeline: its entry
        self._buckets: dict[int, _Bucket] = {}
        self._steps = 0  # timed steps, all buckets: the clock verify observations age by

    # ---- measurements ------------------------------------------------------------------------------
    def observe(self, batch: int, num_query_tokens: int, seconds: float, steady: bool = True) -> None:
        """One timed step of ``batch`` requests each decoding (``num_query_tokens == batch``) or
        verifying drafts (more query tokens). ``steady`` False: a plain step that drained or
        restarted an asynchronous pipeline (its excess over D(B), after a verify, is the restart's)."""
        if batch <= 0 or seconds <= 0 or num_query_tokens < batch:
            return
        b = self._bucket(batch)
        n = num_query_tokens - batch
        self._steps += 1  # (every cached fit is stale now: the data aged)
        if n == 0 and not steady:
            b.steps_since_verify += 1
            b.steps_since_decode += 1
            if b.decode is not None and self._steps - b.last_verify <= TRANSITION_SPAN:
                excess = max(0.0, seconds - b.decode)
                if b.restart is not None and b.restart_of == b.last_verify:  # the same restart's next step
                    b.restart += b.restart_weight * excess
                else:
                    b.restart_weight = 1.0 if b.restart is None else RESTART_ALPHA
                    b.restart = excess if b.restart is None else b.restart + RESTART_ALPHA * (excess - b.restart)
                    run = float(b.run_verifies)
                    b.run_length = run if b.run_length is None else b.run_length + RESTART_ALPHA * (run - b.run_length)
                    b.run_verifies = 0
                b.restart_of = b.last_verify
            return
        if n == 0:
            b.decode = seconds if b.decode is None else (1 - self.decode_alpha) * b.decode + self.decode_alpha * seconds
            b.num_decode += 1
            b.steps_since_decode = 0
            b.steps_since_verify += 1
            return
        # a plain step since the last verify: this one starts a run (predicted before it joins the fit)
        entry_of = self.ratio(batch, n) if self.asynchronous and b.steps_since_verify > 0 else None
        b.steps_since_decode += 1
        b.steps_since_verify = 0
        b.num_verify += 1
        b.last_verify = self._steps
        b.run_verifies += 1
        # a bucket's first verify step, and at small batch its first of each (batch, draft tokens),
        # is a cold start (new shapes), not a cost
        small = batch <= RESIDUAL_MAX_BATCH
        if b.num_verify > 1 and b.decode is not None and (not small or (batch, n) in b.seen):
            self._age(b, self.forget)  # older verify steps weigh ``forget`` less
            x, y = n / batch, seconds / b.decode - 1.0  # (the overhead against D(B) as it is now)
            if entry_of is not None:  # the run's entry, apart: the fit takes the run's later verifies
                excess = max(0.0, y + 1.0 - entry_of)
                b.entry = excess if b.entry is None else b.entry + RESTART_ALPHA * (excess - b.entry)
                return
            for i, v in enumerate((1.0, x, y, x * x, x * y)):
                b.sums[i] += v
            if small:
                acc = b.shape_sums.setdefault((batch, n), [0.0, 0.0, 0.0])
                acc[0], acc[1], acc[2] = acc[0] + 1.0, acc[1] + x, acc[2] + y
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
        b = self._nearest(batch, lambda v: v.sums[0] > 0 and v.decode is not None)
        if b is None:
            return self.prior_sigma, self.prior_beta
        if b.fit is None or b.fit_verifies != b.num_verify or self._steps - b.fit_at >= REFIT_EVERY:
            b.fit, b.fit_at, b.fit_verifies = self._solve(b), self._steps, b.num_verify
        return b.fit

    def restart_ratio(self, batch: int) -> float:
        """ρ: what a run of verifies costs once on an asynchronous engine, in units of D(B): the
        pipeline's restart after it (the bucket's, else the nearest measured bucket's, else the
        prior: 0 on a synchronous engine, where no step restarts anything) and, measured apart
        (``asynchronous``), its first verify's excess over a steady one (the entry)."""
        b = self._nearest(batch, lambda v: v.restart is not None and bool(v.decode))
        rho = self.prior_restart if b is None or b.restart is None or not b.decode else b.restart / b.decode
        return rho + self.entry_ratio(batch)

    def entry_ratio(self, batch: int) -> float:
        """Of ``restart_ratio``: a run's first verify's excess over a steady one, in units of D(B) (the
        bucket's, else the nearest measured bucket's; 0 before any was measured or on a synchronous
        engine)."""
        e = self._nearest(batch, lambda v: v.entry is not None)
        return e.entry if e is not None and e.entry is not None else 0.0

    def run_length(self, batch: int) -> float:
        """The verify steps a run has had before its pipeline restart (the bucket's EWMA, else the
        nearest measured bucket's; 1 before any restart was measured)."""
        b = self._nearest(batch, lambda v: v.run_length is not None)
        return max(1.0, b.run_length or 1.0) if b is not None else 1.0

    def residuals(self, batch: int) -> dict[int, float]:
        """Draft tokens -> what the line misses for a step of exactly ``batch`` requests with that
        many drafts (measured ones only; fitted with ``overhead``)."""
        b = self._buckets.get(bucket_of(batch))
        if b is None or b.fit is None:
            return {}
        return {n: r for (vb, n), r in b.residuals.items() if vb == batch}

    def shape_weights(self, batch: int) -> dict[int, float]:
        """Draft tokens -> the (decayed) weight of the verify steps behind ``residuals``' entry: a
        correction is shrunk towards the line by ``RESIDUAL_PRIOR_WEIGHT / (weight + RESIDUAL_PRIOR_WEIGHT)``."""
        b = self._buckets.get(bucket_of(batch))
        if b is None or b.fit is None:
            return {}
        return {n: acc[0] for (vb, n), acc in b.shape_sums.items() if vb == batch and (vb, n) in b.residuals}

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

    def _nearest(self, batch: int, has: Callable[[_Bucket], bool]) -> _Bucket | None:
        """The bucket of ``batch`` if it ``has`` what is asked, else the nearest one that has (in
        log2 of the batch size, the smaller on a tie); None if none has."""
        key = bucket_of(batch)
        known = [k for k, v in self._buckets.items() if has(v)]
        if not known:
            return None
        return self._buckets[min(known, key=lambda k: (abs(math.log2(k) - math.log2(key)), k))]

    def _age(self, b: _Bucket, factor: float = 1.0) -> None:
        """Scale the bucket's sums to the current step clock (``AGE_DECAY`` per timed step), times ``factor``."""
        f = factor * AGE_DECAY ** (self._steps - b.sums_at)
        b.sums_at = self._steps
        if f != 1.0:
            b.sums[:] = [v * f for v in b.sums]
            for acc in b.shape_sums.values():
                acc[0], acc[1], acc[2] = acc[0] * f, acc[1] * f, acc[2] * f
            if factor != 1.0:  # (a new verify: shapes not seen for long weigh nothing, drop them)
                b.shape_sums = {key: acc for key, acc in b.shape_sums.items() if acc[0] >= MIN_SHAPE_WEIGHT}

    def _solve(self, b: _Bucket) -> tuple[float, float]:
        """Ridge least squares of ``t / D − 1 = σ + β x`` over the bucket's verify steps (the newest
        weighing most: ``forget`` per step, ``AGE_DECAY`` per timed step), pulled towards the prior
        (σ₀, β₀) with weight ``PRIOR_WEIGHT`` each: when every step had the same draft count, the
        data fix σ + β x there and the prior splits it, instead of a degenerate or wild line."""
        self._age(b)
        lam = PRIOR_WEIGHT
        w, sx, sy, sxx, sxy = b.sums
        a11, a12, a22 = w + lam, sx, sxx + lam
        r1, r2 = sy + lam * self.prior_sigma, sxy + lam * self.prior_beta
        det = a11 * a22 - a12 * a12
        sigma, beta = (r1 * a22 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det
        if beta < 0:  # more tokens never make a step cheaper: the mean overhead, beta = 0
            sigma, beta = r1 / a11, 0.0
        # per (batch, n): the weighted mean of y − σ − β x there, shrunk towards 0
        b.residuals = {key: (wy - sigma * ww - beta * wx) / (ww + RESIDUAL_PRIOR_WEIGHT)
                       for key, (ww, wx, wy) in b.shape_sums.items()}
        return sigma, beta
