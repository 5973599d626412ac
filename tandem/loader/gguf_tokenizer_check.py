"""Checks on the tokenizer transformers builds from a GGUF file, against the file itself.

What transformers makes of a GGUF vocabulary depends on its version, and it has been wrong without
a word: for the built-in ``gemma-3-270m`` (an SPM vocabulary of 262k tokens, ``add_bos_token``
true), transformers 5.17 builds a tokenizer that splits common words into pieces (" capital" →
4 tokens) and adds no ``<bos>``, and 5.20-5.22 tokenize right but still add no ``<bos>``. The
model then continues "The capital of France is" with " 1 1 1 1" where it should say " the capital
of the country of France" (found on the H200 machine, which has transformers 5.17). So:

- ``add_bos_token`` / ``add_eos_token`` from the file's metadata are applied to the tokenizer
  (``update_post_processor``), as llama.cpp applies them;
- a sample of the vocabulary must encode back to itself: each sampled token's text, encoded
  without special tokens, must be that one token. A sound tokenizer passes 98-100 % (SmolLM2: 393
  of 400, the misses being lone partial UTF-8 bytes; Gemma: 400 of 400), transformers 5.17's Gemma
  tokenizer 33 %. Below ``MIN_ROUND_TRIP`` the load fails with a ModelLoadError that names the
  transformers version, instead of serving wrong tokens.

Both run once, when the tokenizer is built (the result is cached, see ``tokenizer.py``).
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path
from typing import Any

import transformers

from tandem.errors import ModelLoadError

logger = logging.getLogger(__name__)

SAMPLE_TOKENS = 400
MIN_ROUND_TRIP = 0.9
MIN_VOCAB_TO_CHECK = 1000  # smaller (test) vocabularies give too small a sample to judge


# GGUF metadata value types (gguf spec): fixed sizes, 8 = string, 9 = array
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _BOOL = 8, 9, 7
_FLAG_KEYS = {"tokenizer.ggml.add_bos_token": "add_bos_token", "tokenizer.ggml.add_eos_token": "add_eos_token"}


def gguf_special_token_flags(path: Path) -> dict[str, bool]:
    """``add_bos_token`` / ``add_eos_token`` where the file's metadata states them."""
    found = gguf_header_values(path, dict.fromkeys(_FLAG_KEYS, _BOOL))
    return {_FLAG_KEYS[k]: bool(v) for k, v in found.items()}


def gguf_architecture(path: Path) -> str | None:
    """The file's ``general.architecture`` (``llama``, ``gemma3``, …); None where it has none."""
    value = gguf_header_values(path, {"general.architecture": _STRING}).get("general.architecture")
    return value if isinstance(value, str) else None


def gguf_header_values(path: Path, wanted: dict[str, int]) -> dict[str, bool | str]:
    """The values of the ``wanted`` keys (key → GGUF type: bool or string) that the file states with
    that type. Scans the key-value header only, skipping the vocabulary arrays (``gguf.GGUFReader``
    parses all of them: 13 s for Gemma's 262k tokens, against ~0.3 s here); stops once all are found."""
    found: dict[str, bool | str] = {}
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF" or _u(f, "<I") < 2:
                return found
            _u(f, "<Q")  # tensor count
            for _ in range(_u(f, "<Q")):
                key = f.read(_length(f)).decode("utf-8", "replace")
                vtype = _u(f, "<I")
                if wanted.get(key) == vtype == _BOOL:
                    found[key] = f.read(1) != b"\x00"
                elif wanted.get(key) == vtype == _STRING:
                    found[key] = f.read(_length(f)).decode("utf-8", "replace")
                else:
                    _skip_value(f, vtype)
                    continue
                if len(found) == len(wanted):
                    break
    except (OSError, struct.error, ValueError) as e:  # the model loader reports a bad file itself
        logger.warning("cannot read the GGUF metadata of %s for its tokenizer: %s", path, e)
    return found


def _u(f: Any, fmt: str) -> int:
    return int(struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0])


def _length(f: Any) -> int:
    """A string's byte length, refused when it runs past the end of the file (a damaged header)."""
    n = _u(f, "<Q")
    if n > os.fstat(f.fileno()).st_size - f.tell():
        raise ValueError(f"a string of {n} bytes at offset {f.tell()} runs past the end of the file")
    return n


def _skip_value(f: Any, vtype: int) -> None:
    if vtype == _STRING:
        f.seek(_length(f), 1)
    elif vtype == _ARRAY:
        etype, count = _u(f, "<I"), _u(f, "<Q")
        if etype in _FIXED_SIZES:
            f.seek(_FIXED_SIZES[etype] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, etype)
    elif vtype in _FIXED_SIZES:
        f.seek(_FIXED_SIZES[vtype], 1)
    else:
        raise ValueError(f"unknown GGUF value type {vtype}")


def apply_special_token_flags(tok: Any, flags: dict[str, bool], where: Path) -> None:
    """Make ``tok`` add BOS / EOS exactly as the GGUF metadata says (no-op when it already does)."""
    for name, want in flags.items():
        special_id = tok.bos_token_id if name == "add_bos_token" else tok.eos_token_id
        if special_id is None or _adds(tok, special_id, name) == want:
            continue
        logger.info("%s: transformers %s built a tokenizer with %s=%s; the GGUF says %s, applied",
                    where.name, transformers.__version__, name, not want, want)
        setattr(tok, name, want)
        if hasattr(tok, "update_post_processor"):
            tok.update_post_processor()
        if _adds(tok, special_id, name) != want:
            raise ModelLoadError(
                f"{where.name}: the tokenizer transformers {transformers.__version__} built from this GGUF "
                f"does not honour its {name}={want}; install another transformers version"
            )


def _adds(tok: Any, special_id: int, name: str) -> bool:
    ids = tok("a").input_ids
    return bool(ids) and (ids[0] if name == "add_bos_token" else ids[-1]) == special_id


def round_trip_share(tok: Any, sample: int = SAMPLE_TOKENS) -> tuple[float, list[tuple[int, str, list[int]]]]:
    """Share of an evenly spread sample of non-special tokens whose text encodes back to that token
    alone (tokens that decode to nothing or to a partial UTF-8 byte are skipped), and the misses."""
    n = len(tok)
    special = set(tok.all_special_ids)
    ids = [i for i in range(0, n, max(1, n // sample)) if i not in special][:sample]
    checked, misses = 0, []
    for i in ids:
        text = tok.decode([i])
        if not text.strip() or "\ufffd" in text:
            continue
        checked += 1
        enc = tok.encode(text, add_special_tokens=False)
        if enc != [i]:
            misses.append((i, text, enc[:6]))
    return (1.0 - len(misses) / checked if checked else 1.0), misses


def check_round_trip(tok: Any, where: Path) -> None:
    """ModelLoadError when the tokenizer does not encode its own vocabulary back (see the module doc)."""
    if len(tok) < MIN_VOCAB_TO_CHECK:
        return
    share, misses = round_trip_share(tok)
    if share < MIN_ROUND_TRIP:
        shown = ", ".join(f"{t!r} -> {e}" for _, t, e in misses[:3])
        raise ModelLoadError(
            f"{where.name}: the tokenizer transformers {transformers.__version__} built from this GGUF "
            f"encodes only {100 * share:.0f} % of sampled vocabulary tokens back to themselves (e.g. {shown}); "
            "it would feed the model wrong tokens. Install another transformers version (5.24 builds it right)"
        )


def checked_gguf_tokenizer(tok: Any, path: Path) -> Any:
    """``tok`` with the file's BOS/EOS flags applied, after the round-trip check."""
    check_round_trip(tok, path)
    apply_special_token_flags(tok, gguf_special_token_flags(path), path)
    return tok
