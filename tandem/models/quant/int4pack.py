"""CPU kernel: ``aten._weight_int4pack_mm_for_cpu`` (uint4 codes, a bf16 scale and zero per group of K).

The kernel computes ``W[n, k] = (q[n, k] − 8) · scale[g, n] + zero[g, n]`` with ``g = k // G`` and
``G ∈ {32, 64, 128, 256}``, bf16 activations in and out (fp32 activations take a scalar reference path
that is 5–20× slower, docs/quant_notes.md). A :class:`QuantizedWeight` maps onto it exactly:

- ≤ 4 bits: the same codes, ``scale = s``, ``zero = offset + 8·s``;
- 5–8 bits (Q5_x, Q8_0, 8-bit groups): two 4-bit planes side by side along K, ``code = 16·hi + lo``
  (``hi`` with scale ``16·s``, ``lo`` with scale ``s``; the offset goes to the ``lo`` plane's zero,
  see ``__init__``). The input is fed twice (``[x, x]``), so one kernel call sums both planes;
- the kernel group is the largest of 256/128/64/32 dividing the format's group and K; scales are
  replicated down to it (exact). Formats whose group is not a multiple of 32 (Q6_K's 16) do not fit.

What is not exact: scale and zero are stored in bf16 (8 mantissa bits; GGUF's fp16 ``d`` keeps 11),
and activations are rounded to bf16. Both are measured in docs/quantization.md. Requires N % 16 == 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tandem.models.quant.weights import QuantizedWeight

KERNEL_GROUPS = (256, 128, 64, 32)
PACK_ROWS = 256  # rows packed at a time (a multiple of the kernel's 64-row blocks: the same bytes as at once)
_aten = torch.ops.aten


def kernel_group(qw: QuantizedWeight) -> int | None:
    """The int4pack group for ``qw``, or None if the kernel cannot hold it exactly."""
    n, k = qw.shape
    if n % 16:
        return None
    return next((g for g in KERNEL_GROUPS if qw.group % g == 0 and k % g == 0), None)


def plane_affine(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel's float32 scale and zero per plane group, [N, K·planes / G] each (before they are
    rounded to bf16), and the per-group shift ``c`` of the hi plane's codes (None for one plane)."""
    s, o = qw.scale, qw.offset
    if qw.bits <= 4:
        return s, o + 8 * s, None
    # hi plane: codes hi + c, scale 16·s, zero 0 -> 16·s·hi + 16·s·(c − 8); lo plane: scale s,
    # zero o + (136 − 16·c)·s. c (per group, keeping hi + c ≤ 15) brings the lo zero within
    # ±8·s, where bf16 rounds it like a 4-bit format's (Q8_0, Q5_0: exactly 8·s / −8·s).
    hi_max = (1 << (qw.bits - 4)) - 1
    ratio = torch.where(s != 0, o / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros_like(s))
    c = ((ratio + 136) / 16).round().clamp(0, 15 - hi_max)
    return torch.cat([16 * s, s], dim=1), torch.cat([torch.zeros_like(o), o + (136 - 16 * c) * s], dim=1), c


def kernel_planes(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """What the kernel is given for ``qw`` (already at its kernel group, ``qw.with_group``): 4-bit codes
    [N, K·planes] (uint8, 0..15), float32 scale and zero [N, K·planes / G] (``plane_affine``; rounded
    to bf16 when stored), and the number of planes (1 for ≤ 4 bits; 2 for 5–8 bits, the input fed twice)."""
    scale, zero, c = plane_affine(qw)
    if c is None:
        return qw.codes, scale, zero, 1
    hi = (qw.codes >> 4) + c.to(torch.uint8).repeat_interleave(qw.group, 1)
    return torch.cat([hi, qw.codes & 15], dim=1), scale, zero, 2


class Int4PackLinear(nn.Module):
    """``x @ W^T + b`` from int4pack weights; ``forward`` takes float activations of any dtype."""

    kernel = "int4pack"

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None,
                 blocks: Callable[[int, int], QuantizedWeight] | None = None) -> None:
        """``blocks(r0, r1)``: the rows ``r0:r1`` of ``qw``, made on demand (default: slices of ``qw``),
        so a caller can pack a large matrix without holding all of its codes."""
        super().__init__()
        group = kernel_group(qw)
        if group is None:
            raise ValueError(f"{qw.source} {qw.shape} (group {qw.group}) does not fit int4pack")
        qw = qw.with_group(group)
        n, k = qw.shape
        self.planes = 1 if qw.bits <= 4 else 2
        kp = k * self.planes
        # Outputs first, then the blocks' temporaries (the heap reuses them block after block).
        packed = torch.empty((n, kp // 2), dtype=torch.uint8)  # the CPU layout: [N, K·planes / 2] bytes
        scale_zeros = torch.empty((kp // group, n, 2), dtype=torch.bfloat16)
        for r0 in range(0, n, PACK_ROWS):  # in row blocks: the int32 codes of a 49152-row head are 226 MB
            if blocks is not None:
                part = blocks(r0, min(n, r0 + PACK_ROWS)).with_group(group)
            else:
                part = qw if n <= PACK_ROWS else qw.map_rows(lambda t, r=r0: t[r:r + PACK_ROWS])
            codes, scale, zero, _ = kernel_planes(part)
            rows = slice(r0, r0 + len(codes))
            packed[rows] = _aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
            scale_zeros[:, rows] = torch.stack([scale, zero], -1).transpose(0, 1)
        self.in_features, self.out_features, self.group = k, n, group
        self.source = qw.source
        self.register_buffer("packed", packed)
        self.register_buffer("scale_zeros", scale_zeros)  # [K·planes / G, N, 2], bf16
        self.register_buffer("perm", qw.perm)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None
        self.lowp = bias is None  # forward_lowp is the whole product (torch_kernels.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and self.bias is None:
            return self.forward_lowp(x).to(x.dtype)
        shape = x.shape
        out = self.forward_lowp(x.reshape(-1, shape[-1])).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def forward_lowp(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T`` for 2-D ``x`` of any float dtype, returned in the kernel's bf16 (no bias): what
        ``forward`` casts back to ``x.dtype``. The layer kernels add it to a float32 residual directly
        (type promotion: the same fp32 sum as casting first, one op fewer)."""
        packed, scale_zeros, perm = self._args or self._cache_args()
        h = x
        if perm is not None:
            h = h.index_select(1, perm)
        if h.dtype != torch.bfloat16:
            h = h.to(torch.bfloat16)
        if self.planes == 2:
            h = torch.cat([h, h], dim=1)
        elif not h.is_contiguous():
            h = h.contiguous()
        return _aten._weight_int4pack_mm_for_cpu(h, packed, self.group, scale_zeros)

    # The buffers as a plain tuple: nn.Module resolves a buffer through ``__getattr__`` (~1 µs, three per
    # call, 120 calls per SmolLM2 token). Dropped whenever the module's tensors are replaced (``_apply``:
    # ``.to()``, ``.cpu()``, ...); ``load_state_dict`` copies in place and keeps them.
    _args: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    def _cache_args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        self._args = (self.packed, self.scale_zeros, self.perm)
        return self._args

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._args = None
        return super()._apply(fn, recurse)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zeros))

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, group={self.group}, planes={self.planes}, "
                f"act_order={self.perm is not None}, source={self.source}")
