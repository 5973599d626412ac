"""Acceptance estimates for the goodput policy: per request and per draft position.

``α[r, j]`` is the probability that draft token j of request r is accepted given tokens 0..j−1 were
(and the draft had a token j). Every scored draft — a real verify, or a shadow draft compared with
the tokens the target produced afterwards — updates the positions it reached: accepted for j <
accepted, rejected at j = accepted when that position was decided. Per request the counts decay
(``forget`` per scored draft, ~10 drafts of memory) and are blended with the engine-wide estimate of
the same position (``prior_weight`` pseudo-counts), which itself starts at ``prior`` and follows every
request's outcomes. So a new request starts at what requests have been getting, and a request whose
text turns repetitive (or stops repeating) moves to its own rate within a few drafts.

``reach[r, j]`` is the share of the request's proposals that had a token j at all (n-gram finds no
match on fresh text): only the asynchronous-decode prediction (``will_draft``) needs it, since a
free proposer's actual drafts are known before the policy chooses.

Survival ``s[r, j] = Π_{i≤j} α[r, i]`` is the expected acceptance of slot j; it never increases with j,
so choosing the best slots across requests always takes a prefix of each request's draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
FORGET = 0.85
GLOBAL_ALPHA = 0.02  # EWMA step of the engine-wide per-position rates


@dataclass
class _Counts:
    acc: list[float] = field(default_factory=list)  # decayed accepted counts per position
    seen: list[float] = field(default_factory=list)  # decayed reached counts per position
    reach: list[float] = field(default_factory=list)  # EWMA of [proposal had token j]
    num_scored: int = 0

    def grow(self, n: int) -> None:
        while len(self.acc) < n:
            self.acc.append(0.0)
            self.seen.append(0.0)
            self.reach.append(1.0)


class AcceptanceModel:
    def __init__(self, k: int, *, prior: float = PRIOR_ACCEPTANCE, prior_weight: float = PRIOR_WEIGHT,
                 forget: float = FORGET, global_alpha: float = GLOBAL_ALPHA) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior acceptance must be in [0, 1], got {prior}")
        self.k = k
        self.prior_weight, self.forget, self.global_alpha = prior_weight, forget, global_alpha
        self.global_rates = [prior] * k  # engine-wide α_j
        self.global_reach = [1.0] * k
        self._reqs: dict[str, _Counts] = {}
        self.num_scored = 0  # scored drafts, cumulative (real and shadow)

    # ---- updates ---------------------------------------------------------------------------------
    def record(self, request_id: str, draft_len: int, accepted: int, decided: bool = True) -> None:
        """A draft of ``draft_len`` tokens whose first ``accepted`` were accepted; ``decided``: the
        token after them was rejected (or the draft ended there), False when it is still unknown."""
        st = self._reqs.setdefault(request_id, _Counts())
        n = min(draft_len, self.k)
        st.grow(self.k)
        for j in range(self.k):
            st.reach[j] += 0.3 * ((1.0 if j < draft_len else 0.0) - st.reach[j])
            self.global_reach[j] += self.global_alpha * ((1.0 if j < draft_len else 0.0) - self.global_reach[j])
        if n == 0:
            return
        for j in range(self.k):
            st.acc[j] *= self.forget
            st.seen[j] *= self.forget
        last = min(accepted + 1, n) if decided else min(accepted, n)
        for j in range(last):
            x = 1.0 if j < accepted else 0.0
            st.acc[j] += x
            st.seen[j] += 1.0
            self.global_rates[j] += self.global_alpha * (x - self.global_rates[j])
        st.num_scored += 1
        self.num_scored += 1

    def forget_request(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    # ---- estimates -------------------------------------------------------------------------------
    def rates(self, request_id: str) -> list[float]:
        """α[r, j] for j < k: the request's decayed counts blended with the engine-wide rates."""
        st = self._reqs.get(request_id)
        w = self.prior_weight
        if st is None or not st.acc:
            return list(self.global_rates)
        return [(st.acc[j] + w * g) / (st.seen[j] + w) for j, g in enumerate(self.global_rates)]

    def survival(self, request_id: str, length: int, with_reach: bool = False) -> list[float]:
        """s[r, j] = Π_{i≤j} α[r, i] for j < ``length``; ``with_reach`` also multiplies by the chance
        that a proposal has a token j at all (for decisions made before the draft is known)."""
        out, s = [], 1.0
        rates = self.rates(request_id)
        st = self._reqs.get(request_id)
        reach = st.reach if st is not None and st.reach else self.global_reach
        for j in range(min(length, self.k)):
            s *= rates[j]
            out.append(s * (reach[j] if with_reach else 1.0))
        return out

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
