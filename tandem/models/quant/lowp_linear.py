"""The shared ``forward`` of the CPU packed kernel modules (``int8pack.py``, ``q4_linear.py``)."""

from __future__ import annotations

import torch
from torch import nn


class LowpLinear(nn.Module):
    """A packed linear whose ``forward_lowp(x)`` (2-D ``x``, no bias) is the kernel's product in the
    kernel's output dtype: ``forward`` flattens x's leading dimensions, casts back to x's dtype and
    adds the bias."""

    out_features: int
    bias: nn.Parameter | None

    def forward_lowp(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.forward_lowp(x.reshape(-1, shape[-1])).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)
