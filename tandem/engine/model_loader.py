"""Build a CausalLM on a device in a dtype and stream a checkpoint's weights into it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tandem.loader.arch import ModelArch
from tandem.loader.dummy import generate_on
from tandem.loader.memory import return_free_memory
from tandem.models.decoder import CausalLM
from tandem.models.quant.attach import ON_THE_FLY, quantize_linears
from tandem.models.quant.weights import QuantizedWeight


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(arch: ModelArch, weights: Iterator[tuple[str, torch.Tensor | QuantizedWeight]], dtype: torch.dtype,
                device: torch.device, max_positions: int, quantization: str | None = None,
                named: bool = False, lm_head_dtype: str = "auto") -> CausalLM:
    """``quantization`` (resolved, ``loader/checkpoint.resolve_quantization``): quantized checkpoint
    weights arrive as QuantizedWeight and are packed on the CPU, and on CUDA when the user ``named``
    the quantization (W4, ``models/quant/cuda_w4.py``: opt-in, it changes the logits); otherwise
    they are dequantized to ``dtype``. ``int8`` / ``int4`` quantize the float linears after loading.
    ``lm_head_dtype``: ``CausalLM.configure_lm_head`` (ModelConfig.lm_head_dtype)."""
    with _default_dtype(dtype), torch.device(device):
        model = CausalLM(arch, max_positions)
    # On CUDA, dummy weights are drawn on the device in the model dtype (no host round trip).
    where = generate_on(device, dtype) if torch.device(device).type == "cuda" else contextlib.nullcontext()
    with where:
        model.load_weights(((name, t if isinstance(t, QuantizedWeight) else t.to(device=device, dtype=dtype))
                            for name, t in weights), pack_quantized=torch.device(device).type == "cpu" or named)
    if quantization in ON_THE_FLY:
        quantize_linears(model, quantization)
    model.configure_lm_head(lm_head_dtype)
    if torch.device(device).type == "cpu":
        return_free_memory()  # the load's temporaries (SmolLM2 GGUF: ~300 MB of RSS)
    return model.eval()
