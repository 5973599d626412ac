"""A float32 CPU matmul for 2–8 rows at the weight-read speed: ``y[M, N] = x[M, K] · W[N, K]ᵀ``.

Why: on the 2-core CI-class CPU a decode's single row streams SmolLM2's 540 MB of float32 weights at
~40 GB/s (``layers.linear``'s split GEMV), but the BLAS and oneDNN paths for the 4 rows of a k = 3
verify run at 25–35 GB/s, so a verify's linears cost 1.45–2× a decode's where the weights read are
the same (docs/performance.md §41, §45). A verify is memory-bound: each weight read once, multiplied
with every row. That is this kernel:

- each thread takes a contiguous range of weight rows (OpenMP, ``torch.get_num_threads()``
  threads; it links against the ``libgomp`` torch has loaded, so one thread pool);
- per block of NB weight rows and all M x rows, M·NB vector accumulators stay in registers (M and
  NB compile-time constants: one function per M); each weight vector loaded once feeds M FMAs;
- a software prefetch sweeps 16 KB ahead of the block into L2 (without it one thread read at
  ~13 GB/s: DRAM latency, not bandwidth, bounded it);
- AVX-512 (16 lanes) or AVX2 + FMA (8 lanes), whichever the compiler targets with ``-march=native``.

Each output is one accumulator's lanes summed in a fixed order: a row's result does not depend on
the other rows or on M (1-row and 4-row products are bitwise equal). It differs from torch's
BLAS result by summation order only (relative ~1e-6). A bfloat16 weight is widened exactly to
float32 as it is loaded (``skinny_mm_b16``): bitwise the products of its float32 copy at half the
bytes read (an EAGLE head saved in bf16: ``models/skinny_linear.py``).

The C source below is compiled on first use and loaded by ``models/c_build.py`` (cached in
``<cache>/.kernels/``). A self-check against torch runs at load.
Where there is no compiler, no OpenMP, no AVX2/AVX-512, or the check fails, ``available()`` is
False (logged once) and callers keep their torch paths: nothing else changes.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.models import c_build


MAX_ROWS = 8  # rows this kernel takes (one function per row count)

_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define ISA 512
#define VL 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define REGS 24
typedef __mmask16 tailmask;
static inline tailmask make_mask(int n) { return (tailmask)((1u << n) - 1u); }
#define VLOAD_TAIL(p, m) _mm512_maskz_loadu_ps(m, p)
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 256
#define VL 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
""" + c_build.HSUM256 + r"""#define VHSUM(v) hsum256(v)
#define REGS 12
typedef __m256i tailmask;
static inline tailmask make_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define VLOAD_TAIL(p, m) _mm256_maskload_ps(p, m)
#else
#define ISA 0
#endif

#define PREFETCH_BYTES 16384

int skinny_isa(void) { return ISA; }

#if ISA
/* Weight loads: float32, or bfloat16 widened exactly to float32 (the bits shifted up), so a bf16
   weight gives bitwise the products of its float32 copy at half the bytes read. */
static inline vec wload_f32(const float *p) { return VLOAD(p); }
static inline vec wtail_f32(const float *p, int n) { return VLOAD_TAIL(p, make_mask(n)); }
#if ISA == 512
static inline vec wload_b16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
#else
static inline vec wload_b16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif
static inline vec wtail_b16(const uint16_t *p, int n) {
    uint16_t b[VL] = {0};
    for (int i = 0; i < n; i++) b[i] = p[i];
    return wload_b16(b);
}

/* One block: NB weight rows (w[n0 .. n0 + NB)) times the M rows of x; S: the weight type (f32, b16). */
#define BLOCK(M, NB, S, WT)                                                                   \
static void block_##M##_##NB##_##S(const float *x, int K, const WT *w, int n0, float *y, int ldy) { \
    vec acc[M][NB];                                                                           \
    const WT *wr[NB];                                                                         \
    for (int j = 0; j < NB; j++) wr[j] = w + (int64_t)(n0 + j) * K;                          \
    for (int m = 0; m < M; m++) for (int j = 0; j < NB; j++) acc[m][j] = VZERO();           \
    const char *pf = (const char *)wr[0] + PREFETCH_BYTES;                                    \
    int k = 0;                                                                                \
    for (; k + VL <= K; k += VL) {                                                            \
        for (int j = 0; j < NB; j++) _mm_prefetch(pf + (int64_t)NB * k * sizeof(WT) + 64 * j, _MM_HINT_T1); \
        vec wv[NB];                                                                           \
        for (int j = 0; j < NB; j++) wv[j] = wload_##S(wr[j] + k);                           \
        for (int m = 0; m < M; m++) {                                                         \
            vec xv = VLOAD(x + (int64_t)m * K + k);                                          \
            for (int j = 0; j < NB; j++) acc[m][j] = VFMA(wv[j], xv, acc[m][j]);             \
        }                                                                                     \
    }                                                                                         \
    if (k < K) {                                                                              \
        tailmask t = make_mask(K - k);                                                        \
        vec wv[NB];                                                                           \
        for (int j = 0; j < NB; j++) wv[j] = wtail_##S(wr[j] + k, K - k);                    \
        for (int m = 0; m < M; m++) {                                                         \
            vec xv = VLOAD_TAIL(x + (int64_t)m * K + k, t);                                  \
            for (int j = 0; j < NB; j++) acc[m][j] = VFMA(wv[j], xv, acc[m][j]);             \
        }                                                                                     \
    }                                                                                         \
    for (int m = 0; m < M; m++) for (int j = 0; j < NB; j++) y[(int64_t)m * ldy + n0 + j] = VHSUM(acc[m][j]); \
}

/* All rows of x times blocks of NBV weight rows (threads split the blocks); the last N % NBV rows alone.
   NBV: as many weight rows per block as the registers hold (M * NBV accumulators, at most 4 rows). */
#define ROWS_(M, NBV, S, WT)                                                                  \
BLOCK(M, NBV, S, WT)                                                                          \
static void rows_##M##_##S(const float *x, int K, const WT *w, int N, float *y, int ldy, int nt) { \
    int blocks = N / NBV;                                                                     \
    _Pragma("omp parallel for schedule(static) num_threads(nt)")                              \
    for (int b = 0; b < blocks; b++) block_##M##_##NBV##_##S(x, K, w, b * NBV, y, ldy);       \
    for (int n = blocks * NBV; n < N; n++) tail_##M##_##S(x, K, w, n, y, ldy);                \
}
#define ROWS(M, NBV) ROWS_(M, NBV, f32, float) ROWS_(M, NBV, b16, uint16_t)

#define TAIL_(M, S, WT)                                                                       \
static void tail_##M##_##S(const float *x, int K, const WT *w, int n, float *y, int ldy) {    \
    for (int m = 0; m < M; m++) {                                                             \
        const float *xr = x + (int64_t)m * K;                                                 \
        const WT *wr = w + (int64_t)n * K;                                                    \
        vec acc = VZERO();                                                                    \
        int k = 0;                                                                            \
        for (; k + VL <= K; k += VL) acc = VFMA(wload_##S(wr + k), VLOAD(xr + k), acc);      \
        if (k < K) acc = VFMA(wtail_##S(wr + k, K - k), VLOAD_TAIL(xr + k, make_mask(K - k)), acc); \
        y[(int64_t)m * ldy + n] = VHSUM(acc);                                                 \
    }                                                                                         \
}
#define TAIL(M) TAIL_(M, f32, float) TAIL_(M, b16, uint16_t)

TAIL(1) TAIL(2) TAIL(3) TAIL(4) TAIL(5) TAIL(6) TAIL(7) TAIL(8)
#if ISA == 512
ROWS(1, 4) ROWS(2, 4) ROWS(3, 4) ROWS(4, 4) ROWS(5, 4) ROWS(6, 4) ROWS(7, 3) ROWS(8, 3)
#else
ROWS(1, 4) ROWS(2, 4) ROWS(3, 4) ROWS(4, 3) ROWS(5, 2) ROWS(6, 2) ROWS(7, 1) ROWS(8, 1)
#endif

#define DISPATCH(S)                                                                           \
    switch (M) {                                                                              \
    case 1: rows_1_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    case 2: rows_2_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    case 3: rows_3_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    case 4: rows_4_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    case 5: rows_5_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    case 6: rows_6_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    case 7: rows_7_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    case 8: rows_8_##S(x, K, w, N, y, ldy, nt); return 0;                                     \
    }
#endif

/* y[m * ldy + n] = sum_k x[m * K + k] * w[n * K + k], 1 <= M <= 8; 0 on success. */
int skinny_mm(const float *x, int M, int K, const float *w, int N, float *y, int ldy, int nt) {
#if ISA
    DISPATCH(f32)
#endif
    return 1;
}

/* The same with a bfloat16 weight (bitwise the float32 weight's result). */
int skinny_mm_b16(const float *x, int M, int K, const uint16_t *w, int N, float *y, int ldy, int nt) {
#if ISA
    DISPATCH(b16)
#endif
    return 1;
}
"""

def available() -> bool:
    """Whether the kernel is built, loaded and checked (built on the first call; False for good
    where it cannot be)."""
    return KERNEL.available()


def mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for float32 CPU x [M, K] (1 <= M <= MAX_ROWS) and a contiguous float32 or
    bfloat16 weight [N, K] (bf16: bitwise the result for ``weight.float()``, half the bytes read);
    ``available()`` must be True."""
    m, k = x.shape
    n = weight.shape[0]
    if not (1 <= m <= MAX_ROWS and weight.shape[1] == k and weight.is_contiguous()
            and x.dtype is torch.float32 and weight.dtype in (torch.float32, torch.bfloat16)):
        raise ValueError(f"skinny mm takes 1..{MAX_ROWS} float32 rows and a contiguous [N, {k}] float32 "
                         "or bfloat16 weight")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out
    lib = KERNEL.lib
    assert lib is not None
    fn = lib.skinny_mm if weight.dtype is torch.float32 else lib.skinny_mm_b16
    if fn(x.data_ptr(), m, k, weight.data_ptr(), n, y.data_ptr(), n, torch.get_num_threads()):
        raise RuntimeError("skinny mm: unsupported row count")
    return y


def _self_check() -> None:
    """Every row count, tails in K and N, against torch (float64 reference)."""
    g = torch.Generator().manual_seed(0)
    for m in range(1, MAX_ROWS + 1):
        x = torch.randn(m, 37, generator=g)
        w = torch.randn(13, 37, generator=g)
        ref = (x.double() @ w.double().T).float()
        if not torch.allclose(mm(x, w), ref, rtol=1e-5, atol=1e-5):
            raise RuntimeError(f"self-check failed at {m} rows")
        wb = w.bfloat16()
        if not torch.equal(mm(x, wb), mm(x, wb.float())):
            raise RuntimeError(f"self-check failed at {m} rows (bfloat16 weight)")


_P, _I = ctypes.c_void_p, ctypes.c_int
KERNEL = c_build.Kernel("skinny", _SOURCE, "skinny_isa", "both AVX-512 and AVX2 + FMA",
                        {"skinny_mm": [_P, _I, _I, _P, _I, _P, _I, _I],
                         "skinny_mm_b16": [_P, _I, _I, _P, _I, _P, _I, _I]}, _self_check, "torch's matmuls are used")
