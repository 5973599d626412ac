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
from dataclasses import dataclass

import numpy as np

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0
FORGET = 0.85
GLOBAL_ALPHA = 0.02  # EWMA step of the engine-wide per-position rates


@dataclass
class _Counts:
    acc: np.ndarray  # [k] decayed accepted counts per position
    seen: np.ndarray  # [k] decayed reached counts per position
    reach: np.ndarray  # [k] EWMA of [proposal had token j]
    num_scored: int = 0


class AcceptanceModel:
    def __init__(self, k: int, *, prior: float = PRIOR_ACCEPTANCE, prior_weight: float = PRIOR_WEIGHT,
                 forget: float = FORGET, global_alpha: float = GLOBAL_ALPHA) -> None:
        if not 0.0 <= prior <= 1.0:
            raise ValueError(f"prior acceptance must be in [0, 1], got {prior}")
        self.k = k
        self.prior_weight, self.forget, self.global_alpha = prior_weight, forget, global_alpha
        self.global_rates = np.full(k, prior)  # engine-wide α_j
        self.global_reach = np.ones(k)
        self._reqs: dict[str, _Counts] = {}
        self._pos = np.arange(k)
        self.num_scored = 0  # scored drafts, cumulative (real and shadow)

    # ---- updates ---------------------------------------------------------------------------------
    def record(self, request_id: str, draft_len: int, accepted: int, decided: bool = True) -> None:
        """A draft of ``draft_len`` tokens whose first ``accepted`` were accepted; ``decided``: the
        token after them was rejected (or the draft ended there), False when it is still unknown."""
        k = self.k
        st = self._reqs.get(request_id)
        if st is None:
            st = self._reqs[request_id] = _Counts(np.zeros(k), np.zeros(k), np.ones(k))
        had = self._pos < draft_len
        st.reach += 0.3 * (had - st.reach)
        self.global_reach += self.global_alpha * (had - self.global_reach)
        n = min(draft_len, k)
        if n == 0:
            return
        last = min(accepted + 1, n) if decided else min(accepted, n)
        st.acc *= self.forget
        st.seen *= self.forget
        x = (self._pos[:last] < accepted).astype(np.float64)
        st.acc[:last] += x
        st.seen[:last] += 1.0
        self.global_rates[:last] += self.global_alpha * (x - self.global_rates[:last])
        st.num_scored += 1
        self.num_scored += 1

    def forget_request(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    # ---- estimates -------------------------------------------------------------------------------
    def rates(self, request_id: str) -> list[float]:
        """α[r, j] for j < k: the request's decayed counts blended with the engine-wide rates."""
        return self._rates(request_id).tolist()

    def _rates(self, request_id: str) -> np.ndarray:
        st = self._reqs.get(request_id)
        if st is None:
            return self.global_rates.copy()
        w = self.prior_weight
        return (st.acc + w * self.global_rates) / (st.seen + w)

    def survival_matrix(self, request_ids: Sequence[str], with_reach: Sequence[bool]) -> np.ndarray:
        """[len(request_ids), k]: s[r, j] (times reach[r, j] where ``with_reach``)."""
        if not request_ids:
            return np.zeros((0, self.k))
        rows = [self._rates(r) for r in request_ids]
        surv = np.cumprod(np.stack(rows), axis=1)
        for i, (rid, wr) in enumerate(zip(request_ids, with_reach)):
            if wr:
                st = self._reqs.get(rid)
                surv[i] *= st.reach if st is not None else self.global_reach
        return surv

    def survival(self, request_id: str, length: int, with_reach: bool = False) -> list[float]:
        """s[r, j] = Π_{i≤j} α[r, i] for j < ``length``; ``with_reach`` also multiplies by the chance
        that a proposal has a token j at all (for decisions made before the draft is known)."""
        return self.survival_matrix([request_id], [with_reach])[0, : min(length, self.k)].tolist()

    def first_survival(self, request_id: str, with_reach: bool = False) -> float:
        """s[r, 0] (times reach[r, 0] with ``with_reach``): the best slot a request has, cheaply."""
        if not self.k:
            return 0.0
        st = self._reqs.get(request_id)
        g = float(self.global_rates[0])
        if st is None:
            return g * (float(self.global_reach[0]) if with_reach else 1.0)
        rate = (float(st.acc[0]) + self.prior_weight * g) / (float(st.seen[0]) + self.prior_weight)
        return rate * (float(st.reach[0]) if with_reach else 1.0)

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
