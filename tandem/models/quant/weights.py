"""QuantizedWeight: one weight-only quantized matrix in a format-neutral form, before a kernel packs it.

Every checkpoint format (GGUF blocks, GPTQ, AWQ, compressed-tensors) and the on-the-fly quantizers
unpack into this one shape, and every CPU kernel module packs from it::

    W[n, perm[k]] = scale[n, k // group] * codes[n, k] + offset[n, k // group]

- ``codes``: uint8 ``[N, K]``, each < ``2**bits`` (``bits`` ≤ 8). Signed formats are stored with
  their offset folded into ``offset`` (Q8_0's int8 ``q`` is ``code - 128``: ``offset = -128·d``).
- ``scale`` / ``offset``: float32 ``[N, K / group]`` (per-group affine map; ``group = K`` is per
  output channel). GPTQ / AWQ ``w = s·(q − z)`` is ``scale = s, offset = −s·z``.
- ``perm``: None, or int64 ``[K]`` for GPTQ act-order (``desc_act``): the stored columns are sorted
  so that each group is contiguous, and input feature ``perm[k]`` meets stored column ``k``; a kernel
  gathers ``x[..., perm]`` before the matmul.

``source`` names the format for logs and errors (``"gguf Q4_1"``, ``"gptq"``, ...). ``dequantize()``
is the float reference every kernel is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K]
    scale: torch.Tensor  # float32 [N, K // group]
    offset: torch.Tensor  # float32 [N, K // group]
    group: int
    bits: int
    source: str
    perm: torch.Tensor | None = None  # int64 [K] (act-order) or None

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        if self.codes.dtype != torch.uint8 or not 1 <= self.bits <= 8:
            raise ValueError(f"{self.source}: codes must be uint8 of at most 8 bits")
        if self.group <= 0 or k % self.group:
            raise ValueError(f"{self.source}: group {self.group} does not divide K={k}")
        want = (n, k // self.group)
        if tuple(self.scale.shape) != want or tuple(self.offset.shape) != want:
            raise ValueError(f"{self.source}: scale/offset must be {want}, got {tuple(self.scale.shape)} / "
                             f"{tuple(self.offset.shape)}")
        if self.perm is not None and tuple(self.perm.shape) != (k,):
            raise ValueError(f"{self.source}: perm must have K={k} entries")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.codes.shape[0]), int(self.codes.shape[1]))

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float matrix ``[N, K]`` in input-feature order (the reference for every kernel);
        written into ``out`` (any float dtype and device) when given."""
        n, k = self.shape
        w = out if out is not None else torch.empty(n, k, dtype=dtype)
        if tuple(w.shape) != (n, k):
            raise ValueError(f"{self.source}: cannot dequantize {self.shape} into {tuple(w.shape)}")
        # Row chunks of ~256k elements (1 MB in float32): no full-size temporaries, and chunks small
        # enough that the heap reuses them (16 MB ones raised SmolLM2's peak load RSS by ~55 MB).
        step = max(1, (1 << 18) // max(k, 1))
        for r in range(0, n, step):
            c = self.codes[r:r + step].float().view(-1, k // self.group, self.group)
            c.mul_(self.scale[r:r + step, :, None]).add_(self.offset[r:r + step, :, None])
            c = c.view(-1, k)
            if self.perm is not None:
                c = torch.empty_like(c).index_copy_(1, self.perm, c)
            w[r:r + step].copy_(c)
        return w

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> QuantizedWeight:
        """Apply a row permutation (e.g. llama.cpp's q/k un-permute) to codes, scales and offsets."""
        return replace(self, codes=fn(self.codes), scale=fn(self.scale), offset=fn(self.offset))

    def with_group(self, group: int) -> QuantizedWeight:
        """The same weights with scales replicated to a smaller group that divides the current one."""
        if group == self.group:
            return self
        if self.group % group:
            raise ValueError(f"group {group} does not divide {self.group}")
        r = self.group // group
        return replace(self, group=group, scale=self.scale.repeat_interleave(r, 1),
                       offset=self.offset.repeat_interleave(r, 1))


def concat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    """Stack shards along N (q/k/v → qkv, gate/up → gate_up), or None if they cannot share one matmul
    (different K or act-order permutation). Groups are unified to their gcd, bits to their maximum:
    both exact (a b-bit code is a valid (b+1)-bit code with the same scale)."""
    first = parts[0]
    k = first.shape[1]
    for p in parts[1:]:
        if p.shape[1] != k:
            return None
        if (p.perm is None) != (first.perm is None) or (
                p.perm is not None and first.perm is not None and not torch.equal(p.perm, first.perm)):
            return None
    group = math.gcd(*(p.group for p in parts))
    parts = [p.with_group(group) for p in parts]
    sources = sorted({p.source for p in parts})
    return QuantizedWeight(
        codes=torch.cat([p.codes for p in parts]), scale=torch.cat([p.scale for p in parts]),
        offset=torch.cat([p.offset for p in parts]), group=group, bits=max(p.bits for p in parts),
        source="+".join(sources), perm=first.perm)


def quantize_float(w: torch.Tensor, bits: int, group: int | None, symmetric: bool, source: str
                   ) -> QuantizedWeight:
    """Round-to-nearest weight-only quantization of a float ``[N, K]`` (on-the-fly int8 / int4).

    ``group=None``: one scale per output channel. Symmetric: ``w ≈ s·(code − 2^(bits−1))`` with
    ``s = max|w| / (2^(bits−1) − 1)``; asymmetric: ``w ≈ s·code + min`` over the group's range."""
    w = w.detach().float()
    n, k = w.shape
    g = k if group is None else group
    wg = w.reshape(n, k // g, g)
    half = 1 << (bits - 1)
    if symmetric:
        s = wg.abs().amax(-1) / (half - 1)
        s = torch.where(s == 0, torch.ones_like(s), s)
        codes = (torch.round(wg / s[..., None]) + half).clamp(0, 2 * half - 1)
        offset = -half * s
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = (hi - lo) / (2 * half - 1)
        s = torch.where(s == 0, torch.ones_like(s), s)
        codes = torch.round((wg - lo[..., None]) / s[..., None]).clamp(0, 2 * half - 1)
        offset = lo
    return QuantizedWeight(codes=codes.to(torch.uint8).reshape(n, k), scale=s.contiguous(),
                           offset=offset.contiguous(), group=g, bits=bits, source=source)
