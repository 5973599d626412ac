"""Greedy LM-head argmax from an 8-bit packed copy of the head, confirmed exactly (CPU).

A batch-1 decode step of the built-in SmolLM2 spends most of its time in the float32 LM head: a
49152 × 576 matrix, 113 MB read per token (docs/performance.md §21). Quantized to 8 bits in groups of
32 (the GGUF ships it as Q8_0, the tied ``token_embd``, which this reproduces exactly) it is 28 MB in
the int4pack kernel's two-plane form. For a row that only needs its argmax (greedy, nothing applied to
the logits, no logprobs: ``Executor`` decides), the :class:`ScreenedHead` *screens* with the packed
copy and *confirms* exactly:

1. ``ỹ = int4pack(x)``: approximate logits (bf16 activations and output, bf16 scales; ~2.8 ms
   instead of ~14 ms on the 2-core CPU of §21);
2. a rigorous bound ``|ỹ_i − y_i| ≤ ε_i`` on the difference from the exact logit ``y_i = w_i · x``
   of the float32 weight (below);
3. every token that could be the maximum, ``ỹ_i + ε_i ≥ max_j (ỹ_j − ε_j) − δ``, is recomputed exactly
   (float64 products and sum, rounded to float32: the correctly rounded logit) — typically 1–3 of
   49152 tokens; all the others are set to ``-inf``.

The returned row's argmax is the argmax of the exact logits: a non-candidate's exact logit is below
the bound of the best lower bound by more than ``δ`` (a few float32 ulps), so it can neither exceed
nor tie a candidate's. The values of non-candidates are not logits: callers ask only for argmax rows.

**The bound** (per vocabulary row ``i``, per hidden row ``x``; ``x̃ = bf16(x)``, ``w̃`` the weight
the kernel forms, ``ŵ = (code − 8)·s + z`` in exact arithmetic from the bf16 ``s``, ``z`` it reads):

    |ỹ − y| ≤ |ỹ − acc|                     output rounded fp32 → bf16        ≤ 2^-7·|ỹ_i|
            + |acc − w̃·x̃|                   fp32 accumulation of K·P terms    ≤ γ_{KP}·A_i·‖x̃‖
            + |w̃·(x̃ − x)|                   activations rounded to bf16       ≤ B_i·‖x − x̃‖
            + |(w̃ − w)·x|                   bf16 scales, dequantize rounding  ≤ E_i·‖x‖

with ``E_i``, ``A_i`` per-group bounds (``_bound``: every element's weight error, the kernel's
dequantize rounding — one FMA on AVX-512, two on AVX2 — and the 8-bit rounding measured against the
float32 weight), ``B_i = ‖w_i‖ + E_i`` (Cauchy–Schwarz throughout; ``P`` planes, ``u = 2^-24``). It
assumes what ``aten._weight_int4pack_mm_for_cpu`` does on x86 (float32 dequantization and FMA
accumulation, bf16 output): :meth:`ScreenedHead.build` checks it on random rows against float64 and
declines (the float head stays in use) if any product breaks it; ``tests/quant/test_screened_head.py``
checks it on adversarial rows.
"""

from __future__ import annotations

import logging

import torch

from tandem.loader.memory import return_free_memory
from tandem.models.quant import cpu_q4
from tandem.models.quant.int4pack import Int4PackLinear, plane_affine
from tandem.models.quant.q4_linear import Q4Linear
from tandem.models.quant.weights import QuantizedWeight, quantize_float

logger = logging.getLogger("tandem")

GROUP = 32  # 8-bit codes per scale: Q8_0's block, so a GGUF's Q8_0 head is reproduced exactly
U32 = 2.0 ** -24  # float32 unit roundoff
OUT_ROUND = 2.0 ** -7  # |ỹ − acc| / |ỹ|: bf16 rounding (2^-9) with room for a truncating conversion
SLACK = 1.0 + 2.0 ** -16  # covers the float32 arithmetic of the bound itself
TINY = 2.0 ** -90  # absolute: what flushing subnormal inputs and results to zero can lose (cpu_q4)
TRIM_BLOCKS = 16  # packed row blocks between two returns of freed heap memory
CHECK_ROWS = 4  # random hidden rows the build checks the bound on ...
CHECK_VOCAB = 1024  # ... over this many vocabulary rows (a float64 product of the whole head is 226 MB)


class ScreenedHead:
    """The argmax of ``x @ weight^T`` per row, screened through a packed copy of the head."""

    def __init__(self, packed: Int4PackLinear | Q4Linear, weight: torch.Tensor, bound: torch.Tensor) -> None:
        self.packed = packed
        self.weight = weight  # float32 [V, H]: the exact head (the model's own parameter, not a copy)
        self.bound = bound  # float32 [3, V]: E, B, γ·A (see the module docstring)
        # int4pack rounds its output to bf16; cpu_q4 returns float32 (no output rounding, but
        # subnormals flushed: TINY)
        self.out_round, self.tiny = (OUT_ROUND, 0.0) if isinstance(packed, Int4PackLinear) else (0.0, TINY)

    @staticmethod
    def build(weight: torch.Tensor) -> ScreenedHead | None:
        """A screened head for ``weight`` (float32 [V, H] on the CPU), or None when the packed kernel
        cannot take its shape or fails the bound on random rows. Quantizes and packs it in row blocks
        (never a second full copy of the head in memory)."""
        n, k = weight.shape
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or n % 16 or k % GROUP:
            return None
        bound = torch.empty(3, n, dtype=torch.float64)
        own = cpu_q4.available()  # tandem's kernel (exact float32 scales, float32 out), else int4pack

        def block(r0: int, r1: int) -> QuantizedWeight:
            qw = quantize_float(weight[r0:r1], 8, GROUP, True, "lm_head")
            exact = qw.codes.view(r1 - r0, -1, GROUP).double() * qw.scale.double()[..., None] + \
                qw.offset.double()[..., None]  # code·s + o, as the bound's planes are derived
            residual = (weight[r0:r1].double().view(r1 - r0, -1, GROUP) - exact).abs().amax(-1)
            bound[:, r0:r1] = (_bound_rows_q8 if own else _bound_rows)(qw, weight[r0:r1], residual)
            if r0 // (r1 - r0) % TRIM_BLOCKS == TRIM_BLOCKS - 1:
                return_free_memory()  # the blocks' temporaries would otherwise raise the peak RSS
            return qw

        meta = QuantizedWeight(torch.zeros((), dtype=torch.uint8).expand(n, k),
                               torch.zeros(()).expand(n, k // GROUP), torch.zeros(()).expand(n, k // GROUP),
                               GROUP, 8, "lm_head")  # shapes only: the blocks are made as they are packed
        packed: Int4PackLinear | Q4Linear
        if own:
            packed = Q4Linear(meta, None, blocks=block)
            # roundings any product meets: a group's two dot-product chains (≤ 2 per vdpbf16ps), their
            # sum, the scale and offset FMAs into the row's sum over groups, the group sum of x
            terms = k + GROUP + 2 * (k // GROUP) + 8
        else:
            packed = Int4PackLinear(meta, None, blocks=block)
            terms = k * packed.planes
        bound[2] *= terms * U32 / (1 - terms * U32)  # γ_terms
        head = ScreenedHead(packed, weight, (bound * SLACK).float())
        if not head.check(torch.Generator().manual_seed(0)):
            logger.warning("LM head screening disabled: the %s kernel broke its error bound here", packed.kernel)
            return None
        return head

    def approximate(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ỹ, ε) [N, V] float32 for hidden [N, H] float32: |ỹ − x·w| ≤ ε elementwise."""
        approx = self.packed.forward_lowp(hidden).float()
        x = hidden.double()
        xt = hidden.to(torch.bfloat16).double()
        norms = torch.stack([x.norm(dim=1), (x - xt).norm(dim=1), xt.norm(dim=1)], dim=1)  # [N, 3]
        eps = (norms.float() * SLACK) @ self.bound  # E·‖x‖ + B·‖x − x̃‖ + γA·‖x̃‖
        if self.out_round:
            eps.add_(approx.abs(), alpha=self.out_round)
        eps.add_(self.tiny).mul_(SLACK)
        return approx, eps

    def argmax_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, V] float32 whose row argmax is the argmax of the exact logits: candidates hold their
        correctly rounded logit, every other token ``-inf``."""
        if not bool(torch.isfinite(hidden).all()):
            return hidden @ self.weight.t()  # nothing to bound: the plain float head
        approx, eps = self.approximate(hidden)
        best_low = (approx - eps).amax(dim=1, keepdim=True)
        margin = best_low.abs().mul(2.0 ** -18).add_(2.0 ** -60)  # δ: room for float32 rounding, see above
        rows, cols = torch.nonzero(approx + eps >= best_low - margin, as_tuple=True)
        exact = (self.weight.index_select(0, cols).double() * hidden.double().index_select(0, rows)).sum(1)
        out = torch.full(approx.shape, float("-inf"), dtype=torch.float32)
        out[rows, cols] = exact.float()
        return out

    def check(self, gen: torch.Generator) -> bool:
        """The bound holds for random rows (hidden-state-sized norms) against float64 products."""
        h = self.weight.shape[1]
        x = torch.randn(CHECK_ROWS, h, generator=gen) * (torch.rand(CHECK_ROWS, 1, generator=gen) * 4 + 0.5)
        approx, eps = self.approximate(x)
        rows = slice(0, CHECK_VOCAB)
        exact = x.double() @ self.weight[rows].double().t()
        return bool(((approx[:, rows].double() - exact).abs() <= eps[:, rows].double()).all())


def _bound_rows(qw: QuantizedWeight, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """(E, B, A) [3, rows] float64 for a block of vocabulary rows, before γ and rounding up. Per-group
    quantities only (no pass over the codes): every code of a plane is within 8 of the kernel's centre
    8, so one bound ``δ_g`` covers every element of a group g and ``‖e_i‖ ≤ sqrt(G · Σ_g δ_g²)``. Per
    plane p of a group (``S``, ``Z``: the bf16 scale and zero the kernel reads; ``s_p``, ``z_p``: their
    float32 values before rounding, ``plane_affine``):

        δ_g = Σ_p [8·|S − s_p| + |Z − z_p|            bf16 scales and zeros
                   + 2u·(16·|S| + 2·|Z|)]             the kernel's dequantize rounding
              + u·(|(136 − 16c)·s| + |z_lo|)·2         float32 rounding of the planes' zero
              + max_j |w_j − (code_j·s + o)|          the 8-bit rounding (``residual``, float64)"""
    n, k = qw.shape
    g = qw.group
    d = torch.float64
    s = qw.scale.to(d)
    scale, zero, shift = plane_affine(qw)
    planes = 1 if shift is None else 2
    big_s, big_z = scale.to(torch.bfloat16).to(d), zero.to(torch.bfloat16).to(d)  # what the kernel reads
    scale, zero = scale.to(d), zero.to(d)
    shift = shift.to(d) if shift is not None else None
    ngroups = k // g
    rounding = 2 * U32 * (16 * big_s.abs() + 2 * big_z.abs())
    delta = (8 * (big_s - scale).abs() + (big_z - zero).abs() + rounding).view(n, planes, ngroups).sum(1)
    zlo = zero.view(n, planes, ngroups)[:, -1]
    mult = (136 - 16 * shift).abs() * s.abs() if shift is not None else 8 * s.abs()
    delta += 2 * U32 * (mult + zlo.abs())
    delta += residual
    out = torch.empty(3, n, dtype=d)
    out[0] = (g * delta.square().sum(1)).sqrt()
    out[1] = weight.norm(dim=1).to(d) * (1 + 2.0 ** -10) + out[0]  # float32 norm: relative error ≤ K·u
    mag = 8 * big_s.abs() + big_z.abs() + rounding
    out[2] = (g * mag.square().view(n, planes, ngroups).sum(2)).sqrt().sum(1)
    return out


def _bound_rows_q8(qw: QuantizedWeight, weight: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """(E, B, A) [3, rows] float64 for ``cpu_q4``'s byte layout, before γ and rounding up. It multiplies
    with the float32 ``s``, ``o`` of ``qw`` themselves (``code·s + o`` is the quantized weight, exact),
    so a group's element error is only the 8-bit rounding (``residual``); a product's terms are
    ``s·code·x̃`` and ``o·x̃`` with ``|s·code| + |o| ≤ 255·|s| + |o|`` per group."""
    g = qw.group
    d = torch.float64
    out = torch.empty(3, qw.shape[0], dtype=d)
    out[0] = (g * residual.square().sum(1)).sqrt()
    out[1] = weight.norm(dim=1).to(d) * (1 + 2.0 ** -10) + out[0]
    mag = ((1 << qw.bits) - 1) * qw.scale.to(d).abs() + qw.offset.to(d).abs()
    out[2] = (g * mag.square().sum(1)).sqrt()
    return out
