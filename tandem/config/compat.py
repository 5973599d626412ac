"""vLLM engine arguments that configure nothing in tandem: accepted (warning where tandem differs) or refused.

vLLM launch scripts and ``LLM(...)`` calls pass these; tandem takes them so the script runs
unchanged, and says once what it does instead. They are not config fields: no EngineConfig value
depends on them. :mod:`tandem.engine.args` makes each a keyword of ``LLM()`` and a flag of every
engine command (``--tensor-parallel-size`` / ``-tp`` ...); :func:`apply_vllm_compat` checks them.

- ``trust_remote_code``: accepted; ``True`` warns that tandem runs no remote code (it only loads
  architectures it implements).
- ``swap_space`` (GiB): accepted; a value > 0 warns that tandem has no CPU swap: a preempted request
  frees its KV blocks and is recomputed when it is resumed.
- ``tensor_parallel_size`` / ``pipeline_parallel_size``: 1 accepted; anything else is one ConfigError
  naming the flag (allowed: 1) — tandem runs a model on one device.
- ``enable_chunked_prefill``: accepted; tandem always prefills prompts longer than
  ``max_num_batched_tokens`` in chunks, so ``False`` warns that it is ignored.
- (``quantization`` is a real field now: ``ModelConfig.quantization``, docs/quantization.md.)
- ``kv_cache_dtype``: ``"auto"`` accepted (the KV cache is in the model's dtype); anything else refused.

docs/vllm_compat.md lists every vLLM flag a launch script commonly uses and what tandem does with it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.config.validate import check_bool, check_int, type_name
from tandem.errors import ConfigError

logger = logging.getLogger("tandem")


@dataclass(frozen=True)
class CompatArg:
    """One vLLM-only engine argument: its value type, extra flag spellings and help text."""

    name: str
    type: type
    help: str
    short: str | None = None  # vLLM's short flag (-tp)


VLLM_COMPAT_ARGS: tuple[CompatArg, ...] = (
    CompatArg("trust_remote_code", bool,
              "accepted for vLLM scripts; tandem runs no remote code (only the architectures it implements)"),
    CompatArg("swap_space", float,
              "accepted for vLLM scripts (GiB); tandem has no CPU swap: preempted requests are recomputed"),
    CompatArg("tensor_parallel_size", int, "vLLM's tensor parallelism: tandem runs on one device, only 1 works",
              short="-tp"),
    CompatArg("pipeline_parallel_size", int, "vLLM's pipeline parallelism: tandem runs on one device, only 1 works",
              short="-pp"),
    CompatArg("enable_chunked_prefill", bool,
              "accepted for vLLM scripts; tandem always prefills long prompts in chunks of "
              "--max-num-batched-tokens"),
    CompatArg("kv_cache_dtype", str, "vLLM's KV cache dtype: only auto (the model's dtype)"),
)
COMPAT_KWARGS: tuple[str, ...] = tuple(a.name for a in VLLM_COMPAT_ARGS)

TRUST_REMOTE_CODE_WARNING = ("trust_remote_code: tandem runs no remote code; the model must be an architecture "
                             "tandem implements (see README: Models)")
SWAP_SPACE_WARNING = ("swap_space: tandem has no CPU swap space; a preempted request frees its KV blocks and "
                      "is recomputed when it resumes (swap_space={value} ignored)")
CHUNKED_PREFILL_WARNING = ("enable_chunked_prefill=False: tandem always prefills prompts longer than "
                           "max_num_batched_tokens in chunks; ignored")


def apply_vllm_compat(values: Mapping[str, Any]) -> None:
    """Check the vLLM-only arguments given (keys of COMPAT_KWARGS); warn or raise one ConfigError."""
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        if values.get(key) is not None:
            size = values[key]
            check_int(key, size)
            if size != 1:
                short = "-tp" if key.startswith("tensor") else "-pp"
                raise ConfigError(key, f"tandem runs a model on one device; --{key.replace('_', '-')} ({short}) "
                                       f"{size} is not supported", allowed=[1])
    if values.get("kv_cache_dtype") is not None and values["kv_cache_dtype"] != "auto":
        raise ConfigError("kv_cache_dtype", f"--kv-cache-dtype {values['kv_cache_dtype']} is not supported: the KV "
                                            "cache is stored in the model's dtype", allowed=["auto"])
    if values.get("trust_remote_code") is not None:
        check_bool("trust_remote_code", values["trust_remote_code"])
        if values["trust_remote_code"]:
            logger.warning(TRUST_REMOTE_CODE_WARNING)
    if values.get("swap_space") is not None:
        swap = values["swap_space"]
        if isinstance(swap, bool) or not isinstance(swap, (int, float)) or swap < 0:
            raise ConfigError("swap_space", f"expected a number of GiB >= 0, got {type_name(swap)} {swap!r}")
        if swap > 0:
            logger.warning(SWAP_SPACE_WARNING.format(value=f"{swap:g}"))
    if values.get("enable_chunked_prefill") is not None:
        check_bool("enable_chunked_prefill", values["enable_chunked_prefill"])
        if not values["enable_chunked_prefill"]:
            logger.warning(CHUNKED_PREFILL_WARNING)
