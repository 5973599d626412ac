"""CPU kernel: ``aten._weight_int8pack_mm`` (int8 codes, one bf16 scale per output row).

Holds exactly the symmetric per-channel 8-bit weights: compressed-tensors W8A16 ``channel`` and the
on-the-fly ``int8`` quantization (``W = s[n] · q``, ``q`` int8). Grouped 8-bit formats (Q8_0, W8A16
``group``) do not fit (one scale per row) and go to the two-plane int4pack path instead. Activations
run in bf16 (the fp32 path is 3–14× slower, docs/quant_notes.md).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.quant.lowp_linear import LowpLinear
from tandem.models.quant.weights import QuantizedWeight

_aten = torch.ops.aten


def fits_int8pack(qw: QuantizedWeight) -> bool:
    """Per-channel, 8-bit, symmetric (offset = −128·scale), no act-order permutation."""
    return (qw.bits == 8 and qw.group == qw.shape[1] and qw.perm is None
            and bool(torch.equal(qw.offset, -128 * qw.scale)))


class Int8PackLinear(LowpLinear):
    kernel = "int8pack"

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        if not fits_int8pack(qw):
            raise ValueError(f"{qw.source} {qw.shape} is not symmetric per-channel 8-bit")
        self.out_features, self.in_features = qw.shape
        self.source = qw.source
        self.register_buffer("qweight", (qw.codes.to(torch.int16) - 128).to(torch.int8).contiguous())
        self.register_buffer("scales", qw.scale[:, 0].to(torch.bfloat16).contiguous())
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.lowp = bias is None  # forward_lowp is the whole product (torch_kernels.py)

    def forward_lowp(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` for 2-D ``x``, in the kernel's bf16 (no bias; see ``Int4PackLinear.forward_lowp``)."""
        h = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        return _aten._weight_int8pack_mm(h.contiguous(), self.qweight, self.scales)

    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, source={self.source}"
