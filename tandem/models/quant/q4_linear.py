"""CPU module for ≤ 8-bit weights on tandem's own kernel (``cpu_q4.py``): ``x @ W^T + b``.

Chosen over ``int4pack`` (``kernels.py``) wherever ``cpu_q4.available()`` (AVX-512 BF16, or AVX2 + FMA): the same
bf16 activations, but scale and offset in float32 (exact for every format) and float32 output, and a
verify's rows cost little more than a decode's row (docs/performance.md §46). Act-order weights
gather x's columns first (``perm``), as ``int4pack`` does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.models.quant import cpu_q4
from tandem.models.quant.lowp_linear import LowpLinear
from tandem.models.quant.weights import QuantizedWeight

class Q4Linear(LowpLinear):
    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None,
                 blocks: Callable[[int, int], QuantizedWeight] | None = None) -> None:
        """``blocks(r0, r1)``: the rows ``r0:r1`` of ``qw``, made on demand (``qw`` then gives only the
        shape, group and bits), so a caller can pack a large matrix without holding all of its codes."""
        super().__init__()
        self.kernel = f"cpu_q{cpu_q4.code_bits(qw)}"  # the log's name: nibble (q4) or byte (q8) layout
        self.out_features, self.in_features = qw.shape
        self.group = qw.group
        self.source = qw.source
        self.register_buffer("packed", cpu_q4.pack(qw, blocks))  # uint8 [N / 16, K / G, group bytes]
        self.register_buffer("perm", qw.perm)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.lowp = bias is None  # forward_lowp is the whole product (torch_kernels.py)

    def forward_lowp(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] bf16(x) @ W^T`` in float32 for 2-D ``x`` (no bias): the same interface as
        ``Int4PackLinear.forward_lowp`` (whose output is bf16), what the layer kernels add to the
        residual (here inside the kernel: the same float32 sum)."""
        packed, perm = self._args or self._cache_args()
        h = x.to(torch.bfloat16)
        if perm is not None:
            h = h.index_select(1, perm)
        return cpu_q4.mm(h, packed, self.group, residual=residual)  # torch.ops.tandem.q4_mm, without the dispatcher

    def fuses_norm(self, norm: nn.Module, x: torch.Tensor) -> bool:
        """Whether :meth:`forward_norm` takes ``norm`` (a Llama RMS norm, float32 weight) before this
        linear for ``x`` (2-D float32): no bias, no act-order."""
        return (self.bias is None and self.perm is None and x.dim() == 2 and x.dtype is torch.float32
                and not getattr(norm, "offset", True) and norm.weight.dtype is torch.float32)

    def forward_norm(self, x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """``bf16(rms_norm(x)) @ W^T`` in float32, the norm computed in the kernel (``fuses_norm``)."""
        packed, _ = self._args or self._cache_args()
        return cpu_q4.mm(x, packed, self.group, norm.weight, float(norm.eps))

    # The buffers as a plain tuple (a buffer lookup through nn.Module.__getattr__ costs ~1 µs);
    # dropped whenever the module's tensors are replaced (``_apply``).
    _args: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _cache_args(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._args = (self.packed, self.perm)
        return self._args

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._args = None
        return super()._apply(fn, recurse)

    def nbytes(self) -> int:
        return self.packed.numel()

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group}, "
                f"act_order={self.perm is not None}, source={self.source}")
