"""The reference layer kernels: plain torch ops, exactly Hugging Face's order of operations.

This is the CPU path and the numerics every fused backend is tested against (float32 greedy output
equals HF transformers token for token). Nothing is deferred: ``stream.x`` always holds the sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.models.forward_context import ResidualStream
from tandem.models.layers import GatedMLP, Linear, PackedLinear, RMSNorm
from tandem.models.quant.q4_linear import Q4Linear


class TorchKernels:
    # ``layer.forward``: the float Linear / PackedLinear (``layers.linear``) or a packed quantized
    # kernel module (``models/quant/``), whichever the loader put there. A packed module without bias
    # has ``lowp``: its ``forward_lowp`` returns the kernel's bf16 output uncast, and a float32 residual
    # add or act·mul consumes it through type promotion (the fp32 values ``forward`` would have cast
    # to, one op fewer per linear; bitwise the same result).
    def linear(self, x: torch.Tensor, layer: Linear | PackedLinear) -> torch.Tensor:
        return layer.forward(x)

    # ``Q4Linear`` (tandem's CPU kernel) also takes the norm before it and the residual add after it
    # inside its kernel call (``_fused``): the scripted CPU step calls the same op, so both compute the
    # same bits (the add is the same float32 sum either way; the norm is the kernel's own).
    def norm_linear(self, stream: ResidualStream, norm: RMSNorm, layer: Linear | PackedLinear) -> torch.Tensor:
        if _fused(layer, norm, stream.x):
            return layer.forward_norm(stream.x, norm)
        return layer.forward(norm.forward(stream.x))

    def linear_add(self, x: torch.Tensor, layer: Linear | PackedLinear, stream: ResidualStream) -> ResidualStream:
        if getattr(layer, "lowp", False) and x.dim() == 2 and stream.x.dtype is torch.float32:
            if isinstance(layer, Q4Linear) and stream.x.dim() == 2:
                stream.x = layer.forward_lowp(x, residual=stream.x)
            else:
                stream.x = stream.x + layer.forward_lowp(x)
        else:
            stream.x = stream.x + layer.forward(x)
        return stream

    def norm_gated_mlp_in(self, stream: ResidualStream, norm: RMSNorm, mlp: GatedMLP) -> torch.Tensor:
        layer = mlp.gate_up_proj
        if _fused(layer, norm, stream.x):
            gu = layer.forward_norm(stream.x, norm)  # float32 [T, 2I]
            return mlp.act(gu[:, : mlp.intermediate]) * gu[:, mlp.intermediate:]
        h = norm.forward(stream.x)
        if getattr(layer, "lowp", False) and h.dtype is torch.float32 and h.dim() == 2:
            gu = layer.forward_lowp(h)  # bf16 [T, 2I]
            return mlp.act(gu[:, : mlp.intermediate].float()) * gu[:, mlp.intermediate:]
        return mlp.act_mul(layer.forward(h))

    def final_norm(self, stream: ResidualStream, norm: RMSNorm) -> torch.Tensor:
        return norm.forward(stream.x)

    def hidden(self, stream: ResidualStream) -> torch.Tensor:
        return stream.x  # never modified in place by these kernels


def _fused(layer: object, norm: RMSNorm, x: torch.Tensor) -> bool:
    return isinstance(layer, Q4Linear) and layer.fuses_norm(norm, x)


def _rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to each row of ``x`` [T, ...] alone (a 1-row call), results stacked."""
    if x.shape[0] <= 1:
        return fn(x)
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def _float(layer: object) -> bool:
    """A float linear (``layers.linear``: a split GEMV for one row, a GEMM for several, which round
    differently); the packed quantized kernels compute each row alone whatever the row count."""
    return isinstance(layer, (Linear, PackedLinear))


class RowwiseKernels(TorchKernels):
    """Linears (those ``split`` picks) and, with ``norms``, norms run on one row at a time, the op a
    1-row decode runs, so a row's result never depends on how many rows its step has (BLAS picks its
    blocking by shape: a multi-row matmul and the 1-row product round differently). One call per row.

    - ``ROWWISE_KERNELS``, batch-invariant mode on the torch path: every linear and norm, every step
      (a prefill chunk of P tokens makes P calls per linear).
    - ``LONE_VERIFY_KERNELS``, a batch-1 verify (one request, a few rows) on the eager CPU path of a
      model with packed quantized linears: only its float linears (packed ones and norms are
      row-invariant), so each verify row is bitwise the decode at its position (``worker/attention.py``
      does the same for attention). Without it gemma-3-270m's GGUF (9 Q6_K linears dequantized to
      float) drifted from plain decoding under greedy speculation (13 of 16 HumanEval prompts
      identical with n-gram): the packed kernels' bf16 activations amplify the float rounding."""

    def __init__(self, split: Callable[[object], bool] = lambda layer: True, norms: bool = True) -> None:
        self.split = split
        self.norms = norms

    def _norm(self, norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        return _rows(norm.forward, x) if self.norms else norm.forward(x)

    def linear(self, x: torch.Tensor, layer: Linear | PackedLinear) -> torch.Tensor:
        return _rows(layer.forward, x) if self.split(layer) else layer.forward(x)

    def norm_linear(self, stream: ResidualStream, norm: RMSNorm, layer: Linear | PackedLinear) -> torch.Tensor:
        if not (self.norms or self.split(layer)):
            return super().norm_linear(stream, norm, layer)
        return self.linear(self._norm(norm, stream.x), layer)

    def linear_add(self, x: torch.Tensor, layer: Linear | PackedLinear, stream: ResidualStream) -> ResidualStream:
        if not self.split(layer):
            return super().linear_add(x, layer, stream)
        stream.x = stream.x + _rows(layer.forward, x)
        return stream

    def norm_gated_mlp_in(self, stream: ResidualStream, norm: RMSNorm, mlp: GatedMLP) -> torch.Tensor:
        if not (self.norms or self.split(mlp.gate_up_proj)):
            return super().norm_gated_mlp_in(stream, norm, mlp)
        return mlp.act_mul(self.linear(self._norm(norm, stream.x), mlp.gate_up_proj))

    def final_norm(self, stream: ResidualStream, norm: RMSNorm) -> torch.Tensor:
        return self._norm(norm, stream.x)


TORCH_KERNELS = TorchKernels()
ROWWISE_KERNELS = RowwiseKernels()
LONE_VERIFY_KERNELS = RowwiseKernels(split=_float, norms=False)
