"""Pick the CPU kernel module for one quantized linear (one module per kernel: int8pack.py, int4pack.py).

Order: ``int8pack`` for symmetric per-channel 8-bit weights (exact: one scale per row), else
``int4pack`` when the format's groups are multiples of 32 and N % 16 == 0 (4-bit directly, 5–8-bit as
two planes), else None: the caller dequantizes that weight to float (and says so in the log).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.quant.int4pack import Int4PackLinear, kernel_group
from tandem.models.quant.int8pack import Int8PackLinear, fits_int8pack
from tandem.models.quant.weights import QuantizedWeight

QUANT_LINEARS = (Int4PackLinear, Int8PackLinear)


def make_quant_linear(qw: QuantizedWeight, bias: torch.Tensor | None) -> nn.Module | None:
    """The packed module computing ``x @ qw^T + bias``, or None if no CPU kernel holds ``qw``."""
    if fits_int8pack(qw):
        return Int8PackLinear(qw, bias)
    if kernel_group(qw) is not None:
        return Int4PackLinear(qw, bias)
    return None


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QUANT_LINEARS)
