"""Acceptance estimates for the goodput policy: per request and per draft position.

``α[r, j]`` is the probability that draft token j of request r is accepted given tokens 0..j−1 were
(and the draft had a token j). Every scored draft — a real verify, or a shadow draft compared with
the tokens the target produced afterwards — updates the positions it reached: accepted for j <
accepted, rejected at j = accepted when that position was decided. Per request the counts decay
(``forget`` per scored draft, ~10 drafts of memory) and are blended with the engine-wide estimate of
the same position (``prior_weight`` pseudo-counts), which itself starts at ``prior`` and follows every
request's outcomes in a moving average. So a new request starts at what requests have been getting,
and a request whose text turns repetitive (or stops repeating) moves to its own rate within a few
drafts. With ``warm_start`` (a model proposer's: scored on its own rounds only, no shadow drafts)
the engine-wide rates are the mean of the position's outcomes so far (``prior_weight`` pseudo-counts
of the prior) until that weighs less than the moving average's step: with the moving average alone,
8 rounds of an EAGLE head accepting 2.25 tokens per verify on the 2-core CPU left them at 0.49–0.52,
and its new requests never drafted. (Host proposers keep the moving average from the prior: their
shadows bring outcomes by the hundred, and the warm start made n-gram draft more and accept less on
the same CPU — edits 1.50× → 1.44×; docs/performance.md §39.)

With ``optimism`` z (a model proposer's as well), requests are blended with the engine-wide rates
raised by z standard errors, ``g + z·sqrt(g (1 − g) / (n + prior_weight))`` after n outcomes of the
position: an upper confidence bound. A model proposer learns only from the rounds it is granted, so
a pessimistic estimate from its first few rounds was self-fulfilling: on the 2-core CPU an EAGLE
head granted 2 rounds during a warm-up request then sat idle for 64 steps (an exploration's wait,
doubling after each); with the reach weighting below it, the policy kept 0.97–1.14× where drafting
every step gained 1.12–1.37× (float32 target, docs/performance.md §40). The bound
keeps it drafting until its outcomes say otherwise with some confidence; the bonus falls as the
outcomes accumulate (0.25 after 2 at 0.5, 0.05 after 100). The policy scales it by 1 / B at batch B:
a round there brings B outcomes, and a wrong "yes" costs a verify of B drafts (on the 2-core CPU's
packed target at concurrency 8 the unscaled bonus drafted 11–54 % of decisions where drafting
loses, 0.93–0.95× against 0.97–1.02× without it; docs/performance.md §40).

``reach[r, j]`` is the share of the request's proposals that had a token j at all (n-gram finds no
match on fresh text): only the asynchronous-decode prediction (``will_draft``) of a host proposer
needs it, since a free proposer's actual drafts are known before the policy chooses. (A model
proposer's drafts are as long as the policy granted: the policy never weighs them by reach.)

Survival ``s[r, j] = Π_{i≤j} α[r, i]`` is the expected acceptance of slot j; it never increases with j,
so choosing the best slots across requests always takes a prefix of each request's draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
FORGET = 0.85
GLOBAL_ALPHA = 0.02  # EWMA step of the engine-wide per-position rates
REACH_ALPHA = 0.3  # EWMA step of a request's reach
MODEL_OPTIMISM = 1.0  # a model proposer's upper-confidence bonus on the engine-wide rates, in standard errors
MODEL_BLEND_WEIGHT = 6.0  # a model proposer's pull of a request's rates to the engine-wide ones, in drafts
MODEL_IDLE_FORGET = 0.95  # a model proposer's request evidence, per step without a draft scored (half-life ~14)


@dataclass
class _Counts:
    acc: list[float]  # [k] decayed accepted counts per position
    seen: list[float]  # [k] decayed reached counts per position
    reach: list[float]  # [k] EWMA of [proposal had token j]
    num_scored: int = 0
    at: int = 0  # the model's clock when acc / seen were last brought up to date


class AcceptanceModel:
    """(Plain Python over k-long lists: a scored draft and a step's estimates sit on the critical
    path of a synchronous verify step, where numpy's per-call cost on k = 4 elements had made them
    ~40 µs each on the H200's host.)"""

    def __init__(self, k: int, *, prior: float = PRIOR_ACCEPTANCE, prior_weight: float = PRIOR_WEIGHT,
                 forget: float = FORGET, global_alpha: float = GLOBAL_ALPHA, warm_start: bool = False,
                 optimism: float = 0.0, blend_weight: float | None = None, idle_forget: float = 1.0) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior acceptance must be in [0, 1], got {prior}")
        self.k = k
        self.prior_weight, self.forget, self.global_alpha = prior_weight, forget, global_alpha
        self.global_rates = [prior] * k  # engine-wide α_j
        self.warm_start = warm_start
        self.optimism = optimism
        self._blend_weight = blend_weight
        self.idle_forget = idle_forget
        self.clock = 0  # steps (``tick``): a request's counts fade by ``idle_forget`` per step since updated
        self._global_seen = [0] * k  # outcomes each engine-wide rate has followed
        self.global_reach = [1.0] * k
        self._reqs: dict[str, _Counts] = {}
        self.num_scored = 0  # scored drafts, cumulative (real and shadow)

    # ---- updates ---------------------------------------------------------------------------------
    def record(self, request_id: str, draft_len: int, accepted: int, decided: bool = True) -> None:
        """A draft of ``draft_len`` tokens whose first ``accepted`` were accepted; ``decided``: the
        token after them was rejected (or the draft ended there), False when it is still unknown."""
        k = self.k
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _Counts([0.0] * k, [0.0] * k, [1.0] * k, at=self.clock)
        reach, greach, ga = st.reach, self.global_reach, self.global_alpha
        for j in range(k):
            had = 1.0 if j < draft_len else 0.0
            reach[j] += REACH_ALPHA * (had - reach[j])
            greach[j] += ga * (had - greach[j])
        n = min(draft_len, k)
        if n == 0:
            return
        last = min(accepted + 1, n) if decided else min(accepted, n)
        f, acc, seen, rates, gseen = self.forget, st.acc, st.seen, self.global_rates, self._global_seen
        f *= self._idle(st)
        st.at = self.clock
        for j in range(k):
            acc[j] *= f
            seen[j] *= f
        for j in range(last):
            x = 1.0 if j < accepted else 0.0
            acc[j] += x
            seen[j] += 1.0
            gseen[j] += 1
            step = max(ga, 1.0 / (gseen[j] + self.prior_weight)) if self.warm_start else ga
            rates[j] += step * (x - rates[j])
        st.num_scored += 1
        self.num_scored += 1

    @property
    def blend_weight(self) -> float:
        """A request's pull to the engine-wide rates, in drafts (default: ``prior_weight``)."""
        return self.prior_weight if self._blend_weight is None else self._blend_weight

    def tick(self) -> None:
        """One engine step: with ``idle_forget`` < 1, the evidence of requests not scored since fades
        towards the engine-wide rates (a model proposer's request that stopped drafting after a few
        unlucky rounds is asked again later instead of never: it gets no shadow drafts)."""
        self.clock += 1

    def _idle(self, st: _Counts) -> float:
        return 1.0 if self.idle_forget == 1.0 else self.idle_forget ** (self.clock - st.at)

    def prior_rates(self, scale: float = 1.0) -> list[float]:
        """What a request's own counts are blended with: the engine-wide rates, raised by the
        optimism bonus (``scale`` · z standard errors of their outcomes so far)."""
        z = self.optimism * scale
        return [self._raised(j, z) for j in range(self.k)] if z else self.global_rates

    def _raised(self, j: int, z: float) -> float:
        g = self.global_rates[j]
        return min(1.0, g + z * (g * (1.0 - g) / (self._global_seen[j] + self.prior_weight)) ** 0.5) if z else g

    def _blended(self, st: _Counts | None, prior: Sequence[float]) -> list[float]:
        """α[r, j]: a request's decayed counts (faded while idle) blended with ``prior``."""
        if st is None:
            return list(prior)
        w, d = self.blend_weight, self._idle(st)
        return [(d * a + w * g) / (d * n + w) for a, n, g in zip(st.acc, st.seen, prior)]

    def forget_request(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    # ---- estimates -------------------------------------------------------------------------------
    def rates(self, request_id: str, scale: float = 1.0) -> list[float]:
        """α[r, j] for j < k: the request's decayed counts blended with the engine-wide rates (raised
        by ``scale`` times the optimism bonus)."""
        return self._blended(self._reqs.get(request_id), self.prior_rates(scale))

    def survival_matrix(self, request_ids: Sequence[str], with_reach: Sequence[bool],
                        scale: float = 1.0) -> list[list[float]]:
        """Per request, s[r, j] for j < k (times reach[r, j] where ``with_reach``; ``scale``: of the
        optimism bonus)."""
        prior = self.prior_rates(scale)  # (once for the batch)
        out = []
        for rid, wr in zip(request_ids, with_reach):
            st = self._reqs.get(rid)
            s, row = 1.0, []
            for a in self._blended(st, prior):
                s *= a
                row.append(s)
            if wr:
                row = [v * r for v, r in zip(row, st.reach if st is not None else self.global_reach)]
            out.append(row)
        return out

    def survival(self, request_id: str, length: int, with_reach: bool = False) -> list[float]:
        """s[r, j] = Π_{i≤j} α[r, i] for j < ``length``; ``with_reach`` also multiplies by the chance
        that a proposal has a token j at all (for decisions made before the draft is known)."""
        return self.survival_matrix([request_id], [with_reach])[0][: min(length, self.k)]

    def first_survival(self, request_id: str, with_reach: bool = False, scale: float = 1.0) -> float:
        """s[r, 0] (times reach[r, 0] with ``with_reach``): the best slot a request has, cheaply."""
        if not self.k:
            return 0.0
        st = self._reqs.get(request_id)
        g = self._raised(0, self.optimism * scale)
        if st is None:
            return g * (self.global_reach[0] if with_reach else 1.0)
        w, d = self.blend_weight, self._idle(st)
        rate = (d * st.acc[0] + w * g) / (d * st.seen[0] + w)
        return rate * (st.reach[0] if with_reach else 1.0)

    def expected_tokens(self, request_id: str, length: int) -> float:
        """1 + Σ_j s[r, j]: expected tokens from one verify of ``length`` drafts."""
        return 1.0 + sum(self.survival(request_id, length))

    def num_scored_for(self, request_id: str) -> int:
        st = self._reqs.get(request_id)
        return 0 if st is None else st.num_scored


def score_draft(draft: Sequence[int], at: int, token_ids: Sequence[int]) -> tuple[int, bool] | None:
    """Score a draft proposed from ``token_ids[:at]`` against the tokens the target produced since:
    (accepted, decided) as greedy verification would have, or None if not even the first draft
    token is known yet. ``decided`` is False when every known token matched and the draft goes on."""
    n = len(token_ids)
    if at >= n:
        return None
    acc = 0
    while acc < len(draft) and at + acc < n and int(token_ids[at + acc]) == draft[acc]:
        acc += 1
    return acc, acc < len(draft) and at + acc < n or acc == len(draft)
