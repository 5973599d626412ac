"""Fused layer kernels for CUDA (Llama / Mistral / Qwen2 / Qwen3 shapes): the ``LayerKernels`` the
CUDA runner picks per step (``models/forward_context.py``). Same parameters, same function as the
torch reference (tests/test_gpu.py), in fewer kernels:

- ``SkinnyKernels`` for few rows (≤ ``skinny_rows``: batch-1 decode; up to 6 rows on small models,
  ``default_skinny_rows``): Triton matmuls that stream the weights once per column block with the
  RMSNorm, the silu·mul and the residual add fused in (``triton_gemv.py``, one program per row and
  column block): ``norm+qkv → (rope + KV write → attention) → o (+= residual) →
  norm+gate_up+silu·mul → down (+= residual)``, 6–7 launches per layer. The residual stream is
  updated in place. On larger models 2+ rows cost ~rows × one row there, more than cuBLAS
  (benchmarks/gpu_gemv.py, docs/gpu_notes.md), so those steps take the cuBLAS body;
- ``CublasKernels`` for more rows: ``add_rmsnorm → qkv matmul → … → o matmul → add_rmsnorm →
  gate_up matmul → silu_mul → down matmul`` with cuBLAS matmuls (9–10 launches instead of ~35);
  each sub-layer's output stays *pending* and is added into the residual by the next norm kernel.

Either way the adds round in the model dtype exactly as ``x = x + f(x)`` does. Not covered
(``fused_supported`` is False: the runner uses the torch kernels with Triton attention): Gemma3
(sandwich norms, scaled embeddings, soft-capping), non-power-of-2 head dims, activations other than
SiLU. These kernels read the model's parameters; they never copy or re-lay out weights.

Int4 layers (``W4Linear``, models/quant/cuda_w4.py) take the same paths: the skinny kernels stream
their packed weight (``W4Weight``) with the same fusions; the cuBLAS body calls the module (its own
choice: skinny up to 16 rows, else dequantize + GEMM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.loader.arch import ModelArch
from tandem.models.forward_context import ResidualStream
from tandem.models.layers import GatedMLP, Linear, PackedLinear, RMSNorm
from tandem.models.quant.cuda_w4 import W4Linear
from tandem.models.quant.w4_weight import W4Weight
from tandem.worker.triton_gemv import MAX_ROWS, gemv
from tandem.worker.triton_ops import rmsnorm, silu_mul

# Models up to this hidden size run steps of up to SMALL_MODEL_SKINNY_ROWS rows (a k <= 5 verify at
# batch 1, decode at batch <= 6) through the skinny matmuls, one program per row: their matmuls are a
# few µs of launch latency, not bandwidth, so k + 1 row programs cost little more than one, while the
# cuBLAS body has ~3 more kernels per layer. SmolLM2-135M shape on the H200: q=5 verify graph 0.776 ms
# skinny vs 0.902 ms cuBLAS (decode 0.465 ms); batch 8 decode 1.031 vs 0.917 ms, so not beyond 6 rows.
# Llama-3.2-1B (hidden 2048): skinny already loses at 2 rows (1.070 vs 1.045 ms) — cuBLAS above 1 row.
SMALL_MODEL_HIDDEN = 1024
SMALL_MODEL_SKINNY_ROWS = 6


def default_skinny_rows(arch: ModelArch) -> int:
    """Most rows of a step that takes the skinny-matmul kernels (docs/gpu_notes.md, session 5)."""
    return SMALL_MODEL_SKINNY_ROWS if arch.hidden_size <= SMALL_MODEL_HIDDEN else 1


def fused_supported(arch: ModelArch) -> bool:
    d = arch.head_dim
    return (
        not arch.is_gemma
        and arch.hidden_act in ("silu", "swish")
        and d >= 2 and d & (d - 1) == 0
        and not arch.final_logit_softcapping
    )


AnyLinear = Linear | PackedLinear | W4Linear


def _weight(layer: AnyLinear) -> torch.Tensor | W4Weight:
    """What the skinny kernel streams: the float weight, or the packed int4 one."""
    return layer.w4 if isinstance(layer, W4Linear) else layer.weight


def _matmul(x: torch.Tensor, layer: AnyLinear) -> torch.Tensor:
    return layer(x) if isinstance(layer, W4Linear) else F.linear(x, layer.weight, layer.bias)


class SkinnyKernels:
    """At most ``triton_gemv.MAX_ROWS`` rows: fused skinny Triton matmuls, residual updated in place.

    ``invariant`` (batch-invariant mode): every row count, every matmul on the same 16-row
    tensor-core tiles with the same block sizes, so a row's result never depends on how many rows
    the step has (``triton_gemv.gemv_config``); the GPU runner then uses these kernels for every
    step, prefill included, and the LM head through ``invariant_logits``."""

    def __init__(self, dot: bool = False, defer: bool | None = None, invariant: bool = False) -> None:
        self.dot = dot or invariant  # 2+ rows on 16-row tensor-core tiles instead of one program per row
        self.defer = defer  # deferred reduction: None = per shape
        self.invariant = invariant

    def linear(self, x: torch.Tensor, layer: AnyLinear) -> torch.Tensor:
        return gemv(x, _weight(layer), layer.bias, dot=self.dot, defer=self.defer, invariant=self.invariant)

    def norm_linear(self, stream: ResidualStream, norm: RMSNorm, layer: AnyLinear) -> torch.Tensor:
        return gemv(stream.x, _weight(layer), layer.bias, norm_weight=norm.weight, eps=norm.eps, dot=self.dot,
                    defer=self.defer, invariant=self.invariant)

    def linear_add(self, x: torch.Tensor, layer: AnyLinear, stream: ResidualStream) -> ResidualStream:
        gemv(x, _weight(layer), layer.bias, residual=stream.x, dot=self.dot, defer=self.defer, invariant=self.invariant)
        return stream

    def norm_gated_mlp_in(self, stream: ResidualStream, norm: RMSNorm, mlp: GatedMLP) -> torch.Tensor:
        return gemv(stream.x, _weight(mlp.gate_up_proj), mlp.gate_up_proj.bias, norm_weight=norm.weight,
                    eps=norm.eps, gated=True, dot=self.dot, defer=self.defer, invariant=self.invariant)  # silu(gate) * up

    def final_norm(self, stream: ResidualStream, norm: RMSNorm) -> torch.Tensor:
        return rmsnorm(stream.x, norm.weight, norm.eps)

    def hidden(self, stream: ResidualStream) -> torch.Tensor:
        return stream.x.clone()  # later layers add into stream.x in place


def invariant_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits of ``hidden`` rows on the batch-invariant tiles (accumulated and stored in
    float32, as ``CausalLM.compute_logits``; models with logit soft-capping are not fused)."""
    return gemv(hidden, weight, dot=True, invariant=True, out_dtype=torch.float32)


class CublasKernels:
    """Any row count: cuBLAS matmuls; norms with the pending residual add fused in (Triton)."""

    def linear(self, x: torch.Tensor, layer: AnyLinear) -> torch.Tensor:
        return _matmul(x, layer)

    def _norm(self, stream: ResidualStream, norm: RMSNorm) -> torch.Tensor:
        if stream.pending is None:
            return rmsnorm(stream.x, norm.weight, norm.eps)
        h = rmsnorm(stream.pending, norm.weight, norm.eps, residual=stream.x)  # stream.x += pending
        stream.pending = None
        return h

    def norm_linear(self, stream: ResidualStream, norm: RMSNorm, layer: AnyLinear) -> torch.Tensor:
        return _matmul(self._norm(stream, norm), layer)

    def linear_add(self, x: torch.Tensor, layer: AnyLinear, stream: ResidualStream) -> ResidualStream:
        stream.pending = _matmul(x, layer)  # added by the next norm
        return stream

    def norm_gated_mlp_in(self, stream: ResidualStream, norm: RMSNorm, mlp: GatedMLP) -> torch.Tensor:
        gu = _matmul(self._norm(stream, norm), mlp.gate_up_proj)
        return silu_mul(gu, mlp.intermediate)

    def final_norm(self, stream: ResidualStream, norm: RMSNorm) -> torch.Tensor:
        return self._norm(stream, norm)

    def hidden(self, stream: ResidualStream) -> torch.Tensor:
        return stream.x.clone() if stream.pending is None else stream.x + stream.pending


__all__ = ["CublasKernels", "MAX_ROWS", "SkinnyKernels", "default_skinny_rows", "fused_supported", "invariant_logits"]
