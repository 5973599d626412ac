"""Build a CausalLM on a device in a dtype and stream a checkpoint's weights into it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tandem.loader.arch import ModelArch
from tandem.loader.dummy import generate_on
from tandem.models.decoder import CausalLM


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(arch: ModelArch, weights: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: torch.device, max_positions: int) -> CausalLM:
    with _default_dtype(dtype), torch.device(device):
        model = CausalLM(arch, max_positions)
    # On CUDA, dummy weights are drawn on the device in the model dtype (no host round trip).
    where = generate_on(device, dtype) if torch.device(device).type == "cuda" else contextlib.nullcontext()
    with where:
        model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights)
    return model.eval()
