"""The goodput guard: speculation measured against plain decoding as it actually ran, per batch bucket.

The policy decides from a model (per-request acceptance × a fitted step-cost curve). Models can be
wrong in ways that make speculation slower — costs no step records (a verify on an asynchronous
engine drains the pipeline before it and restarts it after), optimistic acceptance, host work of the
proposer. The guard checks the outcome instead: over the steps of the *drafting regime* (verify
steps and the transition steps around them) it compares the time plain decoding would have needed
for the same tokens with the time they took,

    efficiency E = Σ (tokens_i / B_i) · D(B_i)  /  Σ t_i        (decayed sums, newest weighing most)

where D(B) is the measured time of a steady plain decode step of B requests (the cost model's) and
tokens_i the tokens step i emitted. E below ``min_efficiency`` with confidence — ``E + Z·se(E) <
min_efficiency``, se the ratio estimator's standard error over the same decayed steps, after at least
``FAST_WEIGHT`` of them — blocks drafting in that bucket for a cooldown (``cooldown`` steps, doubling after
every failed trial up to ``max_cooldown``; reset after a trial that passes). When the cooldown ends
the sums restart and the policy drafts again as its model says: a trial. Blocking only ever turns
speculation off, so an error of the guard costs a missed gain, never a slowdown; the trials cost at
most ``min_weight`` steps per cooldown, a few when they clearly lose (well under 1 % once the
cooldown has grown).

Why a confidence bound: a step's tokens vary from 1 to k + 1, so E over a few dozen steps is noisy
where the gain is modest. With a fixed threshold (E < 1 after 24 steps, or < 0.85 after 8) an EAGLE
head on the 2-core CPU that gained 1.2× when drafting every step was blocked for 256 steps at its
44th step (E < 0.85 over 8.8 steps, the last a 1-token verify); with one standard error it was
still blocked at step 38 (E 0.92 over 15 steps, in its first short requests). A trial that clearly
loses is still cut short: its E is far below 1 within a few dozen steps (tests/spec_decode/test_policy.py).

A regime that has paid gets a short block (``paid_cooldown``, about the judged window): outcomes
are not independent, and a request's text has stretches where the drafts fail (an EAGLE head on the
2-core CPU: 10–14 verifies in a row emitting 1–2 tokens, E ≈ 0.5, in a run that gained 1.2× drafting
every step), which the confidence bound, made for independent steps, blocks. With the full cooldown
such a stretch switched drafting off for two more 128-token requests at batch 1, a third of that
run's steps (docs/performance.md §41). "Has paid": E ≥ ``min_efficiency`` over ``min_weight`` steps
since the bucket's last block. A regime that never paid starts at ``cooldown`` (a wrong model must
not get cheap trials), and either doubles after each failed trial.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.spec_decode.policy_cost import bucket_of

MIN_EFFICIENCY = 1.0
MIN_WEIGHT = 24.0  # decayed steps of a trial that passes (its cooldown returns to the base)
FAST_WEIGHT = 8.0  # decayed steps before any judgement
Z = 2.0  # standard errors E must stay below min_efficiency by to block
DECAY = 0.97  # per drafting-regime step: ~33 steps of memory
COOLDOWN = 256
PAID_COOLDOWN = 32  # the first block of a regime that has paid (the decay's window)
MAX_COOLDOWN = 8192


@dataclass
class _Regime:
    plain_seconds: float = 0.0  # decayed Σ tokens / B · D(B)
    seconds: float = 0.0  # decayed Σ t
    weight: float = 0.0  # decayed step count
    sq: tuple[float, float, float] = (0.0, 0.0, 0.0)  # Σ w² x², Σ w² x t, Σ w² t² (x: a step's plain seconds)
    blocked_until: int = -1  # step clock
    cooldown: int = COOLDOWN
    trials_failed: int = 0
    paid: bool = False  # E >= min_efficiency over min_weight steps since the last block


class GoodputGuard:
    def __init__(self, *, min_efficiency: float = MIN_EFFICIENCY, min_weight: float = MIN_WEIGHT,
                 decay: float = DECAY, cooldown: int = COOLDOWN, paid_cooldown: int = PAID_COOLDOWN,
                 max_cooldown: int = MAX_COOLDOWN) -> None:
        self.min_efficiency, self.min_weight, self.decay = min_efficiency, min_weight, decay
        self.cooldown, self.paid_cooldown, self.max_cooldown = cooldown, paid_cooldown, max_cooldown
        self._buckets: dict[int, _Regime] = {}
        self._clock = 0
        self.num_blocks = 0  # times a bucket was blocked (cumulative)

    def allows(self, batch: int) -> bool:
        """Whether the policy may draft at this batch size now."""
        b = self._buckets.get(bucket_of(batch))
        return b is None or self._clock >= b.blocked_until

    def tick(self) -> None:
        """One engine step passed (any kind)."""
        self._clock += 1

    def observe(self, batch: int, num_tokens: int, seconds: float, decode_seconds: float | None) -> None:
        """A drafting-regime step of ``batch`` requests that emitted ``num_tokens`` in ``seconds``;
        ``decode_seconds`` is D(batch) (None: not measured yet, the step cannot be judged)."""
        if batch <= 0 or seconds <= 0 or not decode_seconds:
            return
        key = bucket_of(batch)
        b = self._buckets.setdefault(key, _Regime(cooldown=self.cooldown))
        if self._clock < b.blocked_until:
            return  # a step of the blocked regime (a transition or a stray verify): not a trial's
        d, x = self.decay, num_tokens / batch * decode_seconds
        b.plain_seconds = d * b.plain_seconds + x
        b.seconds = d * b.seconds + seconds
        b.weight = d * b.weight + 1.0
        d2, (sxx, sxt, stt) = d * d, b.sq
        b.sq = (d2 * sxx + x * x, d2 * sxt + x * seconds, d2 * stt + seconds * seconds)
        if b.weight < FAST_WEIGHT:
            return
        e = b.plain_seconds / b.seconds
        if e < self.min_efficiency and e + Z * self._std_error(b, e) < self.min_efficiency:
            if b.paid and not b.trials_failed:
                b.cooldown = self.paid_cooldown  # likely a stretch of failing drafts: a short block
            b.blocked_until = self._clock + b.cooldown
            b.trials_failed += 1
            b.cooldown = min(self.max_cooldown, b.cooldown * 2)
            b.plain_seconds = b.seconds = b.weight = 0.0  # the next trial starts afresh
            b.sq = (0.0, 0.0, 0.0)
            b.paid = False
            self.num_blocks += 1
        elif b.weight >= self.min_weight:
            if b.trials_failed:
                b.trials_failed, b.cooldown = 0, self.cooldown  # a trial passed: speculation pays again
            b.paid = b.paid or e >= self.min_efficiency

    @staticmethod
    def _std_error(b: _Regime, e: float) -> float:
        """se(E) of the ratio estimator E = Σ w x / Σ w t: sqrt(Σ w² (x − E t)²) / Σ w t."""
        sxx, sxt, stt = b.sq
        return max(0.0, sxx - 2.0 * e * sxt + e * e * stt) ** 0.5 / b.seconds

    def efficiency(self, batch: int) -> float | None:
        """E for the bucket of ``batch`` (None without evidence)."""
        b = self._buckets.get(bucket_of(batch))
        if b is None or b.seconds <= 0:
            return None
        return b.plain_seconds / b.seconds
