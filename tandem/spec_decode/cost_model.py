"""Expected speculative gains from acceptance (Leviathan et al., 2023, with a verify-cost term).

With per-token acceptance α (i.i.d. across positions) and k drafts per step, a verify step emits
    τ = E[tokens per step] = 1 + α + … + α^k = (1 − α^{k+1}) / (1 − α)        (α = 1: k + 1)
tokens, and costs k·c + 1 + v target-step units (c = draft step time / target step time, v = extra
cost of verifying k + 1 query tokens over decoding one). The cost-model speedup over plain decoding:
    S = (1 − α^{k+1}) / ((1 − α)(k·c + 1 + v))
Engine efficiency η = measured speedup / S.
"""

from __future__ import annotations

from collections.abc import Sequence


def _check(alpha: float, k: int) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """τ: expected tokens emitted per verify step (accepted drafts + the recovered/bonus token)."""
    _check(alpha, k)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_tokens_from_position_rates(rates: Sequence[float]) -> float:
    """τ from per-position acceptance rates a_i (P(accept i | reached i)): 1 + Σ_i Π_{j≤i} a_j."""
    total, reach = 1.0, 1.0
    for i, a in enumerate(rates):
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"acceptance rate at position {i} must be in [0, 1], got {a}")
        reach *= a
        total += reach
    return total


def cost_model_speedup(alpha: float, k: int, c: float, v: float = 0.0) -> float:
    """S = (1 − α^{k+1}) / ((1 − α)(k·c + 1 + v)); α = 1 gives (k + 1) / (k·c + 1 + v)."""
    _check(alpha, k)
    if c < 0 or v < 0:
        raise ValueError(f"c and v must be >= 0, got c={c}, v={v}")
    return expected_tokens_per_step(alpha, k) / (k * c + 1.0 + v)
