"""The AVX2 + FMA variant of ``cpu_q4``'s C kernel (``ISA == 2``; the rest of the source is
``cpu_q4.py``'s): for CPUs without AVX-512 BF16 — most x86 laptops, and AVX-512 CPUs before Sapphire
Rapids / Zen 4 (their native build compiles this branch) — where torch's ``int4pack`` kernel
(AVX2 dispatch) had served the packed weights, 8.2 ms for SmolLM2's linears at one row on the 2-core
VM built for x86-64-v3 (docs/performance.md §56).

The same packed layout and the same product, ``y = bf16(x) · Wᵀ`` in float32: the bf16 rows are
widened to float32 (exact) once per call; a unit's 32 bytes (64 codes of 16 rows × 4 k) are read as 8
dwords, dword i holding rows 2i and 2i + 1 (bytes ``2b + j``), so lane i of a vector is row ``2i + p``
for a parity p; a shift, a mask and an int-to-float conversion give the 8 codes of one k and parity
(exact), multiplied with the broadcast activation by FMA — per row and parity one chain over the
group's k, then the group's scale and offset as the AVX-512 block applies them, and the two parities
shuffled back into row order at the end. Every row is computed by the same instructions in the same
order whatever the row count (a verify row is bitwise the decode at its position), with other bits
than the AVX-512 build's. Rows 1–5 take both parities in one pass (1–3 rows on two tiles at once, for
enough independent FMA chains), 6–8 a pass per parity (fewer live registers).

Per row it costs one FMA per 8 weights where the AVX-512 kernel's ``vdpbf16ps`` does 32 multiply-adds:
a 5-row verify costs ~2.4 one-row products here (~1.2 there; SmolLM2, §56). Activations quantized to int8 / int16
(llama.cpp's way) would be cheaper per row, but the product would no longer be ``bf16(x) · Wᵀ``, which
the screened LM head's error bound (``screened_head.py``) and the bitwise tests rely on.
"""

from __future__ import annotations

from tandem.models import c_build

SOURCE = r"""
#elif ISA == 2
typedef float xelem;  /* the rows of x as the block reads them: bf16 values widened to float32 (exact) */
""" + c_build.HSUM256 + r"""/* lanes i of a tile's 16 floats, rows 2i + p (p = 0: even rows, 1: odd rows) */
static inline __m256 parity(const float *v, int p) {
    const __m256 lo = _mm256_loadu_ps(v), hi = _mm256_loadu_ps(v + 8);
    const __m256 s = p ? _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1)) : _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(s), _MM_SHUFFLE(3, 1, 2, 0)));
}
/* NT tiles times M rows of x (float32 copies of the bf16 rows, stride ldx): the AVX-512 block's
   product with 8-lane vectors. A dword of a unit holds rows 2i and 2i + 1 (its bytes 2b + j), so lane i
   of a vector is row 2i + p: each parity p has its own sums, shuffled back into row order at the
   end. The codes are widened by shift, mask and int-to-float (exact), multiplied with the float32
   rows by FMA: per row and parity one chain over the group's k, then scale and offset as the
   AVX-512 block does; with PP = 1 a pass per parity (fewer live registers for many rows). */
static inline __attribute__((always_inline)) void block(
        const uint8_t *restrict w, int64_t tile_bytes, const int NT, const int M, const int BITS, int groups, int G,
        const float *restrict x, int64_t ldx, const float *restrict xs, const float *restrict res,
        float *restrict y, int64_t ldy) {
    const int units = G / 4, ub = BITS == 4 ? 32 : 64;
    const int64_t gbytes = (int64_t)units * ub + 128;
    const __m256i mask = _mm256_set1_epi32(BITS == 4 ? 0xf : 0xff);
    const int PP = M > 5 ? 1 : 2;  /* parities per pass */
    __m256 done[2][MAXM][2];  /* each pass's sums */
    for (int p0 = 0; p0 < 2; p0 += PP) {
        __m256 acc[2][MAXM][2];
        for (int t = 0; t < NT; t++)
            for (int m = 0; m < M; m++) acc[t][m][0] = acc[t][m][1] = _mm256_setzero_ps();
        for (int g = 0; g < groups; g++) {
            __m256 ga[2][MAXM][2];
            for (int t = 0; t < NT; t++)
                for (int m = 0; m < M; m++) ga[t][m][0] = ga[t][m][1] = _mm256_setzero_ps();
            const float *xg = x + (int64_t)g * G;
            for (int u = 0; u < units; u++) {
                __m256i v[2][2];
                for (int t = 0; t < NT; t++) {
                    const uint8_t *q = w + t * tile_bytes + g * gbytes + u * ub;
                    if (p0 == 0 && ((u & 1) == 0 || BITS == 8)) _mm_prefetch((const char *)q + NT * tile_bytes, _MM_HINT_T0);
                    v[t][0] = _mm256_loadu_si256((const __m256i *)q);
                    v[t][1] = BITS == 4 ? v[t][0] : _mm256_loadu_si256((const __m256i *)(q + 32));
                }
                for (int kk = 0; kk < 4; kk++) {
                    const int j = kk & 1, plane = kk >> 1;
                    for (int pp = 0; pp < PP; pp++) {
                        const int p = p0 + pp, sh = 16 * p + 8 * j + (BITS == 4 ? 4 * plane : 0);
                        __m256 wv[2];
                        for (int t = 0; t < NT; t++)
                            wv[t] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v[t][BITS == 4 ? 0 : plane], sh), mask));
                        for (int m = 0; m < M; m++) {
                            const __m256 xb = _mm256_broadcast_ss(xg + m * ldx + 4 * u + kk);
                            for (int t = 0; t < NT; t++) ga[t][m][pp] = _mm256_fmadd_ps(wv[t], xb, ga[t][m][pp]);
                        }
                    }
                }
            }
            for (int t = 0; t < NT; t++) {
                const float *aff = (const float *)(w + t * tile_bytes + g * gbytes + units * ub);
                for (int pp = 0; pp < PP; pp++) {
                    const int p = p0 + pp;
                    const __m256 s = parity(aff, p), o = parity(aff + 16, p);
                    for (int m = 0; m < M; m++) {
                        acc[t][m][pp] = _mm256_fmadd_ps(ga[t][m][pp], s, acc[t][m][pp]);
                        acc[t][m][pp] = _mm256_fmadd_ps(o, _mm256_set1_ps(xs[m * groups + g]), acc[t][m][pp]);
                    }
                }
            }
        }
        for (int t = 0; t < NT; t++)
            for (int m = 0; m < M; m++)
                for (int pp = 0; pp < PP; pp++) done[t][m][p0 + pp] = acc[t][m][pp];
    }
    for (int t = 0; t < NT; t++)
        for (int m = 0; m < M; m++) {
            const __m256 e = done[t][m][0], o = done[t][m][1];
            const __m256 a = _mm256_unpacklo_ps(e, o), b = _mm256_unpackhi_ps(e, o);  /* rows 0-3, 8-11 | 4-7, 12-15 */
            __m256 r0 = _mm256_permute2f128_ps(a, b, 0x20), r1 = _mm256_permute2f128_ps(a, b, 0x31);
            if (res) {
                r0 = _mm256_add_ps(_mm256_loadu_ps(res + m * ldy + t * 16), r0);
                r1 = _mm256_add_ps(_mm256_loadu_ps(res + m * ldy + t * 16 + 8), r1);
            }
            _mm256_storeu_ps(y + m * ldy + t * 16, r0);
            _mm256_storeu_ps(y + m * ldy + t * 16 + 8, r1);
        }
}

/* sum of x[k] over k in [0, G), in a fixed order */
static float group_sum(const float *x, int G) {
    __m256 s = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= G; k += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + k));
    float r = hsum256(s);
    for (; k < G; k++) r += x[k];
    return r;
}

/* float32 → bf16 → float32, round to nearest even (finite values) */
static inline __m256 to_bf16(__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

/* out = bf16(x · r · nw), r = 1 / sqrt(mean(x²) + eps), widened to float32: one row of an RMS norm */
static void norm_row(const float *x, const float *nw, float eps, int K, float *out) {
    __m256 s = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) { const __m256 v = _mm256_loadu_ps(x + k); s = _mm256_fmadd_ps(v, v, s); }
    float ss = hsum256(s);
    for (int i = k; i < K; i++) ss += x[i] * x[i];
    const float rs = 1.0f / sqrtf(ss / (float)K + eps);
    const __m256 r = _mm256_set1_ps(rs);
    for (k = 0; k + 8 <= K; k += 8)
        _mm256_storeu_ps(out + k, to_bf16(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + k), r), _mm256_loadu_ps(nw + k))));
    for (; k < K; k++) {
        float h = x[k] * rs * nw[k];
        uint32_t b; memcpy(&b, &h, 4);
        b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;
        memcpy(out + k, &b, 4);
    }
}

/* bf16 rows → float32 (exact) */
static void widen_rows(const uint16_t *x, int64_t n, float *out) {
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(out + k, _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + k))), 16)));
    for (; k < n; k++) { uint32_t b = (uint32_t)x[k] << 16; memcpy(out + k, &b, 4); }
}
"""
