"""Acceptance gate: draft for a request only while speculation pays for it.

A verify step costs more than a plain decode step (k + 1 rows instead of 1, and on CUDA it runs
synchronously while plain decode steps overlap the host's work with the GPU); it pays when it yields
more tokens than that ratio. Per request the gate keeps an exponential moving average of *tokens per
verify* (1 + accepted drafts) and per engine the wall time of verify steps and of plain decode steps;
a request drafts while ``tokens_per_verify >= verify_time / decode_time``.

While a request does not draft — and every request starts that way — its proposer still drafts in
the *shadow*: from the accepted tokens, exactly where a speculating request would have, and once the
target's real tokens are known the draft is scored the way greedy verification would have scored it
(its longest prefix equal to the real continuation). That costs one host-side lookup per shadow draft
and nothing on the device, so a request whose text turns repetitive (code that re-states a
signature, a list being rewritten) starts drafting again, and one whose text never repeats never
pays for a verify. For sampled requests the score is the same in expectation: a one-hot draft token
is accepted with probability p(token), the probability that the target samples it.

Only for proposers that declare ``drafts_on_host_for_free`` (n-gram): a draft model's shadow draft
would cost forwards, and the suffix proposer's per-request tries already hold the tokens a shadow
draft from an earlier prefix must not see. The speculator (``speculator.py``) owns the gate and feeds it. Speculation
stays lossless whatever the gate decides (it only chooses between two exact ways to decode), but in
bf16 a verify row and a decode row may round differently, so gated bf16 outputs can differ from
ungated ones where the top-2 logits nearly tie.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Before both step kinds have been timed: a verify step is assumed to cost this many decode steps.
PRIOR_COST_RATIO = 1.5
MIN_TIMED_STEPS = 3


@dataclass
class _RequestState:
    tokens_per_verify: float | None = None  # EMA; None until the first (real or shadow) verify
    drafting: bool = False
    shadow_at: int = 0  # shadow: the position the next shadow draft is proposed at
    shadow_draft: list[int] | None = None  # proposed from tokens[:shadow_at], not scored yet


def _ema(average: float | None, value: float, alpha: float) -> float:
    return value if average is None else (1 - alpha) * average + alpha * value


@dataclass
class _StepCost:
    seconds: float = 0.0  # EMA of a step's wall time
    count: int = 0

    def add(self, seconds: float, alpha: float) -> None:
        self.seconds = _ema(self.seconds if self.count else None, seconds, alpha)
        self.count += 1


class AcceptanceGate:
    """Per-request draft / don't-draft decisions (see the module docstring). Host-only, no weights."""

    def __init__(self, draft: Callable[[Sequence[int], int], list[int]], *, alpha: float = 0.25,
                 cost_alpha: float = 0.1, prior_cost_ratio: float = PRIOR_COST_RATIO) -> None:
        self._draft = draft  # the proposer: (accepted tokens, at most k) -> draft tokens
        self.alpha = alpha
        self.cost_alpha = cost_alpha
        self.prior_cost_ratio = prior_cost_ratio
        self.verify_cost = _StepCost()
        self.decode_cost = _StepCost()
        self._states: dict[str, _RequestState] = {}
        self.num_shadow_drafts = 0  # scored shadow drafts, cumulative

    # ---- costs ---------------------------------------------------------------------------------
    def record_step(self, seconds: float, verified: bool) -> None:
        """Wall time of one engine step that verified drafts (``verified``) or only decoded."""
        (self.verify_cost if verified else self.decode_cost).add(seconds, self.cost_alpha)

    @property
    def cost_ratio(self) -> float:
        """Tokens a verify step must yield to beat plain decoding."""
        if min(self.verify_cost.count, self.decode_cost.count) < MIN_TIMED_STEPS or self.decode_cost.seconds <= 0:
            return self.prior_cost_ratio
        return self.verify_cost.seconds / self.decode_cost.seconds

    # ---- per request ---------------------------------------------------------------------------
    def tokens_per_verify(self, request_id: str) -> float | None:
        st = self._states.get(request_id)
        return None if st is None else st.tokens_per_verify

    def is_drafting(self, request_id: str) -> bool:
        st = self._states.get(request_id)
        return st is not None and st.drafting

    def wants(self, request_id: str, num_tokens: int) -> bool:
        """Whether the request (``num_tokens`` accepted tokens now) should draft its next step. A new
        request, or one that stops drafting, is shadowed from ``num_tokens`` on."""
        st = self._states.get(request_id)
        if st is None:
            st = self._states[request_id] = _RequestState(shadow_at=num_tokens)
        want = st.tokens_per_verify is not None and st.tokens_per_verify >= self.cost_ratio
        if want != st.drafting:
            st.drafting = want
            st.shadow_at, st.shadow_draft = num_tokens, None
        return want

    def record_verify(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """A real verify of ``num_drafts`` > 0 drafts accepted ``num_accepted``."""
        if num_drafts > 0:
            self._update(self._states.setdefault(request_id, _RequestState(drafting=True)), 1 + num_accepted)

    def observe(self, request_id: str, token_ids: Sequence[int], k: int) -> None:
        """New accepted tokens of a request that is not drafting: score its shadow drafts and propose
        the next ones as far as the known tokens allow (drafts of at most ``k`` tokens)."""
        st = self._states.get(request_id)
        if st is None or st.drafting:
            return
        n = len(token_ids)
        while True:
            if st.shadow_draft is None:
                if st.shadow_at > n or k <= 0:
                    return
                st.shadow_draft = self._draft(token_ids[: st.shadow_at], k)
            d, at = st.shadow_draft, st.shadow_at
            if not d:  # no draft: the step would have been a plain decode
                if at + 1 > n:
                    return
                st.shadow_at, st.shadow_draft = at + 1, None
                continue
            acc = 0
            while acc < len(d) and at + acc < n and token_ids[at + acc] == d[acc]:
                acc += 1
            if acc < len(d) and at + acc >= n:
                return  # the continuation is not known far enough yet
            # a verify of d at `at` would have produced acc accepted tokens + one from the target
            self._update(st, 1 + acc)
            self.num_shadow_drafts += 1
            st.shadow_at, st.shadow_draft = at + acc + 1, None

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _update(self, st: _RequestState, tokens: int) -> None:
        st.tokens_per_verify = _ema(st.tokens_per_verify, float(tokens), self.alpha)
