"""SpeculativeConfig: vLLM's ``speculative_config`` contract, validated up front.

The same dict works for ``LLM(speculative_config={...})``, ``--speculative-config '<json>'`` and the
server. Every mistake a user can make raises one :class:`~tandem.errors.ConfigError` naming the key
(and the allowed values where finite); nothing here asserts.

Layers of validation:

1. :meth:`SpeculativeConfig.from_dict` / :meth:`~SpeculativeConfig.from_json`: unknown keys (with a
   "did you mean"), ``null`` meaning "use the default", method inferred from ``model``.
2. ``__post_init__`` (so direct construction is checked too): types (``bool`` is not an ``int``),
   ranges, method-specific rules, defaults filled in. A constructed config is always complete:
   for ``method="ngram"`` both ``prompt_lookup_min`` and ``prompt_lookup_max`` are set, for
   ``method="suffix"`` the four ``suffix_decoding_*`` keys (vLLM's defaults where not given).
3. :func:`validate_against_target`: checks that need the loaded models (vocabulary, lengths); the
   engine calls it after loading.

vLLM's old top-level flags (``speculative_model=``, ``--ngram-prompt-lookup-max`` …) still work
through :func:`resolve_speculative_config`, with one ``FutureWarning`` per flag naming the new
spelling.

Defaults that differ from vLLM, on purpose:

- ``disable_by_acceptance`` (tandem only, every method): the goodput policy on or off. On, each step
  chooses how many drafts each request verifies (0..``num_speculative_tokens``) to maximise expected
  tokens per second from measured step costs and acceptance (``tandem/spec_decode/policy.py``), so
  a request stops drafting while speculation does not pay and resumes when it does; a guard blocks
  drafting at a batch size where it measurably delivered less than plain decoding. Default (None):
  on; ``false`` drafts up to k every step as vLLM does.
- ``disable_by_batch_size`` (vLLM's V0 key, honoured): no drafts in a step once the running batch
  has at least this many requests. Default None (the policy alone decides).
- n-gram with neither ``prompt_lookup_min`` nor ``prompt_lookup_max`` given: min = 1, max = 5
  (vLLM: 5 and 5). Longest matches are still preferred; min = 1 lets a single repeated token trigger
  a draft, as Hugging Face's prompt-lookup does. One of them given: the other copies it (as vLLM).
"""

from __future__ import annotations

import difflib
import json
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from tandem.config.model import check_quantization
from tandem.config.runner import RunnerConfig
from tandem.config.validate import check_bool, check_choice, check_int, check_str, cli_flag, type_name
from tandem.errors import ConfigError
from tandem.loader.heads import SHIPPED_HEADS, detect_head_kind

SUPPORTED_METHODS: tuple[str, ...] = ("draft_model", "eagle", "eagle3", "ngram", "suffix")
# methods whose ``model`` is a head attached to the target (tandem/models/eagle.py)
EAGLE_METHODS: tuple[str, ...] = ("eagle", "eagle3")
# Methods vLLM knows that tandem will support later; they get "not supported yet", not "unknown".
NOT_YET_SUPPORTED_METHODS: tuple[str, ...] = (
    "mtp",
    "medusa",
    "mlp_speculator",
)
# ``model`` values meaning "no model, n-gram lookup" (vLLM's old ``speculative_model="[ngram]"``).
NGRAM_MODEL_ALIASES: tuple[str, ...] = ("ngram", "[ngram]")
DRAFT_SAMPLE_METHODS: tuple[str, ...] = ("greedy", "probabilistic")
# "synthetic" accepts each draft token with a fixed probability regardless of the models: for
# benchmarking the engine's speculative path at a chosen acceptance rate. Outputs are NOT lossless.
REJECTION_SAMPLE_METHODS: tuple[str, ...] = ("standard", "synthetic")
SUPPORTED_DRAFT_TENSOR_PARALLEL_SIZES: tuple[int, ...] = (1,)
DEFAULT_PROMPT_LOOKUP_MIN = 1
DEFAULT_PROMPT_LOOKUP_MAX = 5
# method "suffix": vLLM's keys and defaults (num_speculative_tokens unset: the tree depth, a maximum).
SUFFIX_DEFAULTS: dict[str, int | float] = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,  # 0: no global tree
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}

# vLLM's old top-level spellings → key inside speculative_config.
DEPRECATED_KWARGS: dict[str, str] = {
    "speculative_model": "model",
    "num_speculative_tokens": "num_speculative_tokens",
    "ngram_prompt_lookup_max": "prompt_lookup_max",
    "ngram_prompt_lookup_min": "prompt_lookup_min",
    "speculative_draft_tensor_parallel_size": "draft_tensor_parallel_size",
    "speculative_max_model_len": "max_model_len",
}
EXAMPLE_JSON = '{"method": "ngram", "num_speculative_tokens": 4}'


@dataclass(frozen=True)
class SpeculativeConfig:
    """How to speculate: which proposer, how many draft tokens (k), how to accept them."""

    method: str  # "draft_model" | "eagle" | "eagle3" | "ngram" | "suffix"
    num_speculative_tokens: int  # k > 0: draft tokens proposed per step (at most)
    model: str | None = None  # draft model / EAGLE head path or alias; None for ngram and suffix
    prompt_lookup_min: int | None = None  # ngram: shortest suffix that may match
    prompt_lookup_max: int | None = None  # ngram: longest suffix tried first
    # suffix (spec_decode/suffix.py); None = vLLM's default (SUFFIX_DEFAULTS), filled in for suffix
    suffix_decoding_max_tree_depth: int | None = None  # longest pattern + draft
    suffix_decoding_max_cached_requests: int | None = None  # finished outputs in the global tree
    suffix_decoding_max_spec_factor: float | None = None  # draft <= factor * match length
    suffix_decoding_min_token_prob: float | None = None  # stop below this continuation probability
    draft_tensor_parallel_size: int = 1
    max_model_len: int | None = None  # no drafts for longer requests (the draft's context); None: the target's
    quantization: str | None = None  # draft quantization (ModelConfig.quantization's values; unset: detected)
    revision: str | None = None  # draft model revision
    enforce_eager: bool | None = None  # draft: no CUDA graphs; None = same as the target
    draft_sample_method: str = "greedy"  # "greedy" | "probabilistic" (draft samples, q kept)
    rejection_sample_method: str = "standard"  # "standard" | "synthetic" (benchmark only)
    synthetic_acceptance_rate: float | None = None  # required iff synthetic, in [0, 1]
    # tandem: the goodput policy (spec_decode/policy.py) on (True; None: on for CUDA) or off (False: k every step)
    disable_by_acceptance: bool | None = None
    disable_by_batch_size: int | None = None  # vLLM: no drafts once the batch has this many requests

    def __post_init__(self) -> None:
        # --- types -------------------------------------------------------------------------------
        check_str("method", self.method)
        if self.num_speculative_tokens is None:
            raise ConfigError(
                "num_speculative_tokens",
                "is required: the number of draft tokens proposed per step (k), e.g. 4",
            )
        check_int("num_speculative_tokens", self.num_speculative_tokens)
        check_str("model", self.model, optional=True)
        check_int("prompt_lookup_min", self.prompt_lookup_min, optional=True)
        check_int("prompt_lookup_max", self.prompt_lookup_max, optional=True)
        check_int("draft_tensor_parallel_size", self.draft_tensor_parallel_size)
        check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, optional=True,
                  minimum=1)
        check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests,
                  optional=True, minimum=0)
        for key, lo, hi in (("suffix_decoding_max_spec_factor", 0.0, math.inf),
                            ("suffix_decoding_min_token_prob", 0.0, 1.0)):
            _check_number(key, getattr(self, key), lo, hi, open_low=key.endswith("factor"))
        check_int("max_model_len", self.max_model_len, optional=True, minimum=1)
        check_str("quantization", self.quantization, optional=True)
        check_str("revision", self.revision, optional=True)
        for key in ("enforce_eager", "disable_by_acceptance"):
            check_bool(key, getattr(self, key), optional=True)
        rate = self.synthetic_acceptance_rate
        if rate is not None and (not isinstance(rate, (int, float)) or isinstance(rate, bool)):
            raise ConfigError(
                "synthetic_acceptance_rate", f"expected a number, got {type_name(rate)} {rate!r}"
            )

        # --- method ------------------------------------------------------------------------------
        method = self.method
        if method == "[ngram]":
            method = "ngram"
            object.__setattr__(self, "method", method)
        if method in NOT_YET_SUPPORTED_METHODS:
            raise ConfigError(
                "method",
                f"speculative method {method!r} is not supported yet",
                allowed=SUPPORTED_METHODS,
            )
        if method not in SUPPORTED_METHODS:
            raise ConfigError(
                "method", f"unknown speculative method {method!r}", allowed=SUPPORTED_METHODS
            )

        if self.num_speculative_tokens < 1:
            raise ConfigError(
                "num_speculative_tokens",
                f"must be > 0, got {self.num_speculative_tokens}; to turn speculation off, "
                "leave speculative_config unset",
            )

        # --- method-specific ---------------------------------------------------------------------
        if method == "ngram":
            self._normalise_ngram()
        elif method == "suffix":
            self._normalise_suffix()
        else:
            self._check_draft_model()
        if method != "suffix":
            for key in SUFFIX_DEFAULTS:
                if getattr(self, key) is not None:
                    raise ConfigError(key, f"only applies to method 'suffix'; drop it for {method!r}")
        check_int("disable_by_batch_size", self.disable_by_batch_size, optional=True, minimum=1)

        if self.draft_tensor_parallel_size not in SUPPORTED_DRAFT_TENSOR_PARALLEL_SIZES:
            raise ConfigError(
                "draft_tensor_parallel_size",
                f"draft tensor parallelism of {self.draft_tensor_parallel_size} is not supported",
                allowed=SUPPORTED_DRAFT_TENSOR_PARALLEL_SIZES,
            )
        check_quantization("quantization", self.quantization)  # resolved against the draft's files at load
        if method != "draft_model" and self.quantization not in (None, "none"):
            what = ("an EAGLE head runs in its checkpoint's float dtype (its linears are small: the target's "
                    "quantization does not apply to it)" if method in EAGLE_METHODS
                    else f"{method} drafts come from token history, with no weights to quantize")
            raise ConfigError("quantization", f"only applies to method 'draft_model': {what}; drop it for "
                              f"{method!r}", allowed=["none"])

        # --- sampling ----------------------------------------------------------------------------
        check_str("draft_sample_method", self.draft_sample_method)
        check_choice("draft_sample_method", self.draft_sample_method, DRAFT_SAMPLE_METHODS)
        if method in ("ngram", "suffix", *EAGLE_METHODS) and self.draft_sample_method != "greedy":
            raise ConfigError(
                "draft_sample_method",
                f"{method} drafts carry no probabilities (one-hot q: lossless all the same), so only "
                f"'greedy' applies to method {method!r}",
                allowed=["greedy"],
            )
        check_str("rejection_sample_method", self.rejection_sample_method)
        check_choice("rejection_sample_method", self.rejection_sample_method, REJECTION_SAMPLE_METHODS)
        if self.rejection_sample_method == "synthetic":
            if rate is None:
                raise ConfigError(
                    "synthetic_acceptance_rate",
                    "is required when rejection_sample_method is 'synthetic' "
                    "(the per-token acceptance probability, between 0 and 1)",
                )
            if math.isnan(rate) or not 0.0 <= rate <= 1.0:
                raise ConfigError(
                    "synthetic_acceptance_rate", f"must be between 0 and 1 inclusive, got {rate}"
                )
        elif rate is not None:
            raise ConfigError(
                "synthetic_acceptance_rate",
                "only applies when rejection_sample_method is 'synthetic' (a benchmark mode); "
                f"rejection_sample_method is {self.rejection_sample_method!r}",
            )

    def _normalise_ngram(self) -> None:
        if self.model is not None and self.model not in NGRAM_MODEL_ALIASES:
            raise ConfigError(
                "model",
                f"method 'ngram' uses no draft model, got model={self.model!r}; drop 'model' "
                "or use method 'draft_model'",
            )
        object.__setattr__(self, "model", None)
        given_lo, given_hi = self.prompt_lookup_min, self.prompt_lookup_max
        if given_lo is not None and given_hi is not None:
            lo, hi = given_lo, given_hi
        elif given_lo is not None:  # one given: the other copies it (as vLLM)
            lo = hi = given_lo
        elif given_hi is not None:
            lo = hi = given_hi
        else:
            lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
        if lo < 1:
            raise ConfigError("prompt_lookup_min", f"must be >= 1, got {lo}")
        if hi < 1:
            raise ConfigError("prompt_lookup_max", f"must be >= 1, got {hi}")
        if lo > hi:
            raise ConfigError(
                "prompt_lookup_min",
                f"prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})",
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _normalise_suffix(self) -> None:
        if self.model is not None:
            raise ConfigError(
                "model", f"method 'suffix' uses no draft model, got model={self.model!r}; drop 'model'"
            )
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, key) is not None:
                raise ConfigError(key, "only applies to method 'ngram'; drop it for 'suffix'")
        for key, default in SUFFIX_DEFAULTS.items():
            if getattr(self, key) is None:
                object.__setattr__(self, key, default)

    def _check_draft_model(self) -> None:
        method = self.method
        if self.model is None:
            what = ("an EAGLE head: a directory or a shipped alias (" + ", ".join(SHIPPED_HEADS) + ")"
                    if method in EAGLE_METHODS else "a draft model: a path, Hugging Face id or built-in alias")
            raise ConfigError("model", f"method {method!r} needs {what}")
        if method in EAGLE_METHODS:
            kind = detect_head_kind(self.model)
            if kind is not None and kind != method:
                raise ConfigError(
                    "method",
                    f"{self.model!r} is an {kind!r} head, not {method!r}; use method {kind!r} (or omit method)",
                    allowed=[kind],
                )
        if self.model in NGRAM_MODEL_ALIASES:
            raise ConfigError(
                "model",
                f"{self.model!r} selects n-gram lookup, not a draft model; use method 'ngram'",
            )
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, key) is not None:
                raise ConfigError(key, f"only applies to method 'ngram'; drop it for {method!r}")

    # --- construction ----------------------------------------------------------------------------

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> SpeculativeConfig:
        """Build from vLLM's ``speculative_config`` dict.

        ``null`` for a key means "use its default". ``method`` may be omitted when ``model`` is
        given: ``"ngram"``/``"[ngram]"`` select n-gram lookup, an EAGLE head (a shipped alias or a
        directory whose config says which) its method, anything else a draft model.
        """
        if not isinstance(d, Mapping):
            raise ConfigError(
                "speculative_config",
                f"expected an object / dict such as {EXAMPLE_JSON}, got {type_name(d)}",
            )
        known = _field_names()
        for key in d:
            if key not in known:
                raise ConfigError(str(key), _unknown_key_message(key, known))
        defaults = _field_defaults()
        values = {k: v for k, v in d.items() if not (v is None and defaults.get(k) is not None)}
        if values.get("num_speculative_tokens") is None and values.get("method") == "suffix":
            depth = values.get("suffix_decoding_max_tree_depth")  # vLLM: k defaults to the depth
            ok = isinstance(depth, int) and not isinstance(depth, bool) and depth >= 1
            values["num_speculative_tokens"] = depth if ok else SUFFIX_DEFAULTS["suffix_decoding_max_tree_depth"]
        if values.get("num_speculative_tokens") is None:
            raise ConfigError(
                "num_speculative_tokens",
                "is required: the number of draft tokens proposed per step (k), e.g. 4",
            )
        if values.get("method") is None:
            model = values.get("model")
            if model is None:
                raise ConfigError(
                    "method",
                    "is required when no draft model is given, e.g. " + EXAMPLE_JSON,
                    allowed=SUPPORTED_METHODS,
                )
            # as vLLM: an EAGLE checkpoint (or shipped head alias) selects its own method
            head = None if model in NGRAM_MODEL_ALIASES else detect_head_kind(str(model))
            values["method"] = "ngram" if model in NGRAM_MODEL_ALIASES else (head or "draft_model")
        return SpeculativeConfig(**values)

    @staticmethod
    def from_json(s: str) -> SpeculativeConfig:
        """Parse ``--speculative-config '<json>'``."""
        if not isinstance(s, str):
            raise ConfigError(
                "speculative_config", f"expected a JSON string, got {type_name(s)}"
            )
        try:
            d = json.loads(s)
        except json.JSONDecodeError as e:
            raise ConfigError(
                "speculative_config",
                f"is not valid JSON ({e.msg} at line {e.lineno} column {e.colno}); expected an "
                f"object such as '{EXAMPLE_JSON}' (keys and strings in double quotes)",
            ) from None
        if not isinstance(d, dict):
            raise ConfigError(
                "speculative_config",
                f"expected a JSON object such as '{EXAMPLE_JSON}', got {type_name(d)}",
            )
        return SpeculativeConfig.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        """All fields, defaults included; ``from_dict(cfg.to_dict()) == cfg``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> str:
        """The ``--speculative-config`` value that rebuilds this config."""
        return json.dumps(self.to_dict())

    def draft_runner_config(self, target: RunnerConfig) -> RunnerConfig:
        """The draft model's runner config: the target's, without CUDA graphs if ``enforce_eager``."""
        if self.enforce_eager is None:
            return target
        return replace(target, cuda_graphs=not self.enforce_eager)

    @property
    def is_synthetic(self) -> bool:
        """Acceptance is simulated (benchmark mode): outputs are not the target's distribution."""
        return self.rejection_sample_method == "synthetic"


def _check_number(key: str, value: object, lo: float, hi: float, *, open_low: bool) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(key, f"expected a number, got {type_name(value)} {value!r}")
    if not math.isfinite(value) or value > hi or value < lo or (open_low and value == lo):
        rng = f"a finite number > {lo:g}" if hi == math.inf else f"between {lo:g} and {hi:g} inclusive"
        raise ConfigError(key, f"must be {rng}, got {value}")


def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in fields(SpeculativeConfig))


def _field_defaults() -> dict[str, Any]:
    # Required fields map to MISSING (not None), so `null` for them means "not given" too.
    return {f.name: f.default for f in fields(SpeculativeConfig)}


def _unknown_key_message(key: object, known: tuple[str, ...]) -> str:
    msg = f"unknown speculative_config key {key!r}"
    if isinstance(key, str) and key in DEPRECATED_KWARGS:
        msg += f"; inside speculative_config it is spelled {DEPRECATED_KWARGS[key]!r}"
    elif isinstance(key, str):
        close = difflib.get_close_matches(key, known, n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
    return msg + f" (known keys: {', '.join(known)})"


def validate_against_target(
    cfg: SpeculativeConfig,
    *,
    target_vocab_size: int,
    draft_vocab_size: int | None,
    target_max_model_len: int,
    draft_max_model_len: int | None,
) -> None:
    """Checks that need the loaded models; the engine calls this after loading them.

    ``draft_vocab_size`` / ``draft_max_model_len`` are None when there is no draft model (n-gram).
    """
    if cfg.method == "draft_model" and draft_vocab_size is not None:
        if draft_vocab_size != target_vocab_size:
            raise ConfigError(
                "model",
                f"draft vocabulary ({draft_vocab_size}) differs from the target's "
                f"({target_vocab_size}); the draft model {cfg.model!r} must share the target's "
                "tokenizer and vocabulary size",
            )
    if cfg.max_model_len is not None:
        if cfg.max_model_len > target_max_model_len:
            raise ConfigError(
                "max_model_len",
                f"speculative max_model_len ({cfg.max_model_len}) is larger than the target's "
                f"({target_max_model_len}); lower it or leave it unset",
            )
        if draft_max_model_len is not None and cfg.max_model_len > draft_max_model_len:
            raise ConfigError(
                "max_model_len",
                f"speculative max_model_len ({cfg.max_model_len}) is larger than the draft "
                f"model's ({draft_max_model_len}); lower it or leave it unset",
            )


# --- vLLM's deprecated spellings -----------------------------------------------------------------


def _deprecation_message(old: str, value: Any) -> str:
    new = DEPRECATED_KWARGS[old]
    return (
        f"`{old}` ({cli_flag(old)}) is deprecated; use speculative_config={{{new!r}: {value!r}}} "
        f"(--speculative-config '{json.dumps({new: value})}')"
    )


def resolve_speculative_config(
    speculative_config: str | Mapping[str, Any] | SpeculativeConfig | None,
    deprecated: Mapping[str, Any],
) -> SpeculativeConfig | None:
    """One SpeculativeConfig (or None: no speculation) from the new and the old spellings.

    ``speculative_config`` is a JSON string (CLI), a dict (Python API) or a ready config.
    ``deprecated`` holds vLLM's old top-level kwargs that were given (None values are ignored);
    each emits one ``FutureWarning`` naming its replacement. Mixing the two raises.
    """
    unknown = [k for k in deprecated if k not in DEPRECATED_KWARGS]
    if unknown:
        raise ConfigError(
            str(unknown[0]), "is not a deprecated speculative option", allowed=DEPRECATED_KWARGS
        )
    given = {k: v for k, v in deprecated.items() if v is not None}
    if given:
        if speculative_config is not None:
            raise ConfigError(
                "speculative_config",
                "cannot be combined with deprecated "
                + ", ".join(f"{k} ({cli_flag(k)})" for k in given)
                + "; move them into speculative_config",
            )
        for old, value in given.items():
            warnings.warn(_deprecation_message(old, value), FutureWarning, stacklevel=2)
        if "speculative_model" not in given:
            raise ConfigError(
                "speculative_model",
                "is required when using the deprecated speculative options ("
                + ", ".join(given)
                + "); better, pass speculative_config instead",
            )
        return SpeculativeConfig.from_dict({DEPRECATED_KWARGS[k]: v for k, v in given.items()})
    if speculative_config is None:
        return None
    if isinstance(speculative_config, SpeculativeConfig):
        return speculative_config
    if isinstance(speculative_config, str):
        return SpeculativeConfig.from_json(speculative_config)
    if isinstance(speculative_config, Mapping):
        return SpeculativeConfig.from_dict(speculative_config)
    raise ConfigError(
        "speculative_config",
        "expected a JSON string, a dict or a SpeculativeConfig, got "
        f"{type_name(speculative_config)}",
    )
