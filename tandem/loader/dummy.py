"""Random ("dummy") weights with real shapes, for benchmarks and tests at sizes we have no weights for.

Invariants:
- Deterministic: a tensor's values depend only on (seed, its name, shape, dtype, device type), not on
  the order tensors are requested in, so a model built twice from the same config is identical.
- Lazy: each tensor is generated when the iterator reaches it (directly on ``device`` in ``dtype``
  when given), so an 8B-shape model never needs a second full copy in host memory.
- Values: normal(0, std) everywhere except RMSNorm weights, which are the identity: 1, or 0 for
  Gemma, whose norms compute ``x * (1 + w)`` (HF convention, as stored on disk).
- Where: ``device``/``dtype`` when given; else inside ``generate_on(device, dtype)`` (the model
  builder uses it for CUDA models, so an 8B-shape model is drawn on the GPU in bf16 in well under a
  second instead of minutes of float32 on the host CPU); else CPU float32.
"""

from __future__ import annotations

import contextlib
import contextvars
import zlib
from collections.abc import Iterator, Mapping

import torch

DEFAULT_STD = 0.02

_GENERATE_ON: contextvars.ContextVar[tuple[torch.device, torch.dtype] | None] = contextvars.ContextVar(
    "tandem_dummy_generate_on", default=None)


@contextlib.contextmanager
def generate_on(device: torch.device | str, dtype: torch.dtype) -> Iterator[None]:
    """Dummy weights requested without device/dtype are generated there, in that dtype."""
    token = _GENERATE_ON.set((torch.device(device), dtype))
    try:
        yield
    finally:
        _GENERATE_ON.reset(token)


def is_norm_weight(name: str) -> bool:
    """True for RMSNorm scales (layer norms, q/k norms, the final norm) in HF naming."""
    return name.endswith("norm.weight")


def _tensor_seed(seed: int, name: str) -> int:
    # crc32 is stable across processes (unlike hash()); mix in the user seed.
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63 - 1)


def dummy_weights(
    shapes: Mapping[str, tuple[int, ...]],
    *,
    family: str,
    seed: int = 0,
    std: float = DEFAULT_STD,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every entry of ``shapes``, generated one at a time."""
    if device is None and dtype is None and (target := _GENERATE_ON.get()) is not None:
        device, dtype = target
    dev = torch.device(device) if device is not None else torch.device("cpu")
    dt = dtype or torch.float32
    norm_value = 0.0 if family == "gemma3" else 1.0
    for name, shape in shapes.items():
        if is_norm_weight(name):
            yield name, torch.full(shape, norm_value, dtype=dt, device=dev)
            continue
        gen = torch.Generator(device=dev)
        gen.manual_seed(_tensor_seed(seed, name))
        yield name, torch.empty(shape, dtype=dt, device=dev).normal_(0.0, std, generator=gen)
