"""W4Weight: a 4-bit weight laid out for the GPU's skinny matmul (``worker/triton_w4.py``).

    W[n, k] = code[n, k] · scale[n, k // group] + offset[n, k // group]

- ``qweight``: int32 ``[N, Kp / 8]``, K padded to ``Kp``, a multiple of 128 (padding codes are 0 with
  a 0 scale and offset: zero weights). Each run of 128 codes is 16 words; nibble ``i`` (bits
  ``4i .. 4i + 3``) of word ``j`` holds code ``128·b + 16·i + j``. So one shift and mask of a
  ``[rows, 16]`` word tile yields 16 *consecutive* codes per row, each run of 16 inside one group:
  the kernel needs no interleaving shuffle, and its x slice for nibble ``i`` is one contiguous load;
- ``scale`` / ``offset``: ``[N, Kp / group]`` in the model dtype; ``group`` is a power of two from 16
  to 128 dividing K (a format's larger group is replicated down to 128: exact);
- no act-order permutation: GPTQ ``desc_act`` checkpoints dequantize to float on the GPU.

Bytes per weight: 0.5 + 4 / group (bf16 scale and offset): 0.53 at group 128, 0.625 at group 32
(plus the K padding: SmolLM2's K = 576 is stored as 640). ``dequantize`` is the float reference and
the prefill path (dequantize, then one GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.quant.weights import QuantizedWeight

W4_GROUPS = (128, 64, 32, 16)
BLOCK = 128  # codes per 16-word run


def w4_group(qw: QuantizedWeight) -> int | None:
    """The W4 group for ``qw`` (the largest of 128, 64, 32, 16 dividing its group and K), or None if it
    cannot be held: more than 4 bits, act-order, or no such group."""
    n, k = qw.shape
    if qw.bits > 4 or qw.perm is not None:
        return None
    return next((g for g in W4_GROUPS if qw.group % g == 0 and k % g == 0), None)


def _padded(k: int) -> int:
    return -(-k // BLOCK) * BLOCK


@dataclass(frozen=True)
class W4Weight:
    qweight: torch.Tensor  # int32 [N, Kp / 8]
    scale: torch.Tensor  # [N, Kp / group], model dtype
    offset: torch.Tensor  # [N, Kp / group], model dtype
    group: int
    k: int  # K before padding

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]), self.k

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
        n, k = qw.shape
        kp = _padded(k)
        codes = torch.zeros(n, kp, dtype=torch.int64, device=device)
        codes[:, :k] = qw.codes.to(device)
        runs = codes.view(n, kp // BLOCK, 8, 16)  # [n, b, i, j] = code 128 b + 16 i + j
        shifts = 4 * torch.arange(8, device=device, dtype=torch.int64).view(1, 1, 8, 1)
        words = (runs << shifts).sum(2)  # [n, b, j], < 2^32
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

        def groups(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(n, kp // group, dtype=dtype, device=device)
            out[:, :k // group] = t.to(device=device, dtype=dtype)
            return out

        return W4Weight(words.view(n, kp // 8).contiguous(), groups(qw.scale), groups(qw.offset), group, k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    def codes(self) -> torch.Tensor:
        """uint8 ``[N, K]``: the codes in natural K order."""
        n, kp = self.qweight.shape[0], self.qweight.shape[1] * 8
        words = self.qweight.view(n, kp // BLOCK, 1, 16)
        shifts = 4 * torch.arange(8, device=self.device, dtype=torch.int32).view(1, 1, 8, 1)
        return ((words >> shifts) & 15).to(torch.uint8).view(n, kp)[:, :self.k]

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` in the model dtype: (code · scale + offset) in float32, rounded once."""
        n, k = self.shape
        g = self.group
        codes = self.codes().view(n, k // g, g).float()
        w = codes * self.scale[:, :k // g, None].float() + self.offset[:, :k // g, None].float()
        return w.view(n, k).to(self.dtype)
