"""Where training runs: the device, the mixed-precision context and the engine settings used for
generation and evaluation on it."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

# Engines built by training get a fixed KV cache (not a fraction of free memory): the device also
# holds the training target/head or an engine not yet collected, and a fixed size keeps every
# engine independent of that. 8 GiB holds 256 sequences of 784 tokens of SmolLM2 (23 KB/token).
CUDA_ENGINE_KV_BYTES = 8 << 30
CPU_ENGINE_KV_BYTES = 256 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        from tandem.errors import ConfigError

        raise ConfigError("device", "CUDA was asked for but torch sees no CUDA device")
    return dev


def engine_kwargs(device: torch.device, max_model_len: int) -> dict[str, Any]:
    """``LLM(...)`` keyword arguments for the engines that generate data and evaluate heads
    (``max_model_len``: the longest prompt + answer, so the KV cache is sized for the work)."""
    if device.type == "cuda":
        return {"device": str(device), "kv_cache_memory_bytes": CUDA_ENGINE_KV_BYTES, "max_model_len": max_model_len}
    return {"device": "cpu", "dtype": "float32", "kv_cache_memory_bytes": CPU_ENGINE_KV_BYTES, "block_size": 16,
            "max_model_len": max_model_len}


def autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on CUDA (fp32 master weights), nothing on CPU (fp32 throughout)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def default_batch_tokens(device: torch.device) -> int:
    return 8192 if device.type == "cuda" else 1024


def free_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
