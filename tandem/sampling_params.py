"""SamplingParams: how one request picks its tokens (vLLM-compatible field names).

Validation happens at construction and raises :class:`SamplingParamsError` naming the field, so a bad
request fails before it reaches the engine. Instances are frozen: the engine never mutates them.
``structured_outputs`` (a :class:`StructuredOutputsParams` or a dict of its fields) constrains the output
to a JSON schema, regex, choice or grammar; it is checked here and compiled at request admission.

``output_kind`` (vLLM's ``RequestOutputKind``) says which outputs a request gets while it runs:
CUMULATIVE (the default: every step, the whole text and tokens so far), DELTA (every step, only what
is new) or FINAL_ONLY (one output, when it finishes; ``LLM.generate`` asks for this, so an offline
batch builds no per-step outputs). ``detokenize=False`` (as vLLM) leaves every output's text ""
(the tokens are in ``token_ids``) and skips the per-token detokenizer; stop strings need text, so
they are refused with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

from tandem.errors import SamplingParamsError
from tandem.structured.params import StructuredOutputsParams, coerce

__all__ = ["RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]

_GREEDY_EPS = 1e-5


class RequestOutputKind(IntEnum):
    """vLLM's names and values."""

    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries what is new since the request's previous output
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = field(default=None, hash=False)
    skip_special_tokens: bool = True
    # output constrained to a JSON schema / regex / choice / grammar (tandem/structured/)
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Normalise list-y inputs so callers can pass str/list; frozen → object.__setattr__.
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not all(isinstance(s, str) for s in stop):
            raise SamplingParamsError("stop", "must be a string or a list of strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids or ()
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise SamplingParamsError("stop_token_ids", "must be a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if self.logit_bias is not None:
            try:
                bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()}
            except (TypeError, ValueError):
                raise SamplingParamsError(
                    "logit_bias", "must map token ids to numbers"
                ) from None
            if any(k < 0 for k in bias) or any(not math.isfinite(v) and v != -math.inf for v in bias.values()):
                raise SamplingParamsError(
                    "logit_bias", "token ids must be >= 0 and biases finite (or -inf to ban)"
                )
            object.__setattr__(self, "logit_bias", bias)
        object.__setattr__(self, "structured_outputs", coerce(self.structured_outputs))
        kind = self.output_kind
        if isinstance(kind, bool) or not isinstance(kind, int) or kind not in set(RequestOutputKind):
            allowed = ", ".join(f"{k.name} ({k.value})" for k in RequestOutputKind)
            raise SamplingParamsError("output_kind", f"must be one of {allowed}, got {kind!r}")
        object.__setattr__(self, "output_kind", RequestOutputKind(kind))
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, msg: str) -> None:
            raise SamplingParamsError(name, f"{msg}, got {getattr(self, name)!r}")

        def number(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number")
            return float(v)

        def integer(name: str, optional: bool = False) -> int | None:
            v = getattr(self, name)
            if v is None and optional:
                return None
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, "must be an integer")
            return v

        if integer("n") < 1:  # type: ignore[operator]
            bad("n", "must be >= 1")
        if number("temperature") < 0:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < number("top_p") <= 1.0:
            bad("top_p", "must be in (0, 1]")
        k = integer("top_k")
        if k is not None and k < -1:
            bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not 0.0 <= number("min_p") <= 1.0:
            bad("min_p", "must be in [0, 1]")
        seed = integer("seed", optional=True)
        if seed is not None and not 0 <= seed < 2**63:
            bad("seed", "must be in [0, 2**63)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                bad(name, "must be in [-2, 2]")
        if not 0.0 < number("repetition_penalty") <= 100.0:
            bad("repetition_penalty", "must be in (0, 100]")
        mt = integer("max_tokens", optional=True)
        if mt is not None and mt < 1:
            bad("max_tokens", "must be >= 1")
        mn = integer("min_tokens")
        if mn < 0:  # type: ignore[operator]
            bad("min_tokens", "must be >= 0")
        if mt is not None and mn > mt:  # type: ignore[operator]
            bad("min_tokens", f"must be <= max_tokens ({mt})")
        for name in ("logprobs", "prompt_logprobs"):
            v = integer(name, optional=True)
            if v is not None and not 0 <= v <= 20:
                bad(name, "must be between 0 and 20")
        if not isinstance(self.detokenize, bool):
            bad("detokenize", "must be true or false")
        if not self.detokenize and self.stop:
            raise SamplingParamsError("stop", "stop strings need detokenize=True (the text is not made without it)")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or numerically 0) selects argmax; no randomness is consumed."""
        return self.temperature < _GREEDY_EPS

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    def clone(self, **changes: object) -> SamplingParams:
        from dataclasses import replace

        return replace(self, **changes)
