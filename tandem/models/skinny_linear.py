"""SkinnyLinear: a float32 CPU linear whose steps of 1–8 rows all run on ``cpu_skinny``.

Why: an EAGLE head's weights are small (SmolLM2's head: 30 MB in float32) and stay in the caches
between its steps, where ``layers.linear``'s paths — the split GEMV for one row, ``W @ xᵀ`` for
more — run far below the kernel's speed: in a head step at context 300 on the 2-core CPU,
gate_up (3072 × 576) took 0.103 ms for 1 row and 0.212 ms for 4 on ``layers.linear``, 0.055 / 0.109
ms on ``cpu_skinny``; a head step of 1 / 2 / 4 rows 0.98 / 1.94 / 2.24 → 0.89 / 1.02 / 1.21 ms
(docs/performance.md §48). The first step of every EAGLE proposal takes the accepted tokens' rows
(1 to k + 1), so half of a proposal's head time was in those multi-row steps.

The kernel computes a row by the same instructions whatever the row count, so a head row's bits do
not depend on how many rows its step has (up to 8) — a proposal chained on a verify still on the
device drafts what one run after the read drafts (tests/worker/test_head_runner.py). Steps of more
rows (a proposal's first step after a prefill) and autograd (``train-draft``) keep ``layers.linear``.
Where the kernel cannot be built nothing is replaced.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models import cpu_skinny
from tandem.models.layers import Linear, PackedLinear, linear
from tandem.models.quant.attach import replace_module


def _applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and 1 <= x.shape[0] <= cpu_skinny.MAX_ROWS and x.dtype is torch.float32
            and weight.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and cpu_skinny.available())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ + b`` for 2-D x: on ``cpu_skinny`` for 1–8 float32 CPU rows without autograd (a
    contiguous weight, the kernel built), else ``layers.linear``."""
    if _applies(x, weight):
        y = cpu_skinny.mm(x, weight)
        return y + bias if bias is not None else y
    return linear(x, weight, bias)


class SkinnyLinear(nn.Module):
    """A float linear's own parameters multiplied by :func:`skinny_linear`. Where the float32 weight
    holds bfloat16 values (a head saved in bf16, as the shipped ones are), its 1–8-row steps read a
    bf16 copy instead: bitwise the same products (the kernel widens bf16 exactly), half the bytes —
    the first head step after a verify reads its weights from DRAM (§48)."""

    kernel = "skinny"
    lowp = False

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        w = weight.detach()
        narrow = w.bfloat16()
        # (a plain attribute, not a buffer: a copy of the weight, not a parameter of its own)
        self.narrow = narrow if w.is_contiguous() and torch.equal(narrow.float(), w) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        w = self.weight
        if self.narrow is not None and _applies(x2, self.narrow) and not (torch.is_grad_enabled() and
                                                                       w.requires_grad):
            w = self.narrow  # bitwise the float weight's result
        y = skinny_linear(x2, w, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def use_skinny_linears(module: nn.Module) -> int:
    """Replace every float32 CPU ``Linear`` / ``PackedLinear`` inside ``module`` by a ``SkinnyLinear``
    over the same parameters; how many were replaced (0 where the kernel cannot be built)."""
    names = [name for name, m in module.named_modules()
             if type(m) in (Linear, PackedLinear) and m.weight.dtype is torch.float32
             and m.weight.device.type == "cpu"]
    if not names or not cpu_skinny.available():
        return 0
    for name in names:
        m = module.get_submodule(name)
        replace_module(module, name, SkinnyLinear(m.weight, m.bias))
    return len(names)
