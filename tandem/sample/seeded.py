"""A seeded request's randomness, keyed by output position.

A request with ``SamplingParams.seed`` draws the randomness of its n-th output token — one uniform,
the inverse-CDF draw of ``sampler.inverse_cdf`` — as a hash of (seed, n, purpose) computed on the
host, never from a running stream. So the token at
position n depends only on the seed and the target's distribution there, not on how many draws
earlier steps made. That is what lets speculation (which draws k + 1 rows per verify and throws the
rows after a rejection away) and the goodput policy (which decides from wall time whether to draft)
leave a seeded request's output unchanged: with deterministic drafts (n-gram, suffix, greedy EAGLE)
the verify emits at each position exactly the token plain sampling would (``rejection``), so the
same seed gives the same text with speculation on or off, whatever the policy decided.

Purposes separate independent draws at one position: the target's sampling uniform (sampling and
verifying), the acceptance uniform (probabilistic drafts only) and the draft model's own draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOISE = 0  # the target's sampling uniform at a position (plain sampling, verify rows)
UNIFORM = 1  # the acceptance test's U[0, 1) for a probabilistic draft at a position
DRAFT = 2  # the draft model's own sampling uniform when it samples a draft at a position

_MASK64 = (1 << 64) - 1
_GRID = 2.0 ** -24


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int, purpose: int) -> int:
    """The key of (seed, output position, purpose): a 63-bit int."""
    h = _mix64(seed & _MASK64)
    h = _mix64(h ^ (position & _MASK64))
    return _mix64(h ^ purpose) >> 1


@dataclass(frozen=True)
class SeededStream:
    """The randomness of one seeded request (``params.seed``; child i of ``n`` uses seed + i)."""

    seed: int

    def key(self, position: int, purpose: int) -> int:
        """The 63-bit key of the draw at (output position, purpose)."""
        return position_seed(self.seed, position, purpose)

    def uniform(self, position: int, purpose: int) -> float:
        """The draw at (position, purpose): the key's top 24 bits as a multiple of 2**-24 in
        [0, 1 − 2**-24] (exact in float32, like ``sampler.draw_rows``' other uniforms below 1)."""
        return (self.key(position, purpose) >> 39) * _GRID


Randomness = torch.Generator | SeededStream
