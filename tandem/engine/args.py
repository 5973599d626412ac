"""Engine arguments (vLLM's ``EngineArgs``): ``LLM(**kwargs)`` and the engine flags, both from the config fields.

One builder, :func:`engine_config`, turns ``LLM(model, **kwargs)`` into an :class:`EngineConfig`;
the command line reaches it through :func:`engine_kwargs`. Neither restates a default: a key that
is not given is not passed, and the config dataclass fills it in.

Keyword arguments (``ENGINE_KWARGS``): every field of ModelConfig (but ``model``, which is
positional), CacheConfig and SchedulerConfig by its own name; ``runner_config`` (a RunnerConfig or a
dict of its fields); ``enforce_eager`` (vLLM: ``True`` sets ``RunnerConfig.cuda_graphs = False``);
``speculative_config`` (JSON string, dict or SpeculativeConfig); ``log_stats``; vLLM's
deprecated speculative keywords (``speculative_model`` …, each warns once); and the vLLM arguments
that configure nothing here (:mod:`tandem.config.compat`: ``trust_remote_code``, ``swap_space``,
``tensor_parallel_size`` …; accepted with a warning where tandem differs, or refused).

Flags (:func:`add_engine_args`, shared by ``generate``, ``serve``, ``bench latency`` and ``bench
throughput``): one per field of ModelConfig (but ``model``), CacheConfig, SchedulerConfig and
RunnerConfig: ``name`` -> ``--name-in-kebab-case``, a ``bool`` field -> ``--name/--no-name``, the
value type from the field's annotation, argparse's default read from the field; plus
``--enforce-eager``, ``--speculative-config``, vLLM's deprecated speculation flags and the
compatibility flags of :mod:`tandem.config.compat` (``--trust-remote-code``, ``--swap-space``,
``-tp/--tensor-parallel-size``, ``-pp/--pipeline-parallel-size``, ``--enable-chunked-prefill``). A bad value
is one ConfigError naming the key; an unknown keyword is a TypeError, as for any Python call.
"""

from __future__ import annotations

import argparse
import difflib
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, Field, fields
from typing import Any

from tandem.config.cache import BLOCK_SIZES, CacheConfig
from tandem.config.compat import COMPAT_KWARGS, VLLM_COMPAT_ARGS, apply_vllm_compat
from tandem.config.engine import EngineConfig
from tandem.config.model import DTYPES, LOAD_FORMATS, ModelConfig
from tandem.config.runner import MULTIROW_MODES, RUNNER_BACKENDS, RunnerConfig
from tandem.config.scheduler import DEFAULT_TOKEN_BUDGET, SchedulerConfig
from tandem.config.speculative import (
    DEPRECATED_KWARGS,
    EXAMPLE_JSON,
    SpeculativeConfig,
    resolve_speculative_config,
)
from tandem.config.validate import check_bool, cli_flag, type_name
from tandem.errors import ConfigError

# Configs whose fields are top-level keyword arguments of LLM(); RunnerConfig's go in runner_config.
KWARG_CONFIGS: tuple[type, ...] = (ModelConfig, CacheConfig, SchedulerConfig)
FLAG_CONFIGS: tuple[type, ...] = (*KWARG_CONFIGS, RunnerConfig)
POSITIONAL = frozenset({"model"})  # ModelConfig.model: the positional MODEL of LLM() and each command

# vLLM's `bench throughput --backend` picks the inference library; the runner's backend must not look like it.
_FLAG_NAMES = {"backend": "--runner-backend"}

# Help per field (a field may instead carry metadata={"help": ...}); tests/test_config.py checks every field has one.
_HELP: dict[str, str] = {
    # ModelConfig
    "tokenizer": "tokenizer directory or alias (default: the model's)",
    "dtype": "weight/activation dtype: auto | " + " | ".join(DTYPES)
             + " (auto: float32 on CPU, the checkpoint's half type or bfloat16 on GPU)",
    "device": "auto | cpu | cuda | cuda:N (auto: cuda if available)",
    "seed": "random seed of the engine (and of offline benchmark workloads)",
    "load_format": " | ".join(LOAD_FORMATS) + " (dummy: random weights at the checkpoint's shapes)",
    "revision": "model revision (vLLM compatibility: hubs are unreachable, so only unset works)",
    "max_model_len": "context length limit (default: the checkpoint's max_position_embeddings)",
    "skip_tokenizer_init": "load no tokenizer (vLLM's): prompts must be token ids and outputs have empty text; "
                           "LLM(...) only, not serve",
    # CacheConfig
    "block_size": "KV cache block size in tokens: " + " | ".join(map(str, BLOCK_SIZES)),
    "gpu_memory_utilization": "fraction of GPU memory the engine may use (weights + KV cache)",
    "kv_cache_memory_bytes": "KV cache size in bytes; overrides --gpu-memory-utilization "
                             "(default: sized from the free device memory, or on CPU from the free RAM)",
    "enable_prefix_caching": "reuse the KV of cached full blocks of shared prefixes (as vLLM)",
    # SchedulerConfig
    "max_num_seqs": "most sequences in one step",
    "max_num_batched_tokens": f"most tokens in one step; longer prompts are prefilled in chunks "
                              f"(default: {DEFAULT_TOKEN_BUDGET})",
    "async_scheduling": "queue the next decode step before reading this one's tokens "
                        "(default: on with CUDA, off on CPU)",
    "admission_group": "while more requests wait than seats are free, admit them only once this many seats are "
                       "free (default: max_num_seqs / 8 with CUDA graphs, else 1: at once)",
    # RunnerConfig (debugging and A/B benchmarks; all but cpu_script, screened_head and cpu_onednn are no-ops on CPU)
    "backend": "model runner: " + " | ".join(RUNNER_BACKENDS)
               + " (auto: the CUDA runner on CUDA devices, torch elsewhere)",
    "cuda_graphs": "replay captured CUDA graphs for small steps (--enforce-eager turns them off)",
    "fused": "fused layer kernels (norm+residual, rope+KV write, skinny matmuls)",
    "skinny_rows": "steps of at most this many rows use the skinny Triton matmuls; 0: never "
                   "(default: chosen per model)",
    "skinny_multirow": "skinny steps of 2+ rows: " + " | ".join(MULTIROW_MODES)
                       + " (auto: one program per row for a few rows on small models, tensor cores above)",
    "max_graph_batch": "largest batch with a captured CUDA graph",
    "kv_splits": "force the attention kernel's split-KV count (default: chosen per step)",
    "pdl": "programmatic dependent launch on Hopper and newer",
    "skinny_defer": "deferred reduction in the skinny matmuls (default: chosen per shape)",
    "cpu_script": "CPU: run batch-1 decode / verify steps of packed int4 models as one TorchScript "
                  "function (same ops and bits as eager)",
    "screened_head": "CPU, packed layers: greedy rows take the LM head's argmax through an 8-bit packed copy "
                     "of the head, confirmed exactly (same tokens as the float head, faster)",
    "cpu_onednn": "CPU, float32 model, speculation on: steps of 3+ rows (verify, prefill) of the decoder linears "
                  "and LM head on a oneDNN-packed copy of their weights (little more than one row's time for a "
                  "verify; memory: those weights' bytes again)",
}
_GROUPS = {
    ModelConfig: ("model", None),
    CacheConfig: ("KV cache", None),
    SchedulerConfig: ("scheduler", None),
    RunnerConfig: ("model runner", "How a step runs: for debugging and A/B benchmarks; all but "
                                   "--cpu-script, --screened-head and --cpu-onednn are no-ops on CPU. TANDEM_* variables override them "
                                   "(tandem/config/env.py)."),
}
_EXTRA_KWARGS = ("runner_config", "enforce_eager", "speculative_config", "log_stats")


def flag_fields(cls: type) -> list[Field[Any]]:
    """The fields of ``cls`` that are engine arguments (all but the positional ``model``)."""
    return [f for f in fields(cls) if f.name not in POSITIONAL]


def flag_name(key: str) -> str:
    return _FLAG_NAMES.get(key, cli_flag(key))


ENGINE_KWARGS: tuple[str, ...] = (
    *(f.name for cls in KWARG_CONFIGS for f in flag_fields(cls)), *_EXTRA_KWARGS, *DEPRECATED_KWARGS,
    *COMPAT_KWARGS)


# ---- LLM(**kwargs) -> EngineConfig ----------------------------------------------------------------------


def engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **kwargs)``; keys not given take the config classes' defaults."""
    unknown = [k for k in kwargs if k not in ENGINE_KWARGS]
    if unknown:
        raise TypeError(_unknown_kwarg_message(unknown[0]))
    apply_vllm_compat({k: kwargs[k] for k in COMPAT_KWARGS if k in kwargs})
    model_kw, cache_kw, scheduler_kw = (
        {f.name: kwargs[f.name] for f in flag_fields(cls) if f.name in kwargs} for cls in KWARG_CONFIGS)
    deprecated = {k: kwargs[k] for k in DEPRECATED_KWARGS if k in kwargs}
    extra = {"log_stats": kwargs["log_stats"]} if "log_stats" in kwargs else {}
    return EngineConfig(
        model=ModelConfig(model=model, **model_kw),
        cache=CacheConfig(**cache_kw),
        scheduler=SchedulerConfig(**scheduler_kw),
        speculative=resolve_speculative_config(kwargs.get("speculative_config"), deprecated),
        runner=runner_config(kwargs.get("runner_config"), kwargs.get("enforce_eager")),
        **extra,
    )


def runner_config(value: RunnerConfig | Mapping[str, Any] | None, enforce_eager: bool | None = None) -> RunnerConfig:
    """``runner_config`` (a RunnerConfig, a dict of its fields, or None) with vLLM's ``enforce_eager`` applied.

    ``enforce_eager`` is ``not cuda_graphs``; giving both with opposite meanings is a ConfigError.
    """
    check_bool("enforce_eager", enforce_eager, optional=True)
    defaults = RunnerConfig()
    if value is None:
        explicit: dict[str, Any] = {}
    elif isinstance(value, RunnerConfig):  # only what differs from the defaults was chosen
        explicit = {f.name: getattr(value, f.name) for f in fields(RunnerConfig)
                    if getattr(value, f.name) != getattr(defaults, f.name)}
    elif isinstance(value, Mapping):
        known = tuple(f.name for f in fields(RunnerConfig))
        for key in value:
            if key not in known:
                raise ConfigError(str(key), _unknown_key_message("runner_config", key, known))
        explicit = dict(value)
    else:
        raise ConfigError("runner_config", f"expected a RunnerConfig or a dict of its fields, got {type_name(value)}")
    if enforce_eager is not None:
        graphs = not enforce_eager
        if explicit.get("cuda_graphs", graphs) != graphs:
            raise ConfigError("enforce_eager", f"enforce_eager={enforce_eager} contradicts runner_config "
                                               f"cuda_graphs={explicit['cuda_graphs']}; give one of them")
        explicit["cuda_graphs"] = graphs
    return RunnerConfig(**explicit)


def _unknown_kwarg_message(key: str) -> str:
    msg = f"LLM() got an unexpected keyword argument {key!r}"
    close = difflib.get_close_matches(key, ENGINE_KWARGS, n=1)
    if close:
        msg += f"; did you mean {close[0]!r}?"
    elif key in {f.name for f in fields(RunnerConfig)}:
        msg += f"; runner options go in runner_config={{{key!r}: ...}}"
    return msg + f" (engine arguments: {', '.join(ENGINE_KWARGS)})"


def _unknown_key_message(what: str, key: object, known: tuple[str, ...]) -> str:
    msg = f"unknown {what} key {key!r}"
    close = difflib.get_close_matches(str(key), known, n=1)
    if close:
        msg += f"; did you mean {close[0]!r}?"
    return msg + f" (known keys: {', '.join(known)})"


# ---- command line ----------------------------------------------------------------------------------------


def field_help(f: Field[Any]) -> str:
    """A flag's help: the field's ``metadata["help"]`` if it has one, else this module's table."""
    return str(f.metadata.get("help") or _HELP.get(f.name, ""))


def cli_type(annotation: Any, where: str = "") -> type:
    """The value type of a field's flag: ``bool`` (a --x/--no-x switch), ``int``, ``float`` or ``str``.

    ``X | None`` is X; a union with ``str`` (``dtype: str | torch.dtype``) is ``str``.
    """
    members = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else {annotation}
    members.discard(type(None))
    for t in (bool, str, float, int):  # bool before int (a subclass); str wins in mixed unions
        if t in members:
            return t
    raise TypeError(f"{where or 'a config field'}: no command-line type for {annotation!r}; engine flags take "
                    "bool, int, float or str fields (tandem/engine/args.py)")


def _default_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return " (default: on)" if value else " (default: off)"
    return f" (default: {value})"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine flags (module docstring) to ``parser``; :func:`engine_kwargs` reads them back."""
    for cls in FLAG_CONFIGS:
        title, description = _GROUPS[cls]
        group = parser.add_argument_group(title, description)
        if cls is RunnerConfig:
            group.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                               help="never capture CUDA graphs (vLLM's name for --no-cuda-graphs)")
        hints = typing.get_type_hints(cls)
        for f in flag_fields(cls):
            default = f.default if f.default is not MISSING else None
            kind = cli_type(hints[f.name], f"{cls.__name__}.{f.name}")
            help_text = field_help(f) + _default_text(default)
            if kind is bool:
                group.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                   default=default, help=help_text)
            else:
                short = [f.metadata["short"]] if "short" in f.metadata else []  # vLLM's -q
                group.add_argument(flag_name(f.name), *short, dest=f.name, type=kind, default=default,
                                   help=help_text, metavar=f.name.upper())
    add_speculative_args(parser)
    add_compat_args(parser)


def add_compat_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that configure nothing in tandem (:mod:`tandem.config.compat`); each defaults to unset."""
    group = parser.add_argument_group(
        "vLLM compatibility", "Accepted so vLLM launch scripts run unchanged; docs/vllm_compat.md says what each does.")
    for arg in VLLM_COMPAT_ARGS:
        names = [cli_flag(arg.name), *([arg.short] if arg.short else [])]
        if arg.type is bool:
            group.add_argument(*names, dest=arg.name, action=argparse.BooleanOptionalAction, default=None,
                               help=arg.help)
        else:
            group.add_argument(*names, dest=arg.name, type=arg.type, default=None, help=arg.help,
                               metavar={int: "N", float: "GIB"}.get(arg.type, arg.name.upper()))


def add_speculative_args(parser: argparse.ArgumentParser) -> None:
    """``--speculative-config`` and vLLM's deprecated speculative flags (types from SpeculativeConfig)."""
    group = parser.add_argument_group(
        "speculative decoding",
        f"Speculative decoding, configured as vLLM's speculative_config, e.g. --speculative-config '{EXAMPLE_JSON}'.")
    group.add_argument(
        "--speculative-config", dest="speculative_config", type=str, default=None, metavar="JSON",
        help="JSON object: method (draft_model | ngram | suffix), num_speculative_tokens, model, "
             "prompt_lookup_min/max, draft_sample_method, rejection_sample_method, …")
    hints = typing.get_type_hints(SpeculativeConfig)
    for old, new in DEPRECATED_KWARGS.items():
        group.add_argument(cli_flag(old), dest=old, type=cli_type(hints[new]), default=None,
                           help=f"[deprecated] use --speculative-config '{{\"{new}\": ...}}'")


def engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """The ``LLM`` keyword arguments the parsed engine flags give (flags left at their default are left out)."""
    out: dict[str, Any] = {}
    runner: dict[str, Any] = {}
    for cls in FLAG_CONFIGS:
        target = runner if cls is RunnerConfig else out
        for f in flag_fields(cls):
            value = getattr(ns, f.name)
            if value != (f.default if f.default is not MISSING else None):
                target[f.name] = value
    if runner:
        out["runner_config"] = runner
    for key in ("enforce_eager", "speculative_config", *DEPRECATED_KWARGS, *COMPAT_KWARGS):
        if getattr(ns, key, None) is not None:
            out[key] = getattr(ns, key)
    return out


def speculative_config_from_args(ns: argparse.Namespace) -> SpeculativeConfig | None:
    """The SpeculativeConfig the parsed speculative flags describe (None: no speculation)."""
    deprecated = {k: getattr(ns, k, None) for k in DEPRECATED_KWARGS}
    return resolve_speculative_config(getattr(ns, "speculative_config", None), deprecated)
