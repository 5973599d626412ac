"""Synthetic benchmark prompts of exact token lengths: ``random`` and ``prefix_repetition``.

Prompts are built from random token ids that round-trip through the tokenizer on their own
(:class:`TokenSampler`), decoded to text and fitted to the target length
(:func:`fit_text_to_length`), so the server sees the asked-for number of tokens.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from tandem.bench.samples import DatasetError, SampleRequest, check_num_requests
from tandem.bench.tokens import decode, encode, num_special_tokens_to_add, special_ids, vocab_size

# Every dataset warning under one logger name, as before datasets.py was split.
logger = logging.getLogger("tandem.bench.datasets")

# Fix-up rounds used to land a decoded random prompt on an exact token length (vLLM uses 10).
MAX_FIXUP_ROUNDS = 32


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
    check_num_requests(num_requests)
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
    check_num_requests(num_requests)
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
