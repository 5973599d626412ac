"""CUDA kernel module for 4-bit weights: ``W4Linear`` (layout: ``w4_weight.py``).

Few rows (decode, verify: ≤ ``triton_gemv.MAX_ROWS``): the skinny Triton matmul streams the packed
weight once and dequantizes each tile in registers (``triton_gemv._w4_tile``); the fused decoder
kernels (``worker/cuda_kernels.py``) call it with the RMSNorm, silu·mul and residual add fused in,
exactly as for float weights. Mid-sized batches (≤ ``DOT_ROWS``): the same kernel on tensor cores,
16-row blocks each streaming the packed weight (from L2 after the first). More rows (prefill):
dequantize to the model dtype, then one cuBLAS GEMM — the same matrix, so a row's result differs from
the skinny path's only by the reduction order, as with float weights. The thresholds are first
guesses, to be set from ``benchmarks/gpu_w4_gemv.py`` on the H200.

Served on CUDA only when ``quantization`` is named explicitly (``engine/model_loader.py``): until
the H200 measurement says it pays, a quantized checkpoint on CUDA loads dequantized by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.quant.w4_weight import W4Weight, w4_group
from tandem.models.quant.weights import QuantizedWeight

# Rows up to which the one-program-per-row kernel runs (its MAX_ROWS), then the 16-row tensor-core
# tiles up to DOT_ROWS; above, dequantize + GEMM.
SKINNY_ROWS = 16
DOT_ROWS = 256


def fits_w4(qw: QuantizedWeight) -> bool:
    return w4_group(qw) is not None


class W4Linear(nn.Module):
    """``x @ W^T + b`` from a W4Weight; ``self.w4`` is what the fused CUDA kernels stream."""

    kernel = "w4"

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        w = W4Weight.pack(qw, dtype, device)
        self.out_features, self.in_features = w.shape
        self.group = w.group
        self.source = qw.source
        self.register_buffer("qweight", w.qweight)
        self.register_buffer("scale", w.scale)
        self.register_buffer("offset", w.offset)
        self.bias = (nn.Parameter(bias.detach().to(device=device, dtype=dtype).clone(), requires_grad=False)
                     if bias is not None else None)

    @property
    def w4(self) -> W4Weight:
        return W4Weight(self.qweight, self.scale, self.offset, self.group)

    def dequantized(self) -> torch.Tensor:
        return self.w4.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1]).to(self.scale.dtype)
        if h.shape[0] <= DOT_ROWS:
            from tandem.worker.triton_gemv import gemv

            out = gemv(h.contiguous(), self.w4, self.bias, dot=h.shape[0] > SKINNY_ROWS)
        else:
            out = F.linear(h, self.dequantized(), self.bias)
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.w4.nbytes()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group}, source={self.source}"
