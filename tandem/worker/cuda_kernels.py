"""Fused layer kernels for CUDA (Llama / Mistral / Qwen2 / Qwen3 shapes): the ``LayerKernels`` the
CUDA runner picks per step (``models/forward_context.py``). Same parameters, same function as the
torch reference (tests/test_gpu.py), in fewer kernels:

- ``SkinnyKernels`` for few rows (≤ ``skinny_rows``, default ``MAX_ROWS`` = 16: decode of small
  batches, verify steps): Triton matmuls that stream the weights once with the RMSNorm, the
  silu·mul and the residual add fused in: ``norm+qkv → (rope + KV write → attention) → o (+=
  residual) → norm+gate_up+silu·mul → down (+= residual)``, 6–7 launches per layer. The residual
  stream is updated in place. Up to ``default_row_rows`` rows (1; 6 on small models) one program per
  row and column block (``triton_gemv.py``: each row bitwise its 1-row product, ~rows × one row on
  big weights); more rows on the tensor cores (``triton_dot.py``: weight rows × 16-row tiles of x,
  2–16 rows for about the price of one);
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

# Models up to this hidden size run steps of up to SMALL_MODEL_ROW_ROWS rows (a k <= 5 verify at batch
# 1, decode at batch <= 6) one program per row: their matmuls are a few µs of launch latency, not
# bandwidth, so k + 1 row programs cost little more than one (SmolLM2-135M shape on the H200: q=5
# verify graph 0.619 ms with triton_gemv.SHAPE_CONFIGS, 0.902 ms on cuBLAS, decode 0.463 ms), and
# each row is bitwise its 1-row decode. On bigger weights a program per row costs ~rows × one row
# (Llama-3.2-1B: already at 2 rows 1.070 vs 1.045 ms on cuBLAS), so there 2+ rows take the
# tensor-core kernel (docs/performance.md §24).
SMALL_MODEL_HIDDEN = 1024
SMALL_MODEL_ROW_ROWS = 6


def default_row_rows(arch: ModelArch) -> int:
    """Most rows of a skinny step that run one program per row (``skinny_multirow="auto"``)."""
    return SMALL_MODEL_ROW_ROWS if arch.hidden_size <= SMALL_MODEL_HIDDEN else 1


def default_skinny_rows(arch: ModelArch, multirow: str = "auto") -> int:
    """Most rows of a step that takes the skinny-matmul kernels. One program per row for every row
    ("rows") pays only up to ``default_row_rows``; with the tensor-core kernel, up to ``MAX_ROWS``."""
    return default_row_rows(arch) if multirow == "rows" else MAX_ROWS


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
    """At most ``triton_gemv.MAX_ROWS`` rows: fused skinny Triton matmuls, residual updated in place;
    up to ``row_rows`` rows one program per row, more on the tensor-core kernel.

    ``invariant`` (batch-invariant mode): every row count, every matmul on the tensor-core kernel
    with the same block sizes, so a row's result never depends on how many rows the step has
    (``triton_dot.dot_config``); the GPU runner then uses these kernels for every step, prefill
    included, and the LM head through ``invariant_logits``."""

    def __init__(self, row_rows: int = MAX_ROWS, defer: bool | None = None, invariant: bool = False) -> None:
        self.row_rows = row_rows
        self.defer = defer  # deferred reduction: None = per shape
        self.invariant = invariant

    def _gemv(self, x: torch.Tensor, layer: AnyLinear, **kw: object) -> torch.Tensor:
        return gemv(x, _weight(layer), layer.bias, dot=self.invariant or x.shape[0] > self.row_rows, defer=self.defer,
                    invariant=self.invariant, **kw)  # type: ignore[arg-type]

    def linear(self, x: torch.Tensor, layer: AnyLinear) -> torch.Tensor:
        return self._gemv(x, layer)

    def norm_linear(self, stream: ResidualStream, norm: RMSNorm, layer: AnyLinear) -> torch.Tensor:
        return self._gemv(stream.x, layer, norm_weight=norm.weight, eps=norm.eps)

    def linear_add(self, x: torch.Tensor, layer: AnyLinear, stream: ResidualStream) -> ResidualStream:
        self._gemv(x, layer, residual=stream.x)
        return stream

    def norm_gated_mlp_in(self, stream: ResidualStream, norm: RMSNorm, mlp: GatedMLP) -> torch.Tensor:
        return self._gemv(stream.x, mlp.gate_up_proj, norm_weight=norm.weight, eps=norm.eps, gated=True)  # silu(gate) * up

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


__all__ = ["CublasKernels", "MAX_ROWS", "SkinnyKernels", "default_row_rows", "default_skinny_rows", "fused_supported",
           "invariant_logits"]
