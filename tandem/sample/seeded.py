"""A seeded request's randomness, keyed by output position.

A request with ``SamplingParams.seed`` draws the randomness of its n-th output token from a
generator seeded with a hash of (seed, n, purpose), never from a running stream. So the token at
position n depends only on the seed and the target's distribution there, not on how many draws
earlier steps made. That is what lets speculation (which draws k + 1 rows per verify and throws the
rows after a rejection away) and the goodput policy (which decides from wall time whether to draft)
leave a seeded request's output unchanged: with deterministic drafts (n-gram, suffix, greedy EAGLE)
the verify emits at each position exactly the token plain sampling would (``rejection``), so the
same seed gives the same text with speculation on or off, whatever the policy decided.

Purposes separate independent draws at one position: the target's noise row (sampling and
verifying), the acceptance uniform (probabilistic drafts only) and the draft model's own noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NOISE = 0  # the target's Exp(1) row at a position (plain sampling, verify rows)
UNIFORM = 1  # the acceptance test's U[0, 1) for a probabilistic draft at a position
DRAFT = 2  # the draft model's own Exp(1) row when it samples a draft at a position

_MASK64 = (1 << 64) - 1
_SCRATCH: dict[torch.device, torch.Generator] = {}


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit ints that spreads every input bit."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int, purpose: int) -> int:
    """The generator seed of (seed, output position, purpose): a 63-bit int."""
    h = _mix64(seed & _MASK64)
    h = _mix64(h ^ (position & _MASK64))
    return _mix64(h ^ purpose) >> 1


def keyed_generator(key: int, device: torch.device) -> torch.Generator:
    """A generator on ``device`` seeded with ``key``. One scratch generator per device is reseeded
    each call: use it before the next call."""
    dev = torch.device(device)
    g = _SCRATCH.get(dev)
    if g is None:
        g = _SCRATCH[dev] = torch.Generator(device=dev)
    return g.manual_seed(key)


@dataclass(frozen=True)
class SeededStream:
    """The randomness of one seeded request (``params.seed``; child i of ``n`` uses seed + i)."""

    seed: int

    def key(self, position: int, purpose: int) -> int:
        """The 63-bit key of the draws at (output position, purpose)."""
        return position_seed(self.seed, position, purpose)

    def generator(self, position: int, purpose: int, device: torch.device) -> torch.Generator:
        """A generator on ``device`` seeded for (position, purpose) (``keyed_generator``)."""
        return keyed_generator(self.key(position, purpose), device)


Randomness = torch.Generator | SeededStream
