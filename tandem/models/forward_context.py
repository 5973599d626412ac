"""What one forward needs besides its weights: the step's attention metadata and KV tensors, and the
two backend objects the runner picked for this step — the layer kernels and the attention backend.

The model code is written once (``models/decoder.py``) against these two small interfaces:

- ``LayerKernels`` runs a decoder layer's matmuls with the element-wise work around them fused in
  where the backend can: RMSNorm into the matmul that consumes it, the residual add into the matmul
  that produces it, silu·mul into the gate/up projection. The residual stream therefore travels as a
  ``ResidualStream``: ``x`` holds the sum so far; a backend that defers an add keeps the last
  sub-layer's output in ``pending`` and folds it in at the next norm. Implementations: the torch
  reference (``models/torch_kernels.py``: CPU, and any device), and on CUDA the skinny Triton
  matmuls and the cuBLAS body (``worker/cuda_kernels.py``). A quantized or a sharded linear is one
  more implementation behind the same calls.
- ``AttentionBackend`` does rope (+ per-head q/k norm), the KV write and paged attention for one
  layer: torch (``worker/attention.py``) or Triton (``worker/triton_attention_backend.py``).

``meta`` is opaque to the model: only the attention backend reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tandem.models.decoder import Attention
    from tandem.models.layers import GatedMLP, Linear, PackedLinear, RMSNorm

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V: [num_slots, kv_heads, head_dim] each


class ResidualStream:
    """The residual stream between sub-layers: the value is ``x + pending`` (``pending`` may be None).

    Mutable on purpose: fused kernels update ``x`` in place (the adds round in the model dtype
    exactly as ``x = x + f(x)`` does)."""

    __slots__ = ("x", "pending")

    def __init__(self, x: torch.Tensor, pending: torch.Tensor | None = None) -> None:
        self.x = x  # [T, H]
        self.pending = pending  # [T, H] or None


class LayerKernels(Protocol):
    def linear(self, x: torch.Tensor, layer: Linear | PackedLinear) -> torch.Tensor:
        """``x @ W^T + b``."""
        ...

    def norm_linear(self, stream: ResidualStream, norm: RMSNorm, layer: Linear | PackedLinear) -> torch.Tensor:
        """``norm(stream) @ W^T + b`` (folds a pending add into the stream first)."""
        ...

    def linear_add(self, x: torch.Tensor, layer: Linear | PackedLinear, stream: ResidualStream) -> ResidualStream:
        """The stream plus ``x @ W^T + b``."""
        ...

    def norm_gated_mlp_in(self, stream: ResidualStream, norm: RMSNorm, mlp: GatedMLP) -> torch.Tensor:
        """``act(gate) * up`` of ``norm(stream)`` through the packed gate/up projection."""
        ...

    def final_norm(self, stream: ResidualStream, norm: RMSNorm) -> torch.Tensor:
        """The model's last norm over the stream."""
        ...

    def hidden(self, stream: ResidualStream) -> torch.Tensor:
        """The stream's value as a tensor the caller may keep (later kernels will not modify it)."""
        ...


class AttentionBackend(Protocol):
    def forward(self, attn: Attention, qkv: torch.Tensor, positions: torch.Tensor, meta: Any,
                kv_cache: KVCache) -> torch.Tensor:
        """Rope (+ q/k norm) on the packed ``qkv`` [T, (H + 2·KVH)·D], write K/V of the new tokens
        into their slots, attend over each request's context; returns [T, H·D]."""
        ...


@dataclass(frozen=True)
class ForwardContext:
    meta: Any  # the attention backend's per-step metadata (worker/attn_metadata.py)
    kv_caches: list[KVCache]  # one (K, V) per layer
    kernels: LayerKernels
    attention: AttentionBackend
