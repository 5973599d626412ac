"""The goodput policy's search: the best N draft slots over a batch (``policy.py`` explains G).

Survival never increases along a draft, so the optimum takes the N best slots over the whole batch
for some N (a prefix of each request's draft): sort the slots, evaluate G at every N and keep N* if
it beats plain decoding by the margin. A step of ``count`` draft tokens costs

    T / D(B) = 1 + max(0, σ + β · count / B + r(count)) + draft(longest draft)

with r the per-shape correction of the step-cost fit (``policy_cost.py``). For a model proposer at
batch 1 (``shape_weights`` given; a batch of B has up to B·k shapes) the shapes are those the policy
granted, and where they cost the same (a float32 verify of 2..5 rows on the 2-core CPU) the line's
slope is only the prior's: it priced an EAGLE head's third draft at +0.25 decode steps, the policy
stopped granting it, and its measurement faded. There a shape's mean is shrunk towards the largest prediction below it (a lower bound: more
tokens never cost less) instead of towards the line, and a shape never measured is predicted at that
bound, so it is tried and then measured.

(Plain Python: at batch 1 a round's numpy calls had cost ~35 µs of a synchronous step.)
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.spec_decode.policy_cost import RESIDUAL_PRIOR_WEIGHT
from tandem.spec_decode.policy_draft import DraftCost


def best_slots(batch: int, surv: Sequence[Sequence[float]], lengths: Sequence[int], sigma: float, beta: float,
               residuals: dict[int, float], shape_weights: dict[int, float] | None, draft: DraftCost,
               margin: float) -> list[int]:
    """k per request: ``surv[i][j]`` the survival of request i's slot j, ``lengths[i]`` its longest
    draft; (σ, β) the line and ``residuals`` its per-shape corrections at this batch size (with their
    ``shape_weights`` for a model proposer, else None); ``draft`` a proposal's cost by its length, in D(B)."""
    n = len(surv)
    # a slot below β never raises the goodput at the margin (adding it gains s, costs G·β/B ≥ β), unless
    # shapes are bounded below (one more slot may cost nothing there)
    least = 0.0 if shape_weights is not None else beta
    slots = [(sv, i, j) for i, (row, m) in enumerate(zip(surv, lengths)) for j, sv in enumerate(row[:m]) if sv > least]
    if not slots:
        return [0] * n
    slots.sort(key=lambda t: -t[0])  # (stable) ties: lower request, then lower position first
    per_slot = beta / batch
    best_g, best_n = -1.0, 0
    total, longest, floor = float(batch), 0, None
    for count, (sv, _, j) in enumerate(slots, 1):
        total += sv
        if j >= longest:
            longest = j + 1
        over = sigma + per_slot * count
        if shape_weights is not None:
            bound = over if floor is None else floor
            if count in residuals:  # the shape's mean, shrunk towards the bound below it
                over += residuals[count] + (bound - over) / (shape_weights[count] + RESIDUAL_PRIOR_WEIGHT)
            else:
                over = bound
            floor = over if floor is None else max(floor, over)
        elif count in residuals:
            over += residuals[count]
        g = total / ((1.0 + over if over > 0.0 else 1.0) + draft.of(longest))
        if g > best_g:
            best_g, best_n = g, count
    if best_g < (1.0 + margin) * batch:
        return [0] * n
    ks = [0] * n
    for _, i, _ in slots[:best_n]:
        ks[i] += 1
    return ks
