"""The reference layer kernels: plain torch ops, exactly Hugging Face's order of operations.

This is the CPU path and the numerics every fused backend is tested against (float32 greedy output
equals HF transformers token for token). Nothing is deferred: ``stream.x`` always holds the sum.
"""

from __future__ import annotations

import torch

from tandem.models.forward_context import ResidualStream
from tandem.models.layers import GatedMLP, Linear, PackedLinear, RMSNorm


class TorchKernels:
    # ``layer.forward``: the float Linear / PackedLinear (``layers.linear``) or a packed quantized
    # kernel module (``models/quant/``), whichever the loader put there. A packed module without bias
    # has ``lowp``: its ``forward_lowp`` returns the kernel's bf16 output uncast, and a float32 residual
    # add or act·mul consumes it through type promotion (the fp32 values ``forward`` would have cast
    # to, one op fewer per linear; bitwise the same result).
    def linear(self, x: torch.Tensor, layer: Linear | PackedLinear) -> torch.Tensor:
        return layer.forward(x)

    def norm_linear(self, stream: ResidualStream, norm: RMSNorm, layer: Linear | PackedLinear) -> torch.Tensor:
        return layer.forward(norm.forward(stream.x))

    def linear_add(self, x: torch.Tensor, layer: Linear | PackedLinear, stream: ResidualStream) -> ResidualStream:
        if getattr(layer, "lowp", False) and x.dim() == 2 and stream.x.dtype is torch.float32:
            stream.x = stream.x + layer.forward_lowp(x)
        else:
            stream.x = stream.x + layer.forward(x)
        return stream

    def norm_gated_mlp_in(self, stream: ResidualStream, norm: RMSNorm, mlp: GatedMLP) -> torch.Tensor:
        layer = mlp.gate_up_proj
        h = norm.forward(stream.x)
        if getattr(layer, "lowp", False) and h.dtype is torch.float32 and h.dim() == 2:
            gu = layer.forward_lowp(h)  # bf16 [T, 2I]
            return mlp.act(gu[:, : mlp.intermediate].float()) * gu[:, mlp.intermediate:]
        return mlp.act_mul(layer.forward(h))

    def final_norm(self, stream: ResidualStream, norm: RMSNorm) -> torch.Tensor:
        return norm.forward(stream.x)

    def hidden(self, stream: ResidualStream) -> torch.Tensor:
        return stream.x  # never modified in place by these kernels


TORCH_KERNELS = TorchKernels()
