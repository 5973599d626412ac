"""CPU float32 linears on oneDNN with weights prepacked once at load (the kernel torch's own CPU
compiler uses for linears: ``mkldnn._reorder_linear_weight`` + ``mkldnn._linear_pointwise``).

Why: a verify step multiplies k + 1 rows, and on the 2-core CI-class CPU the BLAS paths of
``layers.linear`` cost about twice a decode's single row for 4 rows, so a float32 verify of SmolLM2
cost 2.2–2.4 decode steps and speculation could not pay. On prepacked weights oneDNN's small-batch
GEMM costs little more than one row's time for 3–8 rows, but one or two rows run faster on
``layers.linear`` (its split GEMV; ``W @ xᵀ`` for two rows, about one row's time). So a
``OneDnnLinear`` keeps both: steps of one or two rows (a decode, a verify of one draft) on the float
weight as before, steps of more rows (longer verifies, prefill) on the packed copy
(docs/performance.md §31: a step of SmolLM2 float32, 1 / 4 / 5 rows: 28.5–34.3 / 67–77 / 102–110 ms
before, 45–47 ms for 4–5 rows on oneDNN; §41 for two rows). The copy costs the decoder linears'
bytes again, so the builder makes it only for a target (and draft) that verifies drafts:
``RunnerConfig.cpu_onednn``.

Scope: a model whose decoder linears are all float32 on the CPU (no packed quantized kernels: their
TorchScript decode and row-exact verify paths expect those modules), outside batch-invariant mode.
The LM head gets the same two paths (``OneDnnHead``: a verify's 4 rows of SmolLM2's 49152 × 576 head
cost 4.3–4.7 ms on ``layers.linear``, 3.3 ms prepacked; the copy adds the head's bytes again).
Where this torch build has no oneDNN, nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.layers import Linear, PackedLinear, linear, skinny_applies
from tandem.models.quant.attach import LAYER_LINEARS, replace_module

# Steps of at most this many rows stay on ``layers.linear``. SmolLM2's shapes, 2 threads, ms for
# 30 layers (the head alone): 2 rows there / on oneDNN: qkv 1.99 / 2.82, o 1.27 / 1.88, gate_up
# 6.41 / 9.33, down 3.23 / 4.70, head 2.89 / 4.76 (1 row there 1.85, 1.13, 6.06, 2.83, 2.78); at 3
# rows oneDNN is faster on each (2.41 vs 2.68 … 3.46 vs 4.03; docs/performance.md §41).
PLAIN_MAX_ROWS = 2


def available() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


class OneDnnLinear(nn.Module):
    """``y = x W^T + b``: up to PLAIN_MAX_ROWS rows from the float weight (``layers.linear``), more from W
    prepacked for oneDNN (float32, CPU)."""

    kernel = "onednn"
    lowp = False

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias  # the float module's own parameters (no copy)
        self.out_features, self.in_features = weight.shape
        # (a plain attribute, not a buffer: an opaque oneDNN tensor has no storage to save or move)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _multiply(x.reshape(-1, self.in_features), self.weight, self.bias, self.packed)
        return y.reshape(*x.shape[:-1], self.out_features)


class OneDnnHead:
    """The LM head's ``x W^T`` as ``OneDnnLinear`` computes it (not a module: the weight is the
    model's own head or tied embedding, already in its state dict)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [N, H] → [N, V]
        return _multiply(x, self.weight, None, self.packed)


def _multiply(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              packed: torch.Tensor) -> torch.Tensor:
    """``x W^T + b`` for x [N, K]: up to PLAIN_MAX_ROWS rows (or with autograd on) on the float
    weight, as are the rows ``cpu_skinny``'s kernel takes there (2–8: a verify's 4 rows of SmolLM2
    cost 10–16 ms on it against 15–19 ms here, docs/performance.md §45); more on the packed copy."""
    if x.shape[0] <= PLAIN_MAX_ROWS or torch.is_grad_enabled() or skinny_applies(x, weight):
        return linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_float_linears(model: nn.Module) -> int:
    """Replace every decoder layer's float32 CPU linear by a ``OneDnnLinear`` (same parameters, plus
    the packed copy), and give a float32 LM head a ``OneDnnHead``; how many linears were replaced.
    Does nothing unless all of them are float32 on the CPU and oneDNN is there."""
    layers = model.model.layers  # type: ignore[union-attr]
    names = [f"model.layers.{i}.{rel}" for i in range(len(layers)) for rel in LAYER_LINEARS]
    modules = [model.get_submodule(n) for n in names]
    if not names or not available() or not all(
            type(m) in (Linear, PackedLinear) and m.weight.dtype is torch.float32 and m.weight.device.type == "cpu"
            for m in modules):
        return 0
    with torch.no_grad():
        for name, m in zip(names, modules):
            replace_module(model, name, OneDnnLinear(m.weight, m.bias))
        head, lowp = model.lm_head_weight, model.lm_head_lowp  # type: ignore[union-attr]
        if head.dtype is torch.float32 and head.device.type == "cpu" and lowp is None:
            model.lm_head_onednn = OneDnnHead(head)  # type: ignore[union-attr]
    return len(names)
