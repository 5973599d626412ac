"""Attention for short queries on the CPU (decodes and verifies, one request or several), in C.

Why: with the linears on ``cpu_q4``, SmolLM2's batch-1 step on the 2-core CPU spent 1.6 ms (decode)
and 4.4 ms (a 5-row verify) in attention's small ``bmm`` calls, plus the softmax, slicing and thread
switches around them: a verify computes each row separately over exactly the context a decode at its
position sees (``attention.py::_Plan``), so that its bits are the decode's.

:func:`attend` computes query row ``r`` of ``t`` (position ``n − t + r``) over the first
``c = n − t + 1 + r`` context positions, every (row, head) alone by the same instructions: scores
``q·k_j · scale`` (one FMA chain per position and a fixed reduction), ``p_j = exp(s_j − max)`` in
chunks of 16 from position 0 (the last chunk masked), their sum, then ``Σ p_j v_j / Σ p_j``. A row's
result depends only on its own ``c`` and data, so a verify row is bitwise the decode at its position,
in one call for all rows. ``exp`` is a Cephes-style polynomial (relative error ~1e-7). The (row, head)
pairs are split over torch's OpenMP threads. float32 q and caches ([slots, kv_heads, head_dim],
head_dim a multiple of 16), grouped-query heads, causal, no sliding window.

Used by a model whose linears are on ``cpu_q4`` (``models/quant/q4_linear.py``): the eager lone
path (``attention.py``, ``TorchAttention(cpu_kernel=True)``) and the scripted step
(``lone_decode.py``, as the op ``torch.ops.tandem.lone_attention``) call the same kernel. Built by
``models/c_build.py``; needs AVX-512F, or AVX2 + FMA (the same computation with 8-lane vectors: other
bits than the AVX-512 build's, the same guarantees); ``available()`` is False elsewhere (torch's
attention stays).
"""

from __future__ import annotations

import ctypes

import torch

from tandem.models import c_build


_SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#if defined(__AVX512F__)
#define ISA 1
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 2
#else
#define ISA 0
#endif

int attn_isa(void) { return ISA; }

#if ISA == 1
/* 16-lane vectors (AVX-512F) */
#define VL 16
typedef __m512 vec;
typedef __mmask16 vmask;
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VMAX(a, b) _mm512_max_ps(a, b)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VFNMA(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define VFLOOR(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)
#define VSCALE2(y, n) _mm512_scalef_ps(y, n) /* y · 2^n */
static inline vmask tail_mask(int n) { return n >= 16 ? (vmask)0xffff : (vmask)((1u << n) - 1u); }
#define VLOADM(p, m) _mm512_maskz_loadu_ps(m, p)
#define VSTOREM(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define VKEEP(m, v) _mm512_maskz_mov_ps(m, v) /* lanes outside m: 0 */
#elif ISA == 2
/* 8-lane vectors (AVX2 + FMA): the same computation, other bits than the AVX-512 build's */
#define VL 8
typedef __m256 vec;
typedef __m256i vmask;
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VMAX(a, b) _mm256_max_ps(a, b)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VFNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
""" + c_build.HSUM256 + r"""#define VHSUM(v) hsum256(v)
#define VFLOOR(v) _mm256_floor_ps(v)
/* y · 2^n for integral n in [-126, 127]: n's exponent bits */
#define VSCALE2(y, n) _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32( \
    _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)))
static inline vmask tail_mask(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define VLOADM(p, m) _mm256_maskload_ps(p, m)
#define VSTOREM(p, m, v) _mm256_maskstore_ps(p, m, v)
#define VKEEP(m, v) _mm256_and_ps(_mm256_castsi256_ps(m), v)
#endif

#if ISA
/* exp(x) for x <= 0 (Cephes expf: range reduction by ln 2, degree-5 polynomial, then 2^n) */
static inline vec vexp(vec x) {
    x = VMAX(x, VSET1(-87.0f));
    vec n = VFLOOR(VFMA(x, VSET1(1.44269504088896341f), VSET1(0.5f)));
    x = VFNMA(n, VSET1(0.693359375f), x);
    x = VFNMA(n, VSET1(-2.12194440e-4f), x);
    vec y = VSET1(1.9875691500E-4f);
    y = VFMA(y, x, VSET1(1.3981999507E-3f));
    y = VFMA(y, x, VSET1(8.3334519073E-3f));
    y = VFMA(y, x, VSET1(4.1665795894E-2f));
    y = VFMA(y, x, VSET1(1.6666665459E-1f));
    y = VFMA(y, x, VSET1(5.0000001201E-1f));
    y = VFMA(VMUL(y, x), x, VADD(x, VSET1(1.0f)));
    return VSCALE2(y, n);
}

/* one (row, head): q [d] over the first c context positions; out [d]; s: scratch of c floats */
static void attend_one(const float *q, const float *kc, const float *vc, int64_t ld, const int64_t *slots,
                       int64_t start, int c, int d, float scale, float *s, float *out) {
    float mx = -INFINITY;
    for (int j = 0; j < c; j++) {
        const int64_t slot = slots ? slots[j] : start + j;
        const float *kr = kc + slot * ld;
        vec acc = VZERO();
        for (int e = 0; e < d; e += VL) acc = VFMA(VLOAD(q + e), VLOAD(kr + e), acc);
        const float v = VHSUM(acc) * scale;
        s[j] = v;
        mx = v > mx ? v : mx;
    }
    vec sum = VZERO();
    const vec vmx = VSET1(mx);
    for (int j = 0; j < c; j += VL) {
        const vmask mk = tail_mask(c - j);
        const vec p = VKEEP(mk, vexp(VSUB(VLOADM(s + j, mk), vmx)));
        VSTOREM(s + j, mk, p);
        sum = VADD(sum, p);
    }
    const float inv = 1.0f / VHSUM(sum);
    vec o[128 / VL];  /* d <= 128 */
    for (int e = 0; e < d / VL; e++) o[e] = VZERO();
    for (int j = 0; j < c; j++) {
        const int64_t slot = slots ? slots[j] : start + j;
        const float *vr = vc + slot * ld;
        const vec p = VSET1(s[j]);
        for (int e = 0; e < d / VL; e++) o[e] = VFMA(p, VLOAD(vr + VL * e), o[e]);
    }
    const vec vinv = VSET1(inv);
    for (int e = 0; e < d / VL; e++) VSTORE(out + VL * e, VMUL(o[e], vinv));
}
#endif

/* Rope on the q and k heads of qkv [t, (h + 2 kvh) d] as torch computes it (qk·cos + roll(qk, d/2)·sin,
   three roundings: this file is compiled with -ffp-contract=off), q into qr [t, h, d], k and v into
   the caches at row r's slot (wslots[r], or wstart + r). */
int rope_write(const float *qkv, const float *cosv, const float *sinv, float *kc, float *vc, int h, int kvh, int d,
               const int64_t *wslots, int64_t wstart, int t, float *qr) {
    if (d % 2) return 1;
    const int width = (h + 2 * kvh) * d, half = d / 2;
    const int64_t ld = (int64_t)kvh * d;
    for (int r = 0; r < t; r++) {
        const float *row = qkv + (int64_t)r * width, *c = cosv + (int64_t)r * d, *sn = sinv + (int64_t)r * d;
        const int64_t slot = wslots ? wslots[r] : wstart + r;
        for (int hh = 0; hh < h + kvh; hh++) {
            const float *src = row + (int64_t)hh * d;
            float *dst = hh < h ? qr + ((int64_t)r * h + hh) * d : kc + slot * ld + (int64_t)(hh - h) * d;
            for (int e = 0; e < d; e++) {
                const float a = src[e] * c[e];
                const float b = src[e < half ? e + half : e - half] * sn[e];
                dst[e] = a + b;
            }
        }
        const float *v = row + (int64_t)(h + kvh) * d;
        float *vd = vc + slot * ld;
        for (int e = 0; e < kvh * d; e++) vd[e] = v[e];
    }
    return 0;
}

#if ISA
/* The (row, head) pairs of `rows` rows over the threads. Row r: q row rq[r] (rq NULL: r), over the first
   rc[r] (rc NULL: n - rows + 1 + r) positions of its context, slots + ro[r] (ro NULL: slots), or start + j
   without slots. cmax: the most positions a row sees. */
static int attend_rows_omp(const float *q, const float *kc, const float *vc, int h, int kvh, int d,
                           const int64_t *slots, int64_t start, const int64_t *rq, const int64_t *ro, const int *rc,
                           int n, int rows, int cmax, float scale, float *out, int nt) {
    const int g = h / kvh;
    const int64_t ld = (int64_t)kvh * d;
    int fail = 0;
    _Pragma("omp parallel num_threads(nt)")
    {
        float small[4096];
        float *s = cmax <= 4096 ? small : (float *)malloc(sizeof(float) * (size_t)cmax);
        if (!s) {
            _Pragma("omp atomic write")
            fail = 1;
        }
        _Pragma("omp for schedule(static)")
        for (int i = 0; i < rows * h; i++) {
            if (!s) continue;
            const int r = i / h, hh = i % h;
            const int64_t at = ((rq ? rq[r] : r) * h + hh) * d;
            attend_one(q + at, kc + (int64_t)(hh / g) * d, vc + (int64_t)(hh / g) * d, ld,
                       slots && ro ? slots + ro[r] : slots, start, rc ? rc[r] : n - rows + 1 + r, d, scale, s, out + at);
        }
        if (s && s != small) free(s);
    }
    return fail ? 2 : 0;
}
#endif

/* q, out: [t, h, d]; k/v caches [slots, kvh, d]; the request's context: slots[0 .. n) or start + 0 .. n.
   Row r attends over its first n - t + 1 + r positions. 0 on success. */
int lone_attention(const float *q, const float *kc, const float *vc, int h, int kvh, int d, const int64_t *slots,
                   int64_t start, int n, int t, float scale, float *out, int nt) {
#if ISA
    if (d % 16 || d > 128 || h % kvh || t < 1 || n < t) return 1;
    return attend_rows_omp(q, kc, vc, h, kvh, d, slots, start, NULL, NULL, NULL, n, t, n, scale, out, nt);
#else
    return 1;
#endif
}

/* Rows of several requests in one call: q, out [T, h, d]; row i (q row rq[i]) attends over the first rc[i]
   slots of slots + ro[i] (its request's context), as lone_attention computes a row over that many
   positions: bitwise the same. Only the listed rows of out are written. cmax >= every rc[i]. */
int rows_attention(const float *q, const float *kc, const float *vc, int h, int kvh, int d, const int64_t *slots,
                   const int64_t *rq, const int64_t *ro, const int *rc, int rows, int cmax, float scale, float *out,
                   int nt) {
#if ISA
    if (d % 16 || d > 128 || h % kvh || rows < 0) return 1;
    for (int i = 0; i < rows; i++) if (rc[i] < 1 || rc[i] > cmax) return 1;
    return attend_rows_omp(q, kc, vc, h, kvh, d, slots, 0, rq, ro, rc, 0, rows, cmax, scale, out, nt);
#else
    return 1;
#endif
}

/* rope_write then lone_attention in one call (the scripted step's block): out [t, h, d] */
int rope_lone_attention(const float *qkv, const float *cosv, const float *sinv, float *kc, float *vc, int h, int kvh,
                        int d, const int64_t *wslots, int64_t wstart, const int64_t *slots, int64_t start, int n,
                        int t, float scale, float *out, int nt) {
    float small[8 * 32 * 64];
    float *q = (int64_t)t * h * d <= 8 * 32 * 64 ? small : (float *)malloc(sizeof(float) * (size_t)t * h * d);
    if (!q) return 2;
    int rc = rope_write(qkv, cosv, sinv, kc, vc, h, kvh, d, wslots, wstart, t, q);
    if (!rc) rc = lone_attention(q, kc, vc, h, kvh, d, slots, start, n, t, scale, out, nt);
    if (q != small) free(q);
    return rc;
}
"""

def available() -> bool:
    """Whether the kernel is built, loaded and checked (False for good where it cannot be)."""
    return KERNEL.available()


def fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """float32 CPU q [t, h, d] and cache [slots, kvh, d] with d a multiple of 16 up to 128."""
    d = q.shape[-1]
    return (q.dtype is torch.float32 and k_cache.dtype is torch.float32 and q.device.type == "cpu"
            and d % 16 == 0 and d <= 128 and q.shape[1] % k_cache.shape[1] == 0)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
           slots: torch.Tensor | None, n: int, scale: float, kernel: c_build.Kernel | None = None) -> torch.Tensor:
    """out [t, h, d] for q [t, h, d]: row r over context positions ``0 .. n − t + r`` (slots
    ``start + j``, or ``slots[j]`` int64 when given); see the module docstring. ``kernel``: ``KERNEL``
    or another ``build``."""
    t, h, d = q.shape
    if not fits(q, k_cache) or v_cache.shape != k_cache.shape or n < t or (slots is not None and len(slots) < n):
        raise ValueError("lone attention: float32 q [t, h, d] (d % 16 == 0, ≤ 128) and caches, n ≥ t")
    q = q.contiguous()
    out = torch.empty_like(q)
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
    lib = (KERNEL if kernel is None else kernel).lib
    assert lib is not None
    if lib.lone_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), h, k_cache.shape[1], d,
                           slots.data_ptr() if slots is not None else None, start, n, t, scale, out.data_ptr(),
                           torch.get_num_threads()):
        raise RuntimeError("lone attention: the kernel refused its arguments")
    return out


class RowPlan:
    """The C inputs of :func:`attend_rows` for one step's short-query requests, built once per step
    and shared by its layers: each query row's index, its request's context slots and how many of them
    it sees — a decode's at its position: ``n − t + 1 + r`` for row r of a request with t rows at the
    end of its n context positions."""

    def __init__(self, requests: list[tuple[int, torch.Tensor, int]]) -> None:  # (first q row, context, t)
        rq, ro, rc, at = [], [], [], 0
        for q0, ctx, t in requests:
            n = len(ctx)
            for r in range(t):
                rq.append(q0 + r)
                ro.append(at)
                rc.append(n - t + 1 + r)
            at += n
        self.slots = (torch.cat([c for _, c, _ in requests]).to(torch.int64).contiguous() if requests
                      else torch.zeros(0, dtype=torch.int64))
        self.rq = torch.tensor(rq, dtype=torch.int64)
        self.ro = torch.tensor(ro, dtype=torch.int64)
        self.rc = torch.tensor(rc, dtype=torch.int32)
        self.rows = len(rq)
        self.cmax = max(rc, default=1)


def attend_rows(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: RowPlan, scale: float,
                out: torch.Tensor, kernel: c_build.Kernel | None = None) -> None:
    """The rows of ``plan`` (several requests' decodes and verifies) into ``out`` [T, h, d] (contiguous),
    each bitwise what :func:`attend` computes for that row as its request's lone step: a row's bits
    do not depend on the other requests of the step or their padding."""
    if not fits(q, k_cache) or v_cache.shape != k_cache.shape or out.shape != q.shape or not out.is_contiguous():
        raise ValueError("rows attention: float32 q, out [T, h, d] (d % 16 == 0, ≤ 128) and caches")
    q = q.contiguous()
    lib = (KERNEL if kernel is None else kernel).lib
    assert lib is not None
    h, d = q.shape[1], q.shape[2]
    if lib.rows_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), h, k_cache.shape[1], d,
                          plan.slots.data_ptr(), plan.rq.data_ptr(), plan.ro.data_ptr(), plan.rc.data_ptr(),
                          plan.rows, plan.cmax, scale, out.data_ptr(), torch.get_num_threads()):
        raise RuntimeError("rows attention: the kernel refused its arguments")


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
              slots: torch.Tensor | None, n: int, scale: float) -> torch.Tensor:
    """What :func:`attend` computes, in float64 torch ops (the tests' and the self-check's reference)."""
    t, h, d = q.shape
    idx = slots[:n] if slots is not None else torch.arange(start, start + n)
    k, v = k_cache[idx].double(), v_cache[idx].double()  # [n, kvh, d]
    g = h // k.shape[1]
    out = torch.empty(t, h, d, dtype=torch.float64)
    for r in range(t):
        c = n - t + 1 + r
        for hh in range(h):
            p = torch.softmax(k[:c, hh // g] @ q[r, hh].double() * scale, 0)
            out[r, hh] = p @ v[:c, hh // g]
    return out


def _self_check(kernel: c_build.Kernel) -> None:
    gen = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(50, 2, 32, generator=gen), torch.randn(50, 2, 32, generator=gen)
    q = torch.randn(3, 6, 32, generator=gen)
    slots = torch.randperm(50, generator=gen)
    for s in (None, slots):
        got = attend(q, kc, vc, 7, s, 37, 0.2, kernel)
        if not torch.allclose(got.double(), reference(q, kc, vc, 7, s, 37, 0.2), rtol=1e-4, atol=1e-5):
            raise RuntimeError("self-check failed")
    out = torch.zeros_like(q)
    attend_rows(q, kc, vc, RowPlan([(0, slots[:37], 3)]), 0.2, out, kernel)
    if not torch.equal(out, attend(q, kc, vc, 0, slots, 37, 0.2, kernel)):
        raise RuntimeError("self-check failed (rows)")


def rope_attend(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, heads: int, write_start: int, write_slots: torch.Tensor | None, start: int,
                slots: torch.Tensor | None, n: int, scale: float, kernel: c_build.Kernel | None = None) -> torch.Tensor:
    """The scripted step's attention block in one C call: rope on qkv's q and k heads (bitwise
    torch's ``qk·cos + roll(qk, d/2)·sin_signed``, ``cos`` / ``sin_signed`` [t, d] for the rows'
    positions), k and v written to the caches at the rows' slots (``write_slots``, or ``write_start``
    + r: what ``write_kv`` writes), then what :func:`attend` computes. Returns [t, heads, d]."""
    t = qkv.shape[0]
    kvh, d = k_cache.shape[1], k_cache.shape[2]
    if (qkv.dtype is not torch.float32 or qkv.shape[1] != (heads + 2 * kvh) * d or not k_cache.is_contiguous()
            or not v_cache.is_contiguous() or k_cache.dtype is not torch.float32 or v_cache.shape != k_cache.shape
            or d % 16 or d > 128 or heads % kvh or n < t or (slots is not None and len(slots) < n)):
        raise ValueError("rope attention: float32 qkv [t, (h + 2·kvh)·d] (d % 16 == 0, ≤ 128), contiguous "
                         "float32 caches, n ≥ t")
    qkv, cos, sin_signed = qkv.contiguous(), cos.reshape(t, d).contiguous(), sin_signed.reshape(t, d).contiguous()
    if write_slots is not None:
        write_slots = write_slots.to(torch.int64).contiguous()
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
    out = torch.empty(t, heads, d)
    lib = (KERNEL if kernel is None else kernel).lib
    assert lib is not None
    if lib.rope_lone_attention(qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), k_cache.data_ptr(),
                               v_cache.data_ptr(), heads, kvh, d,
                               write_slots.data_ptr() if write_slots is not None else None, write_start,
                               slots.data_ptr() if slots is not None else None, start, n, t, scale, out.data_ptr(),
                               torch.get_num_threads()):
        raise RuntimeError("rope attention: the kernel refused its arguments")
    return out


def _rope_attention(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, heads: int, write_start: int, write_slots: torch.Tensor | None, start: int,
                    slots: torch.Tensor | None, n: int, scale: float) -> torch.Tensor:
    if not available():
        raise RuntimeError("CPU attention kernel unavailable on this machine")
    return rope_attend(qkv, cos, sin_signed, k_cache, v_cache, heads, write_start, write_slots, start, slots, n, scale)


def _lone_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                    slots: torch.Tensor | None, n: int, scale: float) -> torch.Tensor:
    if not available():
        raise RuntimeError("CPU attention kernel unavailable on this machine")
    return attend(q, k_cache, v_cache, start, slots, n, scale)


_P, _I = ctypes.c_void_p, ctypes.c_int


def build(target: str | None = None) -> c_build.Kernel:
    """The kernel for ``target`` (``c_build.target_flags``: None = ``$TANDEM_CPU_ISA``, else this CPU;
    ``"avx2"``: the AVX2 + FMA variant, also on a CPU that has AVX-512), built and self-checked on its
    first ``available()``. ``KERNEL`` is the one the models use."""
    kernel = c_build.Kernel(
        "attn", _SOURCE, "attn_isa", "AVX-512 or AVX2 + FMA",
        {"lone_attention": [_P, _P, _P, _I, _I, _I, _P, ctypes.c_int64, _I, _I, ctypes.c_float, _P, _I],
         "rows_attention": [_P, _P, _P, _I, _I, _I, _P, _P, _P, _P, _I, _I, ctypes.c_float, _P, _I],
         "rope_write": [_P, _P, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int64, _I, _P],
         "rope_lone_attention": [_P, _P, _P, _P, _P, _I, _I, _I, _P, ctypes.c_int64, _P, ctypes.c_int64, _I, _I,
                                 ctypes.c_float, _P, _I]},
        lambda: _self_check(kernel), "torch's attention is used", (*c_build.FLAGS, "-ffp-contract=off"), target)
    return kernel


KERNEL = build()

_ops = torch.library.Library("tandem", "FRAGMENT")
_ops.define("lone_attention(Tensor q, Tensor k_cache, Tensor v_cache, int start, Tensor? slots, int n, "
            "float scale) -> Tensor")
_ops.impl("lone_attention", _lone_attention, "CPU")
_ops.define("rope_attention(Tensor qkv, Tensor cos, Tensor sin_signed, Tensor(a!) k_cache, Tensor(b!) v_cache, "
            "int heads, int write_start, Tensor? write_slots, int start, Tensor? slots, int n, float scale) -> Tensor")
_ops.impl("rope_attention", _rope_attention, "CPU")
