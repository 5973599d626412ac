"""Field checks shared by every config dataclass: one ConfigError naming the key, never an assert."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.errors import ConfigError


def cli_flag(key: str) -> str:
    """A config key's command-line spelling (vLLM's): ``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + key.replace("_", "-")


def type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def check_int(key: str, value: object, *, minimum: int | None = None, optional: bool = False) -> None:
    if value is None and optional:
        return
    # bool is a subclass of int; `"num_speculative_tokens": true` is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(key, f"expected an integer, got {type_name(value)} {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")


def check_str(key: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise ConfigError(key, f"expected a string, got {type_name(value)} {value!r}")


def check_bool(key: str, value: object, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, bool):
        allowed = "true, false or null" if optional else "true or false"
        raise ConfigError(key, f"expected {allowed}, got {type_name(value)} {value!r}")


def check_choice(key: str, value: object, allowed: Sequence[object]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"unknown value {value!r}", allowed=tuple(allowed))
