"""W4Weight: a 4-bit weight laid out for the GPU's skinny matmul (``worker/triton_gemv.py``).

    W[n, k] = code[n, k] · scale[n, k // group] + offset[n, k // group]    (rounded to the model dtype)

- ``qweight``: uint8 ``[N, K / 2]``; byte ``j`` of row ``n`` holds code ``2j`` in its low nibble and
  code ``2j + 1`` in its high nibble (natural K order, no interleaving);
- ``scale`` / ``offset``: ``[N, K / group]`` in the model dtype; ``group`` is a power of two ≥ 16
  dividing K (a format's larger group is replicated down to it when needed: exact);
- no act-order permutation: GPTQ ``desc_act`` checkpoints dequantize to float on the GPU.

Bytes per weight: 0.5 + 4 / group (bf16 scale and offset): 0.53 at group 128, 0.625 at group 32.
``dequantize`` is the float reference (and the prefill path: dequantize, then one GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.quant.weights import QuantizedWeight

W4_GROUPS = (256, 128, 64, 32, 16)


def w4_group(qw: QuantizedWeight) -> int | None:
    """The W4 group for ``qw`` (the largest power of two dividing its group and K), or None if it
    cannot be held: more than 4 bits, act-order, or an odd K."""
    n, k = qw.shape
    if qw.bits > 4 or qw.perm is not None or k % 2:
        return None
    return next((g for g in W4_GROUPS if qw.group % g == 0 and k % g == 0), None)


@dataclass(frozen=True)
class W4Weight:
    qweight: torch.Tensor  # uint8 [N, K / 2]
    scale: torch.Tensor  # [N, K / group], model dtype
    offset: torch.Tensor  # [N, K / group], model dtype
    group: int

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), 2 * int(self.qweight.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def device(self) -> torch.device:
        return self.qweight.device

    @staticmethod
    def pack(qw: QuantizedWeight, dtype: torch.dtype, device: torch.device) -> W4Weight:
        group = w4_group(qw)
        if group is None:
            raise ValueError(f"{qw.source} {qw.shape} ({qw.bits} bits, group {qw.group}) does not fit W4")
        qw = qw.with_group(group)
        codes = qw.codes.to(device)
        qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        return W4Weight(qweight, qw.scale.to(device=device, dtype=dtype).contiguous(),
                        qw.offset.to(device=device, dtype=dtype).contiguous(), group)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` in the model dtype, as the kernel rounds it: (code · scale + offset) in float32,
        then rounded once."""
        n, k = self.shape
        codes = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1).view(n, k // self.group, self.group)
        w = codes.float() * self.scale.float()[:, :, None] + self.offset.float()[:, :, None]
        return w.view(n, k).to(self.dtype)
