"""Request arrival schedules for ``bench serve``.

Inter-arrival gaps follow vLLM's model:
- ``request_rate = inf``: every request is sent at once (t = 0).
- otherwise gaps ~ Gamma(shape = burstiness, scale = 1 / (rate · burstiness)): mean 1/rate always,
  coefficient of variation 1/sqrt(burstiness). burstiness = 1 is a Poisson process (exponential
  gaps); < 1 is burstier, > 1 more uniform.

The first request goes at t = 0 and request i at the sum of the first i gaps. ``iter_arrivals``
sleeps until each *absolute* scheduled time (measured from its own start), so slow consumers do not
accumulate drift. Schedules come from a seeded ``numpy.random.Generator``: the same seed gives the
same schedule.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

import numpy as np

from tandem.errors import ConfigError

T = TypeVar("T")


def _validate(request_rate: float, burstiness: float) -> None:
    if not request_rate > 0:  # also rejects NaN
        raise ConfigError("--request-rate", f"must be > 0 or inf, got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ConfigError("--burstiness", f"must be a finite number > 0, got {burstiness}")


def inter_arrival_gaps(
    num: int, request_rate: float, burstiness: float = 1.0, seed: int | np.random.Generator = 0
) -> np.ndarray:
    """``num`` gaps in seconds ([num], float64); all zero when ``request_rate`` is inf."""
    _validate(request_rate, burstiness)
    if math.isinf(request_rate):
        return np.zeros(num)
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    if burstiness == 1.0:
        return rng.exponential(1.0 / request_rate, size=num)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num)


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Send time of each request relative to the start ([num]); the first is 0."""
    if num <= 0:
        return np.zeros(0)
    gaps = inter_arrival_gaps(num - 1, request_rate, burstiness, seed)
    return np.concatenate([[0.0], np.cumsum(gaps)])


async def iter_arrivals(
    items: Sequence[T], request_rate: float, burstiness: float = 1.0, seed: int = 0
) -> AsyncIterator[T]:
    """Yield ``items`` in order, each at its scheduled time after the first ``__anext__``."""
    times = arrival_times(len(items), request_rate, burstiness, seed)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for item, at in zip(items, times):
        delay = start + float(at) - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        yield item
