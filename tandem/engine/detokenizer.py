"""Incremental detokenization and stop-string handling for one output sequence.

Decoding token by token breaks multi-byte characters (a UTF-8 character split across byte-level
BPE tokens decodes to U+FFFD until its last byte arrives) and words whose leading space depends on
the previous token. We keep two offsets into the output ids: text is produced by decoding
``ids[prefix:]`` and subtracting the decode of ``ids[prefix:read]``; new text is released only once
it no longer ends in an incomplete character. Cost per token is O(window), not O(length).

Stop strings: the released text is searched (only the tail that could contain a new match); on a
match the text is cut before the stop string (or after it with include_stop_str_in_output).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_REPLACEMENT = "\ufffd"
_INITIAL_WINDOW = 5


class _BackendDecoder:
    """``decode`` through a fast tokenizer's Rust backend, skipping transformers' per-call Python
    layer (argument conversion that walks every id: ~20 µs of a ~22 µs decode here). Only used when
    ``fast_decoder`` found the two give the same text."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


class _NoText:
    """The decoder of an engine without a tokenizer (``skip_tokenizer_init``): every output's text stays ""."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return ""


NO_TEXT = _NoText()

_PROBE = "Hi . Yes ? No ! a , b ' c n't d 'm e 's f 've g 're h  x\n\ty é 日本"


def fast_decoder(tokenizer: Any) -> Any:
    """What the detokenizers should call ``decode`` on: the tokenizer's backend when a probe
    (special tokens and the spacing patterns transformers' clean-up rewrites) decodes identically
    through both, with and without ``skip_special_tokens``; otherwise the tokenizer itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return tokenizer
    try:
        special = [int(i) for i in getattr(tokenizer, "all_special_ids", [])][:8]
        ids = special + list(tokenizer.encode(_PROBE, add_special_tokens=False)) + special
        for skip in (True, False):
            if tokenizer.decode(ids, skip_special_tokens=skip) != backend.decode(ids, skip_special_tokens=skip):
                return tokenizer
    except Exception:  # noqa: BLE001 - any surprise: keep transformers' own decode
        return tokenizer
    return _BackendDecoder(backend)


@dataclass
class IncrementalDetokenizer:
    tokenizer: Any
    prompt_token_ids: list[int]
    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    text: str = ""
    _ids: list[int] = field(default_factory=list)
    _prefix: int = 0
    _read: int = 0

    def __post_init__(self) -> None:
        # Seed the window with the prompt's last tokens so the first output token gets its
        # leading-space handling right.
        tail = self.prompt_token_ids[-_INITIAL_WINDOW:]
        self._ids = list(tail)
        self._prefix = 0
        self._read = len(tail)
        self._max_stop = max((len(s) for s in self.stop), default=0)

    @property
    def stable_text_len(self) -> int:
        """How much of ``text`` no later stop match can cut: all of it without stop strings, else
        all but the last ``longest stop - 1`` characters (where a match may be starting)."""
        return max(0, len(self.text) - self._max_stop + 1) if self.stop else len(self.text)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str | None:
        """Append one token; return the stop string if the text now hits one, else None."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        full = self._decode(self._ids[self._prefix:])
        if len(full) > len(prefix_text) and not full.endswith(_REPLACEMENT):
            new = full[len(prefix_text):]
            self._prefix = self._read
            self._read = len(self._ids)
            start = max(0, len(self.text) - self._max_stop + 1)
            self.text += new
            if self.stop:
                return self._check_stop(start)
        return None

    def _check_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            if not s:
                continue
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
        return s
