"""Frozen, validated engine configuration, one dataclass per concern.

Each bad value raises one ConfigError naming the key (and the allowed values where finite).
``max_model_len`` is resolved against the checkpoint later (``resolve_max_model_len``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.errors import ConfigError

DTYPES = {
    "float32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


def _check_int(key: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}")
    return value


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", f"{device!r} requested but no CUDA device is available", ["auto", "cpu"])
        return torch.device(device)
    raise ConfigError("device", f"unknown device {device!r}", ["auto", "cpu", "cuda", "cuda:N"])


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """'auto': float32 on CPU (exact reference numerics); on GPU the checkpoint's half type or bf16."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ConfigError("dtype", f"unsupported dtype {dtype}", ["auto", *DTYPES])
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if checkpoint_dtype in ("float16", "bfloat16"):
            return DTYPES[checkpoint_dtype]
        return torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dtype!r}", ["auto", *DTYPES])
    return DTYPES[dtype]


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True  # vLLM V1 default

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ConfigError("block_size", f"got {self.block_size!r}", BLOCK_SIZES)
        g = self.gpu_memory_utilization
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0 < g <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {g!r}")
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, 1)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: 8192 (or max_model_len if larger is asked)
    # Queue the next decode step before reading this one's tokens (engine/async_decode.py).
    # None: on with CUDA (the host work then overlaps the GPU), off on CPU (nothing to overlap).
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.async_scheduling not in (None, True, False):
            raise ConfigError("async_scheduling", f"got {self.async_scheduling!r}; null means auto (on with CUDA)",
                              allowed=(True, False, None))

    def token_budget(self, num_speculative_tokens: int) -> int:
        budget = self.max_num_batched_tokens or 8192
        if budget < num_speculative_tokens + 1:
            raise ConfigError(
                "max_num_batched_tokens",
                f"must be at least num_speculative_tokens + 1 = {num_speculative_tokens + 1}, got {budget}",
            )
        return budget


def resolve_max_model_len(requested: int | None, checkpoint_max: int) -> int:
    if requested is None:
        return checkpoint_max
    _check_int("max_model_len", requested, 2)
    if requested > checkpoint_max:
        raise ConfigError(
            "max_model_len",
            f"{requested} exceeds the model's max_position_embeddings ({checkpoint_max})",
        )
    return requested
