"""Tokenizer adapter of the benchmarks: ``transformers`` tokenizers, ``tokenizers.Tokenizer``, or any object
with ``encode``/``decode``.

Token counts are without special tokens (BOS/EOS) unless a function says otherwise; the server may
add them on top.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.bench.samples import DatasetError


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
