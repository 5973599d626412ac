"""``SampleRequest``, the one prompt every benchmark dataset loader returns, and what the loaders share."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Any

from tandem.errors import TandemError

# Every dataset warning under one logger name, as before datasets.py was split.
logger = logging.getLogger("tandem.bench.datasets")


class DatasetError(TandemError, ValueError):
    """A dataset cannot be loaded or sampled (missing package, bad file, bad arguments)."""


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark prompt. ``prompt`` is text, or a list of chat messages for chat endpoints."""

    prompt: str | list[dict[str, Any]]
    prompt_len: int
    expected_output_len: int


def oversample(requests: list[SampleRequest], num_requests: int, seed: int, name: str) -> list[SampleRequest]:
    if len(requests) >= num_requests:
        return requests[:num_requests]
    if not requests:
        raise DatasetError(f"{name}: no prompt passed the filters; nothing to benchmark")
    rng = random.Random(seed)
    extra = rng.choices(requests, k=num_requests - len(requests))
    logger.warning(
        "%s: only %d usable prompts for --num-prompts %d; oversampled %d with seed %d",
        name, len(requests), num_requests, len(extra), seed,
    )
    return requests + extra


def check_num_requests(num_requests: int) -> None:
    if num_requests < 1:
        raise DatasetError(f"--num-prompts must be >= 1, got {num_requests}")
