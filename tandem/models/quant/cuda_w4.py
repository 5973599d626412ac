"""CUDA kernel module for 4-bit weights: ``W4Linear`` (layout: ``w4_weight.py``).

Up to ``DOT_ROWS`` rows (decode, verify, mid-sized batches): the int4 Triton matmul
(``worker/triton_w4.py``) streams the packed weight and applies scales per group; the fused decoder
kernels (``worker/cuda_kernels.py``) call it through ``triton_gemv.gemv`` with the RMSNorm, silu·mul
and residual add fused in, exactly as for float weights. More rows (prefill): dequantize to the model
dtype, then one cuBLAS GEMM. ``benchmarks/gpu_w4_gemv.py`` measures both against the int4 floor.

Served on CUDA only when ``quantization`` is named explicitly (``engine/model_loader.py``): until
the H200 measurement says it pays, a quantized checkpoint on CUDA loads dequantized by default.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.quant.w4_weight import W4Weight, w4_group
from tandem.models.quant.weights import QuantizedWeight

# Rows up to which the int4 kernels run (one row: CUDA cores; more: 16-row tensor-core tiles, each
# streaming the packed weight, from L2 after the first); above, dequantize + GEMM.
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
        self.k = w.k
        self.source = qw.source
        self.register_buffer("qweight", w.qweight)
        self.register_buffer("scale", w.scale)
        self.register_buffer("offset", w.offset)
        self.bias = (nn.Parameter(bias.detach().to(device=device, dtype=dtype).clone(), requires_grad=False)
                     if bias is not None else None)

    @property
    def w4(self) -> W4Weight:
        return W4Weight(self.qweight, self.scale, self.offset, self.group, self.k)

    def dequantized(self) -> torch.Tensor:
        return self.w4.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        h = x.reshape(-1, shape[-1]).to(self.scale.dtype)
        if h.shape[0] <= DOT_ROWS:
            from tandem.worker.triton_gemv import gemv

            out = gemv(h.contiguous(), self.w4, self.bias)
        else:
            out = F.linear(h, self.dequantized(), self.bias)
        return out.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def nbytes(self) -> int:
        return self.w4.nbytes()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group}, source={self.source}"
