"""Typed errors raised to users.

Every error a user can cause (bad config, bad request, missing model) is one of these, with a message
that names the offending key/field and, where finite, the allowed values. The server maps them to
OpenAI-style 4xx bodies; nothing in the engine uses ``assert`` on user input.
"""

from __future__ import annotations

from collections.abc import Iterable


class TandemError(Exception):
    """Base class of all errors tandem raises on purpose."""


class ConfigError(TandemError, ValueError):
    """A configuration key has a bad value. ``key`` names it; ``allowed`` lists valid values if finite."""

    def __init__(self, key: str, message: str, allowed: Iterable[object] | None = None) -> None:
        self.key = key
        self.allowed = list(allowed) if allowed is not None else None
        text = f"{key}: {message}"
        if self.allowed is not None:
            text += f" (allowed: {', '.join(map(str, self.allowed))})"
        super().__init__(text)


class SamplingParamsError(TandemError, ValueError):
    """An invalid SamplingParams value. ``field`` names the parameter."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"SamplingParams.{field}: {message}")


class ModelLoadError(TandemError):
    """The model could not be found, read or understood."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    def __init__(self, arch: str, supported: Iterable[str]) -> None:
        self.arch = arch
        self.supported = sorted(supported)
        super().__init__(
            f"unsupported model architecture {arch!r}; supported: {', '.join(self.supported)}"
        )


class ChecksumMismatchError(ModelLoadError):
    def __init__(self, path: str, expected: str, actual: str) -> None:
        super().__init__(
            f"checksum mismatch for {path}: expected sha256 {expected}, got {actual}; "
            "the file is corrupt or incomplete — delete it and retry"
        )


class RequestError(TandemError, ValueError):
    """A single request cannot be served (e.g. its prompt is too long). Other requests continue."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        self.param = param
        self.code = code
        super().__init__(message)


class PromptTooLongError(RequestError):
    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"prompt has {num_tokens} tokens, which leaves no room to generate within "
            f"max_model_len={max_model_len}; shorten the prompt or raise max_model_len",
            param="prompt",
            code="context_length_exceeded",
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
