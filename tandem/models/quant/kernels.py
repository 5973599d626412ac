"""Pick the kernel module for one quantized linear (one module per kernel: int8pack.py, int4pack.py,
cuda_w4.py).

CPU order: ``int8pack`` for symmetric per-channel 8-bit weights (exact: one scale per row), else
``cpu_q4`` (tandem's kernel, ``q4_linear.py``: 4-bit codes as nibbles, 5–8-bit as bytes) where it is
available (AVX-512 BF16, or AVX2 + FMA) and fits (N % 16 == 0, groups of a multiple of 4, Q6_K's 16 included), else
``int4pack`` when the format's groups are multiples of 32 and N % 16 == 0 (4-bit directly, 5–8-bit
as two planes). CUDA: ``W4Linear`` for ≤ 4-bit weights without act-order in a 16-bit model dtype
(its kernel runs on 16-bit MMAs). Else None: the caller dequantizes that weight to float (and says so
in the log).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.quant import cpu_q4
from tandem.models.quant.cuda_w4 import W4Linear, fits_w4
from tandem.models.quant.int4pack import Int4PackLinear, kernel_group
from tandem.models.quant.int8pack import Int8PackLinear, fits_int8pack
from tandem.models.quant.q4_linear import Q4Linear
from tandem.models.quant.weights import QuantizedWeight

QUANT_LINEARS = (Q4Linear, Int4PackLinear, Int8PackLinear, W4Linear)


def make_quant_linear(qw: QuantizedWeight, bias: torch.Tensor | None, like: torch.Tensor | None = None
                      ) -> nn.Module | None:
    """The packed module computing ``x @ qw^T + bias`` on ``like``'s device (in its dtype on CUDA;
    None: the CPU), or None if no kernel there holds ``qw``."""
    if like is not None and like.device.type == "cuda":
        fits = fits_w4(qw) and like.dtype in (torch.bfloat16, torch.float16)
        return W4Linear(qw, bias, like.dtype, like.device) if fits else None
    if fits_int8pack(qw):
        return Int8PackLinear(qw, bias)
    if cpu_q4.fits(qw) and cpu_q4.available():
        return Q4Linear(qw, bias)
    if kernel_group(qw) is not None:
        return Int4PackLinear(qw, bias)
    return None


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QUANT_LINEARS)
