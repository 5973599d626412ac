"""W4Weight: a 4-bit weight laid out for the GPU's int4 matmul (``worker/triton_w4.py``): each lane of
a warp loads, in one 16-byte read, exactly the codes its ``mma.sync.m16n8k16`` A fragments need.

    W[n, k] = code[n, k] · scale[n, k // group] + offset[n, k // group]

- ``qweight``: int32 ``[N / 16, Kp / 64, 32, 4]``: rows in tiles of 16, K padded to ``Kp`` (a multiple of
  64 and of the group; padding codes are 0 with a 0 scale and offset: zero weights) in chunks of 64.
  Lane ``L = 4g + τ`` of tile ``t``, chunk ``c`` holds four words, word ``s`` for the chunk's ``s``-th
  16-wide K step: with ``k = 64c + 16s + 4τ``, its nibble ``h + NIB[kk]`` (``NIB = (0, 4, 2, 6)``) is
  the code of row ``16t + 8h + g`` at ``k + kk`` (h = 0, 1; kk = 0..3). So nibbles ``j`` and ``j + 4``
  of a word are the two bf16/fp16 halves of A register ``j`` of that step's fragment (rows g / g + 8,
  K slots 2τ, 2τ + 1 / 2τ + 8, 2τ + 9 ↔ k + 0, 1 / k + 2, 3): one shift and one and-or per register
  turn a word into the fragment as ``1 + q/16``;
- ``scale`` / ``offset``: ``[N, Kp / group]`` in the model dtype; ``group`` a power of two from 16 to 128
  dividing K (a format's larger group is replicated down to 128: exact); one 16-wide K step never
  crosses a group;
- no act-order permutation: GPTQ ``desc_act`` checkpoints dequantize to float on the GPU.

Bytes per weight: 0.5 + 4 / group (bf16 scale and offset): 0.53 at group 128, 0.625 at group 32
(plus the K padding). ``dequantize`` is the float reference and the prefill path (dequantize, then one
GEMM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.models.quant.weights import QuantizedWeight

W4_GROUPS = (128, 64, 32, 16)
CHUNK = 64  # codes of a row per lane-chunk (four 16-wide K steps)
TILE = 16  # rows per tile
NIB = (0, 4, 2, 6)  # nibble of code k + kk (row half h adds h)


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def nibble_shifts(device: torch.device) -> torch.Tensor:
    """int64 ``[1, 2, 1, 1, 1, 1, 4]`` bit shifts ``4 (h + NIB[kk])`` on ``device``, made once per device
    at packing time (``codes`` may run inside a CUDA graph capture, which allows no host copy)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:  # one key for "cuda" and "cuda:N"
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _SHIFTS:
        nib = torch.tensor([[h + j for j in NIB] for h in (0, 1)], dtype=torch.int64)
        _SHIFTS[dev] = (4 * nib).view(1, 2, 1, 1, 1, 1, 4).to(dev)
    return _SHIFTS[dev]


def w4_group(qw: QuantizedWeight) -> int | None:
    """The W4 group for ``qw`` (the largest of 128, 64, 32, 16 dividing its group and K), or None if it
    cannot be held: more than 4 bits, act-order, or no such group."""
    n, k = qw.shape
    if qw.bits > 4 or qw.perm is not None or n % TILE:
        return None
    return next((g for g in W4_GROUPS if qw.group % g == 0 and k % g == 0), None)


def _padded(k: int, group: int) -> int:
    step = max(CHUNK, group)
    return -(-k // step) * step


@dataclass(frozen=True)
class W4Weight:
    qweight: torch.Tensor  # int32 [N / 16, Kp / 64, 32, 4] (see the module docstring)
    scale: torch.Tensor  # [N, Kp / group], model dtype
    offset: torch.Tensor  # [N, Kp / group], model dtype
    group: int
    k: int  # K before padding

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.qweight.shape[0]) * TILE, self.k

    @property
    def kp(self) -> int:
        """K padded (a multiple of 64 and of the group)."""
        return int(self.qweight.shape[1]) * CHUNK

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
        kp = _padded(k, group)
        codes = torch.zeros(n, kp, dtype=torch.int64, device=device)
        codes[:, :k] = qw.codes.to(device)
        # [t, h, g, c, s, tau, kk]: row 16 t + 8 h + g, k = 64 c + 16 s + 4 tau + kk
        c7 = codes.view(n // TILE, 2, 8, kp // CHUNK, 4, 4, 4)
        words = (c7 << nibble_shifts(device)).sum(dim=(1, 6))  # [t, g, c, s, tau], < 2^32
        words = words.permute(0, 2, 1, 4, 3).reshape(n // TILE, kp // CHUNK, 32, 4)  # lane 4 g + tau, word s
        words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

        def groups(t: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(n, kp // group, dtype=dtype, device=device)
            out[:, :k // group] = t.to(device=device, dtype=dtype)
            return out

        return W4Weight(words.contiguous(), groups(qw.scale), groups(qw.offset), group, k)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale, self.offset))

    def codes(self) -> torch.Tensor:
        """uint8 ``[N, K]``: the codes in natural K order."""
        n, kp = self.shape[0], self.kp
        words = self.qweight.to(torch.int64).view(n // TILE, kp // CHUNK, 8, 4, 4)  # [t, c, g, tau, s]
        words = words.permute(0, 2, 1, 4, 3).reshape(n // TILE, 1, 8, kp // CHUNK, 4, 4, 1)
        c7 = (words >> nibble_shifts(self.device)) & 15  # [t, h, g, c, s, tau, kk]
        return c7.to(torch.uint8).reshape(n, kp)[:, :self.k]

    def dequantize(self) -> torch.Tensor:
        """``[N, K]`` in the model dtype: (code · scale + offset) in float32, rounded once."""
        n, k = self.shape
        g = self.group
        codes = self.codes().view(n, k // g, g).float()
        w = codes * self.scale[:, :k // g, None].float() + self.offset[:, :k // g, None].float()
        return w.view(n, k).to(self.dtype)
