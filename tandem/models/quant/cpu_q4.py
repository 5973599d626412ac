"""A 4-bit (and 8-bit) CPU matmul from packed codes for the decode / verify case: ``y = bf16(x) · Wᵀ``.

Why: torch's ``_weight_int4pack_mm_for_cpu`` (the ``int4pack`` kernel) costs 5.9 / 7.0 / 9.3 /
15.2 ms over SmolLM2's 120 packed linears for 1 / 2 / 4 / 5 rows on the 2-core CPU (docs/
performance.md §40), so a verify of k = 4 drafts costs ~2.3 decodes where the weights read are the
same. Here each weight is unpacked once and multiplied with every row:

- the weight ``W[n, k] = scale[n, g] · q[n, k] + offset[n, g]`` (``g = k // G``, 4-bit codes ``q``,
  the :class:`QuantizedWeight` map, scale and offset kept in float32: exact for every format);
- lanes are 16 output rows (a *tile*); a *unit* of 32 bytes holds the tile's 64 codes of 4
  consecutive ``k``: byte ``2b + j`` has ``q[b, 4u + j]`` in its low nibble and ``q[b, 4u + 2 + j]`` in
  its high one. One ``vpmovzxbw`` + two ``vpermw`` table lookups make 2 × 32 bf16 weights (the codes
  0..15 are exact in bf16) in the pair order of ``vdpbf16ps``, which multiplies them with a broadcast
  pair of bf16 activations: 32 multiply-adds per instruction per row;
- per group, a tile's float32 sums ``Σ q·x`` (two accumulators per row) are scaled, and the offset
  term is ``offset[n, g] · Σ_{k∈g} x[k]`` (the group sums of the bf16 activations, computed once per
  call); every row is computed by the same instructions in the same order whatever M is, so a row's
  result does not depend on the other rows (a verify row is bitwise the decode at its position);
- each unit's line of the next block of tiles (the same offset one block ahead) is prefetched into
  L1: one thread's 1-row pass over SmolLM2's linears 6.6 → 5.2 ms, two threads' 3.55 → 3.05 ms
  (a fixed 2–64 KB distance was no better than none);
- threads (OpenMP, torch's pool) take contiguous ranges of tiles; rows beyond 8 run in chunks of 8,
  every chunk on two tiles before the next two (a prefill reads each tile from memory once).

Memory layout (``pack``): uint8 ``[N / 16, K / G, 8·G + 128]``: a tile's group is ``G / 4`` units,
then 16 float32 scales, then 16 float32 offsets. Codes of 5–8 bits (Q5_x, Q8_0, the screened LM
head's 8-bit copy) use a byte layout instead: 64 bytes per unit (the pair ``(4u, 4u + 1)`` as bytes
``2b + j``, then the pair ``(4u + 2, 4u + 3)``), turned into bf16 by ``vpmovzxbd`` / ``vcvtdq2ps`` /
``vcvtne2ps2bf16``; the rest is the same. This needs AVX-512 BW + BF16 (Zen 4, Sapphire Rapids and
later); a CPU with AVX2 + FMA only (most laptops) runs the variant of ``cpu_q4_avx2.py`` (the same
layout and product with 8-lane FMAs, ``ISA == 2``); elsewhere ``available()`` is False and
``int4pack`` stays. The C source is built by ``models/c_build.py`` (``$TANDEM_CPU_ISA=avx2``: the AVX2
variant on an AVX-512 CPU, to measure an AVX2 machine's path).

Two fusions, both per row: an RMS norm of float32 input rows before the product (``norm_weight``:
``bf16(x · rsqrt(mean(x²) + eps) · w)``, the layer's input norm) and a float32 residual added to the
result (the same IEEE sum as torch's ``residual + y``). The kernel is also the op
``torch.ops.tandem.q4_mm(x, packed, group, norm_weight=None, eps=0.0, residual=None)`` (float32
out), so the scripted CPU decode (``worker/lone_decode.py``) calls the same code as the eager module.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from tandem.models import c_build
from tandem.models.quant import cpu_q4_avx2
from tandem.models.quant.weights import QuantizedWeight


TILE = 16  # output rows per tile (one vector's lanes)
ROW_CHUNK = 8  # rows computed together (each tile read once per chunk)

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define ISA 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 2
#else
#define ISA 0
#endif

int q4_isa(void) { return ISA; }

#define MAXM 8
#if ISA == 1
typedef uint16_t xelem;  /* the rows of x as the block reads them: bf16 */
/* bf16 bit patterns of 0..15, twice: vpermw reads the low 5 bits of each index word */
static const uint16_t BF16_CODES[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

static inline int32_t pair(const uint16_t *p) { int32_t v; memcpy(&v, p, 4); return v; }

/* NT tiles (consecutive, tile_bytes apart) times M rows of x (bf16, row stride ldx); xs: the rows'
   group sums [M][groups]; y: float32, row stride ldy, already offset to the tiles' first column.
   BITS 4: a unit of 4 k is 32 bytes of nibbles; BITS 8: 64 bytes, the pair (4u, 4u + 1) then (4u + 2, 4u + 3). */
static inline __attribute__((always_inline)) void block(
        const uint8_t *restrict w, int64_t tile_bytes, const int NT, const int M, const int BITS, int groups, int G,
        const xelem *restrict x, int64_t ldx, const float *restrict xs, const float *restrict res,
        float *restrict y, int64_t ldy) {
    const __m512i table = _mm512_loadu_si512((const void *)BF16_CODES);
    const int units = G / 4, ub = BITS == 4 ? 32 : 64;
    const int64_t gbytes = (int64_t)units * ub + 128;
    __m512 acc[2][MAXM];
    for (int t = 0; t < NT; t++)
        for (int m = 0; m < M; m++) acc[t][m] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512 ga[2][MAXM], gb[2][MAXM];
        for (int t = 0; t < NT; t++)
            for (int m = 0; m < M; m++) { ga[t][m] = _mm512_setzero_ps(); gb[t][m] = _mm512_setzero_ps(); }
        const xelem *xg = x + (int64_t)g * G;
        for (int u = 0; u < units; u++) {
            __m512i lo[2], hi[2];
            for (int t = 0; t < NT; t++) {
                const uint8_t *p = w + t * tile_bytes + g * gbytes + u * ub;
                if (BITS == 4) {
                    if ((u & 1) == 0) _mm_prefetch((const char *)p + NT * tile_bytes, _MM_HINT_T0);
                    __m512i wv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
                    lo[t] = _mm512_permutexvar_epi16(wv, table);
                    hi[t] = _mm512_permutexvar_epi16(_mm512_srli_epi16(wv, 4), table);
                } else {
                    _mm_prefetch((const char *)p + NT * tile_bytes, _MM_HINT_T0);
                    __m512 c[4];
                    for (int q = 0; q < 4; q++)
                        c[q] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * q))));
                    lo[t] = (__m512i)_mm512_cvtne2ps_pbh(c[1], c[0]);
                    hi[t] = (__m512i)_mm512_cvtne2ps_pbh(c[3], c[2]);
                }
            }
            for (int m = 0; m < M; m++) {
                const __m512i x0 = _mm512_set1_epi32(pair(xg + m * ldx + 4 * u));
                const __m512i x1 = _mm512_set1_epi32(pair(xg + m * ldx + 4 * u + 2));
                for (int t = 0; t < NT; t++) {
                    ga[t][m] = _mm512_dpbf16_ps(ga[t][m], (__m512bh)lo[t], (__m512bh)x0);
                    gb[t][m] = _mm512_dpbf16_ps(gb[t][m], (__m512bh)hi[t], (__m512bh)x1);
                }
            }
        }
        for (int t = 0; t < NT; t++) {
            const float *aff = (const float *)(w + t * tile_bytes + g * gbytes + units * ub);
            const __m512 s = _mm512_loadu_ps(aff), o = _mm512_loadu_ps(aff + 16);
            for (int m = 0; m < M; m++) {
                acc[t][m] = _mm512_fmadd_ps(_mm512_add_ps(ga[t][m], gb[t][m]), s, acc[t][m]);
                acc[t][m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[m * groups + g]), acc[t][m]);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int m = 0; m < M; m++) {
            __m512 v = acc[t][m];
            if (res) v = _mm512_add_ps(_mm512_loadu_ps(res + m * ldy + t * 16), v);  /* residual + product */
            _mm512_storeu_ps(y + m * ldy + t * 16, v);
        }
}

/* sum of x[k] (bf16 as float32) over k in [0, G), in a fixed order */
static float group_sum(const uint16_t *x, int G) {
    __m512 s = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= G; k += 16)
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + k))), 16)));
    float r = _mm512_reduce_add_ps(s);
    for (; k < G; k++) { uint32_t b = (uint32_t)x[k] << 16; float f; memcpy(&f, &b, 4); r += f; }
    return r;
}

/* out = bf16(x · r · nw), r = 1 / sqrt(mean(x²) + eps): one row of an RMS norm, in a fixed order */
static void norm_row(const float *x, const float *nw, float eps, int K, uint16_t *out) {
    __m512 s = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16) {
        const __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        const __m512 v = _mm512_maskz_loadu_ps(mk, x + k);
        s = _mm512_fmadd_ps(v, v, s);
    }
    const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(s) / (float)K + eps));
    for (int k = 0; k < K; k += 16) {
        const __mmask16 mk = K - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (K - k)) - 1u);
        const __m512 h = _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(mk, x + k), r), _mm512_maskz_loadu_ps(mk, nw + k));
        _mm256_mask_storeu_epi16(out + k, mk, (__m256i)_mm512_cvtneps_pbh(h));
    }
}
"""
_SOURCE += cpu_q4_avx2.SOURCE + r"""
#endif

#if ISA
#define ROWS(B, M, NT)                                                                                \
static void rows_##B##_##M(const uint8_t *w, int64_t tile_bytes, int t0, int t1, int groups, int G,    \
                           const xelem *x, int64_t ldx, const float *xs, const float *res, float *y,       \
                           int64_t ldy) {                                                             \
    int t = t0;                                                                                       \
    for (; t + NT <= t1; t += NT)                                                                     \
        block(w + t * tile_bytes, tile_bytes, NT, M, B, groups, G, x, ldx, xs, res ? res + t * 16 : 0,  \
              y + t * 16, ldy);                                                                       \
    for (; t < t1; t++)                                                                               \
        block(w + t * tile_bytes, tile_bytes, 1, M, B, groups, G, x, ldx, xs, res ? res + t * 16 : 0,   \
              y + t * 16, ldy);                                                                       \
}
ROWS(4, 1, 2) ROWS(4, 2, 2) ROWS(4, 3, 2) ROWS(4, 4, 1) ROWS(4, 5, 1) ROWS(4, 6, 1) ROWS(4, 7, 1) ROWS(4, 8, 1)
ROWS(8, 1, 2) ROWS(8, 2, 2) ROWS(8, 3, 2) ROWS(8, 4, 1) ROWS(8, 5, 1) ROWS(8, 6, 1) ROWS(8, 7, 1) ROWS(8, 8, 1)

typedef void (*rows_fn)(const uint8_t *, int64_t, int, int, int, int, const xelem *, int64_t, const float *,
                        const float *, float *, int64_t);
static const rows_fn ROWS_FN[2][MAXM + 1] = {
    {0, rows_4_1, rows_4_2, rows_4_3, rows_4_4, rows_4_5, rows_4_6, rows_4_7, rows_4_8},
    {0, rows_8_1, rows_8_2, rows_8_3, rows_8_4, rows_8_5, rows_8_6, rows_8_7, rows_8_8}};
#endif


/* y[m * N + n] = res[m * N + n] + sum_k bf16 x[m * K + k] * W[n, k] for the packed W (N / 16 tiles,
   K / G groups, bits 4 or 8); res may be NULL (no residual). With nw given, x is not read: the rows
   are norm_row(xf[m], nw, eps) instead (float32 xf). 0 on success. */
int q4_mm(const uint16_t *x, const float *xf, const float *nw, float eps, int M, int K, const uint8_t *w, int N,
          int G, int bits, const float *res, float *y, int nt) {
#if ISA
    if (M < 1 || N % 16 || G % 4 || K % G || (bits != 4 && bits != 8)) return 1;
    const int groups = K / G, tiles = N / 16, b8 = bits == 8;
    float small[1024];  /* the rows' group sums */
    xelem small_x[8 * 1024];  /* the rows as the block reads them, where x is not that already */
    float *xs = M * groups <= 1024 ? small : (float *)malloc(sizeof(float) * (size_t)M * groups);
    /* ISA 1 reads bf16 x in place (a fused norm writes its rows here); ISA 2 reads float32 copies */
    const int own = nw != 0 || ISA == 2;
    xelem *xn = 0;
    if (own) xn = (int64_t)M * K <= 8 * 1024 ? small_x : (xelem *)malloc(sizeof(xelem) * (size_t)M * K);
    if (!xs || (own && !xn)) { if (xs && xs != small) free(xs); return 2; }
    const xelem *xr = own ? (const xelem *)xn : (const xelem *)(const void *)x;
    const int64_t tile_bytes = (int64_t)groups * (G / 4 * (b8 ? 64 : 32) + 128);
    _Pragma("omp parallel num_threads(nt)")
    {
        if (nw) {
            _Pragma("omp for schedule(static)")
            for (int m = 0; m < M; m++) norm_row(xf + (int64_t)m * K, nw, eps, K, xn + (int64_t)m * K);
        }
#if ISA == 2
        else {
            _Pragma("omp for schedule(static)")
            for (int m = 0; m < M; m++) widen_rows(x + (int64_t)m * K, K, xn + (int64_t)m * K);
        }
#endif
        _Pragma("omp for schedule(static)")
        for (int i = 0; i < M * groups; i++) xs[i] = group_sum(xr + (int64_t)(i / groups) * K + (int64_t)(i % groups) * G, G);
        const int nthr = omp_get_num_threads(), tid = omp_get_thread_num();
        const int t0 = (int)((int64_t)tiles * tid / nthr), t1 = (int)((int64_t)tiles * (tid + 1) / nthr);
        /* more than 8 rows (a prefill): every chunk of 8 rows on a pair of tiles while they are in L1 */
        const int tstep = M > MAXM ? 2 : t1 - t0;
        for (int ta = t0; ta < t1; ta += tstep) {
            const int tb = ta + tstep < t1 ? ta + tstep : t1;
            for (int m0 = 0; m0 < M; m0 += MAXM) {
                const int mc = M - m0 < MAXM ? M - m0 : MAXM;
                ROWS_FN[b8][mc](w, tile_bytes, ta, tb, groups, G, xr + (int64_t)m0 * K, K, xs + (int64_t)m0 * groups,
                                res ? res + (int64_t)m0 * N : 0, y + (int64_t)m0 * N, N);
            }
        }
    }
    if (xs != small) free(xs);
    if (xn && xn != small_x) free(xn);
    return 0;
#else
    return 1;
#endif
}
"""

def available() -> bool:
    """Whether the kernel is built, loaded and checked (built on the first call; False for good
    where it cannot be: no compiler, neither AVX-512 BF16 nor AVX2 + FMA, a failed self-check)."""
    return KERNEL.available()


def fits(qw: QuantizedWeight) -> bool:
    """Whether :func:`pack` holds ``qw`` exactly: N % 16 == 0 and groups of a multiple of 4 (codes of
    up to 4 bits in the nibble layout, 5–8 bits in the byte layout)."""
    n, k = qw.shape
    return n % TILE == 0 and qw.group % 4 == 0 and k % qw.group == 0


def code_bits(qw: QuantizedWeight) -> int:
    """The layout's code width for ``qw``: 4 (nibbles) or 8 (bytes)."""
    return 4 if qw.bits <= 4 else 8


def group_bytes(group: int, bits: int) -> int:
    """Bytes of one tile's group in the layout of ``bits``-wide codes (4 or 8): ``G / 4`` units of
    32 (nibbles) or 64 bytes, then 16 float32 scales and 16 float32 offsets."""
    return 2 * bits * group + 128


def pack(qw: QuantizedWeight, blocks: Callable[[int, int], QuantizedWeight] | None = None) -> torch.Tensor:
    """The kernel's layout of ``qw`` (see the module docstring): uint8 ``[N / 16, K / G, group_bytes]``.
    The act-order permutation (``qw.perm``) is not applied: the caller gathers x's columns.
    ``blocks(r0, r1)``: rows ``r0:r1`` of ``qw`` made on demand (``qw`` then gives only the shape, group
    and bits), so a large matrix is packed without all of its codes in memory at once."""
    if not fits(qw):
        raise ValueError(f"{qw.source} {qw.shape} ({qw.bits}-bit, group {qw.group}) does not fit cpu_q4")
    n, k = qw.shape
    g = qw.group
    tiles, groups, units = n // TILE, k // g, g // 4
    ub = 8 * code_bits(qw)  # bytes per unit of 4 k
    out = torch.empty((tiles, groups, group_bytes(g, code_bits(qw))), dtype=torch.uint8)
    step = 64  # tiles at a time: the temporaries of a 49152-row matrix would be large
    for t0 in range(0, tiles, step):
        t1 = min(tiles, t0 + step)
        if blocks is not None:
            part, rows = blocks(t0 * TILE, t1 * TILE), slice(None)
        else:
            part, rows = qw, slice(t0 * TILE, t1 * TILE)
        c = part.codes[rows].view(t1 - t0, TILE, groups, units, 2, 2)  # [t, b, g, u, plane, j]: k = 4u + 2·plane + j
        if ub == 32:  # byte 2b + j: plane 0 in the low nibble, plane 1 in the high one
            c = (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # [t, g, u, b, j]
        else:  # plane 0's 32 bytes (2b + j), then plane 1's
            c = c.permute(0, 2, 3, 4, 1, 5)  # [t, g, u, plane, b, j]
        out[t0:t1, :, :units * ub] = c.reshape(t1 - t0, groups, units * ub)
        for i, a in enumerate((part.scale, part.offset)):
            aff = a[rows].float().reshape(t1 - t0, TILE, groups).transpose(1, 2).contiguous()
            out[t0:t1, :, units * ub + 64 * i:units * ub + 64 * (i + 1)] = aff.view(torch.uint8).view(
                t1 - t0, groups, 64)
    return out


def mm(x: torch.Tensor, packed: torch.Tensor, group: int, norm_weight: torch.Tensor | None = None,
       eps: float = 0.0, residual: torch.Tensor | None = None, kernel: c_build.Kernel | None = None) -> torch.Tensor:
    """``residual + bf16(x) @ Wᵀ`` in float32 [M, N] for x [M, K] (bf16, or float cast to bf16) and
    ``pack(qw)``; ``residual`` (float32 [M, N]) optional, added as torch's ``residual + y`` would be.
    With ``norm_weight`` (float32 [K]), x (float32) goes through an RMS norm first, in the kernel:
    ``bf16(x · rsqrt(mean(x²) + eps) · norm_weight)`` (``norm_row``). ``kernel``: ``KERNEL`` (whose
    ``available()`` must be True) or another ``build``."""
    tiles, groups, width = packed.shape
    m, k = x.shape
    bits = 4 if width == group_bytes(group, 4) else 8
    n = tiles * TILE
    if k != groups * group or width != group_bytes(group, bits) or packed.dtype != torch.uint8:
        raise ValueError(f"cpu_q4: x [{m}, {k}] does not match a packed [{tiles}·16, {groups}·{group}] weight")
    if residual is not None and (residual.shape != (m, n) or residual.dtype != torch.float32):
        raise ValueError(f"cpu_q4: residual must be float32 [{m}, {n}]")
    xb = xf = nw = res = 0
    if norm_weight is not None:
        if x.dtype != torch.float32 or norm_weight.shape != (k,) or norm_weight.dtype != torch.float32:
            raise ValueError("cpu_q4: a fused norm takes float32 x and a float32 [K] weight")
        x = x.contiguous()
        xf, nw = x.data_ptr(), norm_weight.contiguous().data_ptr()
    else:
        if x.dtype != torch.bfloat16:
            x = x.to(torch.bfloat16)
        x = x.contiguous()
        xb = x.data_ptr()
    y = torch.empty((m, n), dtype=torch.float32)
    if m == 0:
        return y
    if residual is not None:
        residual = residual.contiguous()
        res = residual.data_ptr()
    lib = (KERNEL if kernel is None else kernel).lib
    assert lib is not None
    if lib.q4_mm(xb, xf, nw, eps, m, k, packed.data_ptr(), n, group, bits, res, y.data_ptr(), torch.get_num_threads()):
        raise RuntimeError("cpu_q4: the kernel refused its arguments")
    return y


def _self_check(kernel: c_build.Kernel) -> None:
    """Row counts 1..9 (a chunk of 8 and a tail), two tiles, groups of 32 and 8, 4- and 8-bit codes,
    against float64."""
    gen = torch.Generator().manual_seed(0)
    for n, k, group, bits in ((48, 96, 32, 4), (32, 40, 8, 4), (48, 96, 32, 8), (32, 40, 8, 8)):
        codes = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
        scale = torch.rand(n, k // group, generator=gen) * 0.1
        offset = torch.randn(n, k // group, generator=gen) * 0.1
        qw = QuantizedWeight(codes=codes, scale=scale, offset=offset, group=group, bits=bits, source="self-check")
        w = qw.dequantize().double()
        packed = pack(qw)
        for m in range(1, ROW_CHUNK + 2):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            ref = (x.double() @ w.T).float()
            if not torch.allclose(mm(x, packed, group, kernel=kernel), ref, rtol=1e-4, atol=1e-4):
                raise RuntimeError(f"self-check failed at {m} rows ({n}x{k}, group {group}, {bits}-bit)")


def _q4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, norm_weight: torch.Tensor | None = None,
           eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    if not available():
        raise RuntimeError("cpu_q4 kernel unavailable on this machine")
    return mm(x, packed, group, norm_weight, eps, residual)


_P, _I = ctypes.c_void_p, ctypes.c_int


def build(target: str | None = None) -> c_build.Kernel:
    """The kernel for ``target`` (``c_build.target_flags``: None = ``$TANDEM_CPU_ISA``, else this CPU;
    ``"avx2"``: the AVX2 + FMA variant, also on a CPU that has AVX-512), built and self-checked on its
    first ``available()``. ``KERNEL`` is the one the models use."""
    kernel = c_build.Kernel("q4", _SOURCE, "q4_isa", "AVX-512 BF16 or AVX2 + FMA",
                            {"q4_mm": [_P, _P, _P, ctypes.c_float, _I, _I, _P, _I, _I, _I, _P, _P, _I]},
                            lambda: _self_check(kernel), "int4pack is used", target=target)
    return kernel


KERNEL = build()


def variant(kernel: c_build.Kernel | None = None) -> str | None:
    """Which variant ``kernel`` (default ``KERNEL``) runs: ``"avx512"``, ``"avx2"``, or None (not built)."""
    k = KERNEL if kernel is None else kernel
    if not k.available():
        return None
    assert k.lib is not None
    return {1: "avx512", 2: "avx2"}.get(k.lib.q4_isa())

_ops = torch.library.Library("tandem", "FRAGMENT")
_ops.define("q4_mm(Tensor x, Tensor packed, int group, Tensor? norm_weight=None, float eps=0.0, "
            "Tensor? residual=None) -> Tensor")
_ops.impl("q4_mm", _q4_mm, "CPU")
