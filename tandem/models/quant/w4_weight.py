"""W4Weight: a 4-bit weight laid out for the GPU's skinny matmul (``worker/triton_w4.py``).

    W[n, k] = code[n, k] · scale[n, k // group] + offset[n, k // group]

- ``qweight``: int32 ``[N, Kp / 8]``, K padded to ``Kp``, a multiple of 128 (padding codes are 0 with
  a 0 scale and offset: zero weights). Each run of 128 codes is 16 words; word ``j`` holds the codes
  ``128·b + 16·i + j`` for i = 0..7, code ``i`` in nibble ``p = NIBBLE[i]`` (bits ``4p .. 4p + 3``): even
  ``i`` in the low half-word (nibbles 0..3), odd ``i`` in the high one (nibbles 4..7), so nibbles
  ``t`` and ``t + 4`` hold codes ``i = 2t`` and ``2t + 1``. One shift and one mask of a word then
  give two 16-bit floats at once (``(w >> s) & 0x000F000F``-style, the codes of one group for any
  group ≥ 32): the kernel's two-codes-per-operation unpack into tensor-core operands. Each run of 16
  codes (fixed ``i``) lies inside one group. Rows are stored in tiles of ``T = tile_rows(N)`` (16
  where N allows): ``qweight`` viewed as ``[N / T, Kp / 128, T, 16]`` holds word ``j`` of run ``b``
  of row ``T·a + r`` at ``[a, b, r, j]``, so a column block's read of its next run is one
  contiguous 1 KiB block rather than 64-byte pieces 2 KiB apart (measured on the H200: no faster or
  slower than rows one after the other, 2026-12-02);
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
NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)  # NIBBLE[i]: the nibble of a word holding code 16 i + j of its run
TILE_ROWS = 16  # rows per tile (fewer where N is not a multiple: see tile_rows)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def nibble_shifts(device: torch.device) -> torch.Tensor:
    """int32 ``[1, 1, 8, 1]`` bit shifts of the nibbles of a word on ``device``, made once per
    device at packing time (``codes`` may run inside a CUDA graph capture, which allows no host copy)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # one key for "cuda" and "cuda:N"
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _SHIFTS:
        _SHIFTS[dev] = 4 * torch.tensor(NIBBLE, device=dev, dtype=torch.int32).view(1, 1, 8, 1)
    return _SHIFTS[dev]


def tile_rows(n: int) -> int:
    """Rows per tile for an N-row weight: the largest power of two up to ``TILE_ROWS`` dividing N."""
    t = TILE_ROWS
    while n % t:
        t //= 2
    return t


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
    qweight: torch.Tensor  # int32 [N, Kp / 8] (rows tiled: see the module docstring)
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
        shifts = 4 * torch.tensor(NIBBLE, device=device, dtype=torch.int64).view(1, 1, 8, 1)
        words = (runs << shifts).sum(2)  # [n, b, j], < 2^32
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
        t = tile_rows(n)  # [n, b, j] -> [n / t, b, t, j]: a tile's rows of one run are one contiguous block
        words = words.view(n // t, t, kp // BLOCK, 16).transpose(1, 2)

        def groups(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(n, kp // group, dtype=dtype, device=device)
            out[:, :k // group] = t.to(device=device, dtype=dtype)
            return out

        nibble_shifts(device)  # made now, outside any graph capture
        return W4Weight(words.reshape(n, kp // 8).contiguous(), groups(qw.scale), groups(qw.offset), group, k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    def codes(self) -> torch.Tensor:
        """uint8 ``[N, K]``: the codes in natural K order."""
        n, kp = self.qweight.shape[0], self.qweight.shape[1] * 8
        t = tile_rows(n)
        words = self.qweight.view(n // t, kp // BLOCK, t, 16).transpose(1, 2).reshape(n, kp // BLOCK, 1, 16)
        return ((words >> nibble_shifts(self.device)) & 15).to(torch.uint8).view(n, kp)[:, :self.k]

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` in the model dtype: (code · scale + offset) in float32, rounded once."""
        n, k = self.shape
        g = self.group
        codes = self.codes().view(n, k // g, g).float()
        w = codes * self.scale[:, :k // g, None].float() + self.offset[:, :k // g, None].float()
        return w.view(n, k).to(self.dtype)
