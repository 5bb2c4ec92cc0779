/* amp_simd_spans.h — the loss-scaling spans written once for both SIMD widths. Included only
 * by amp_avx2.c and amp_avx512.c, after <immintrin.h> and after each has defined, for its
 * width, what really differs between AVX2 and AVX-512F:
 *
 *   TARGET               the target attribute of every function here
 *   SIMD_BITS            256 or 512: float32 vectors are __m<SIMD_BITS>, their intrinsics
 *                        _mm<SIMD_BITS>_*
 *   HALF_PREFIX, HALF_BITS  the vectors that hold as many 16-bit elements (_mm and 128, or
 *                        _mm256 and 256): __m<HALF_BITS>i, HALF_PREFIX_*_si<HALF_BITS>
 *   SPAN16_ACCUMULATORS  1 or 2 chains of float32 adds for the 16-bit sums of squares
 *   flags_t, no_flags, flag_nonfinite32, flag_nonfinite64, any_flag
 *                        the lanes that saw inf/NaN so far (a vector of compare results, or
 *                        a mask register)
 *   lower_half_ps, upper_half_ps, fold_to_pd256
 *                        the pieces of a fixed-order float64 horizontal sum
 *   low_halves_zero, narrow_epi32, select_nan
 *                        the steps of bfloat16 rounding that have no common intrinsic
 *
 * Everything else (loads, stores, products, conversions, the tiling, the tails) is spelled
 * once below through SIMD()/HALF(), so both paths walk, round and sum identically. Each span
 * is an always-inline body instantiated by VRAM__AMP_SPECIALISE with "write" and "sum" fixed:
 * the inner loops carry no branches. Tails shorter than a vector go to the portable spans,
 * which round identically. */
#ifndef VRAM_KERNELS_AMP_SIMD_SPANS_H
#define VRAM_KERNELS_AMP_SIMD_SPANS_H

#define VRAM__PASTE3_(a, b, c) a##b##c
#define VRAM__PASTE3(a, b, c) VRAM__PASTE3_(a, b, c)

/* SIMD(_mul_ps) is _mm256_mul_ps or _mm512_mul_ps; SIMD_SI(_and) is _mm256_and_si256 or
 * _mm512_and_si512. HALF(_cmpeq_epi16) and HALF_SI(_loadu) likewise for the half vectors. */
#define SIMD(op) VRAM__PASTE3(_mm, SIMD_BITS, op)
#define SIMD_SI(op) VRAM__PASTE3(SIMD(op), _si, SIMD_BITS)
#define HALF(op) VRAM__PASTE3(HALF_PREFIX, op, )
#define HALF_SI(op) VRAM__PASTE3(HALF_PREFIX, op, VRAM__PASTE3(_si, HALF_BITS, ))

typedef VRAM__PASTE3(__m, SIMD_BITS, ) vec_ps;  /* LANES float32 */
typedef VRAM__PASTE3(__m, SIMD_BITS, d) vec_pd; /* LANES / 2 float64 */
typedef VRAM__PASTE3(__m, SIMD_BITS, i) vec_si; /* LANES 32-bit integers */
typedef VRAM__PASTE3(__m, HALF_BITS, i) half_si; /* LANES raw 16-bit elements */

#define LANES (SIMD_BITS / 32)
#define SPAN_INLINE TARGET static inline __attribute__((always_inline))

/* Sum the lanes in float64 in a fixed order, so results are reproducible. */
TARGET static inline double hsum_pd(vec_pd v) {
    __m256d q = fold_to_pd256(v);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

TARGET static inline double hsum_ps(vec_ps v) {
    return hsum_pd(SIMD(_add_pd)(SIMD(_cvtps_pd)(lower_half_ps(v)), SIMD(_cvtps_pd)(upper_half_ps(v))));
}

TARGET static inline half_si nonfinite16(half_si h, int exp_mask) {
    const half_si exp = HALF(_set1_epi16)((short)exp_mask);
    return HALF(_cmpeq_epi16)(HALF_SI(_and)(h, exp), exp);
}

TARGET static inline vec_ps from_bf16(half_si h) {
    return VRAM__PASTE3(SIMD(_castsi), SIMD_BITS, _ps)(SIMD(_slli_epi32)(SIMD(_cvtepu16_epi32)(h), 16));
}

/* Round LANES float32 to bfloat16 (nearest even, NaN quieted) and pack them in order. */
TARGET static inline half_si to_bf16(vec_ps y) {
    vec_si bits = SIMD_SI(_castps)(y);
    /* With a power-of-two inv_scale (GradScaler's usual case) the products of bfloat16 values
     * are exact, so their low halves are zero and rounding would change nothing: skip it. */
    if (low_halves_zero(bits)) return narrow_epi32(SIMD(_srli_epi32)(bits, 16));
    vec_si lsb = SIMD_SI(_and)(SIMD(_srli_epi32)(bits, 16), SIMD(_set1_epi32)(1));
    vec_si rounded = SIMD(_add_epi32)(bits, SIMD(_add_epi32)(lsb, SIMD(_set1_epi32)(0x7FFF)));
    vec_si quiet = SIMD_SI(_or)(bits, SIMD(_set1_epi32)(0x00400000));
    return narrow_epi32(SIMD(_srli_epi32)(select_nan(y, quiet, rounded), 16)); /* values fit in 16 bits */
}

/* float16 and bfloat16 to and from float32; dtype is a constant wherever these inline. */
SPAN_INLINE vec_ps widen16(vram_dtype_t dtype, half_si h) {
    return dtype == VRAM_FLOAT16 ? SIMD(_cvtph_ps)(h) : from_bf16(h);
}
SPAN_INLINE half_si narrow16(vram_dtype_t dtype, vec_ps y) {
    return dtype == VRAM_FLOAT16 ? SIMD(_cvtps_ph)(y, _MM_FROUND_TO_NEAREST_INT) : to_bf16(y);
}
static inline int exponent_mask16(vram_dtype_t dtype) { return dtype == VRAM_FLOAT16 ? 0x7C00 : 0x7F80; }

/* Check-only pass over 16-bit elements without a sum: sixteen raw elements per compare, with
 * AVX2's 16-bit compares (AVX-512F has none wider). */
TARGET static int check16(const uint16_t *x, int64_t n, int exp_mask) {
    const __m256i exp = _mm256_set1_epi16((short)exp_mask);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(x + i));
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(h, exp), exp));
    }
    int found = !_mm256_testz_si256(bad, bad);
    for (; i < n; i++) found |= (x[i] & exp_mask) == exp_mask;
    return found;
}

/* One vector of LANES elements of a float32 or 16-bit dtype at p: multiplied by f in place
 * when `write`, its inf/NaN lanes flagged (bad32 for float32, bad16 for the raw 16-bit
 * values), the squares of the results added to *acc when `sum`. */
SPAN_INLINE void step(vram_dtype_t dtype, void *p, vec_ps f, int write, int sum, flags_t *bad32, half_si *bad16,
                      vec_ps *acc) {
    vec_ps y = SIMD(_setzero_ps)();
    if (dtype == VRAM_FLOAT32) {
        y = SIMD(_loadu_ps)((const float *)p);
        if (write) {
            y = SIMD(_mul_ps)(y, f);
            SIMD(_storeu_ps)((float *)p, y);
        }
        *bad32 = flag_nonfinite32(*bad32, y);
    } else {
        half_si h = HALF_SI(_loadu)((const half_si *)p);
        if (write) {
            h = narrow16(dtype, SIMD(_mul_ps)(widen16(dtype, h), f));
            HALF_SI(_storeu)((half_si *)p, h);
        }
        *bad16 = HALF_SI(_or)(*bad16, nonfinite16(h, exponent_mask16(dtype)));
        if (sum) y = widen16(dtype, h); /* the stored result, rounded */
    }
    if (sum) *acc = SIMD(_add_ps)(*acc, SIMD(_mul_ps)(y, y));
}

/* The elements after the last whole vector go to the portable span; then the sum is handed
 * back. */
TARGET static inline int finish(int found, vram_dtype_t dtype, void *tail, int64_t n_tail, float factor, int write,
                                double *sumsq, double total) {
    found |= vram__amp_portable.span[dtype](tail, n_tail, factor, write, sumsq ? &total : NULL);
    if (sumsq) *sumsq += total;
    return found;
}

/* float32, float16, bfloat16: sums of squares in float32 per tile of VRAM_AMP_TILE, float64
 * across. The 16-bit spans may alternate accumulators so the sum is not limited by the
 * latency of one chain of adds. */
SPAN_INLINE int span_tiled(vram_dtype_t dtype, void *data, int64_t n, float factor, int write, double *sumsq) {
    const size_t esize = dtype == VRAM_FLOAT32 ? 4 : 2;
    const int pairs = dtype != VRAM_FLOAT32 && SPAN16_ACCUMULATORS == 2;
    char *x = (char *)data;
    if (dtype != VRAM_FLOAT32 && !write && !sumsq) return check16((const uint16_t *)data, n, exponent_mask16(dtype));
    const vec_ps f = SIMD(_set1_ps)(factor);
    flags_t bad32 = no_flags();
    half_si bad16 = HALF_SI(_setzero)();
    double total = 0.0;
    int64_t nv = n & ~(int64_t)(LANES - 1), i = 0;
    while (i < nv) {
        int64_t end = nv - i < VRAM_AMP_TILE ? nv : i + VRAM_AMP_TILE;
        vec_ps acc0 = SIMD(_setzero_ps)(), acc1 = SIMD(_setzero_ps)();
        if (pairs) {
            for (; i + 2 * LANES <= end; i += 2 * LANES) {
                step(dtype, x + i * esize, f, write, sumsq != NULL, &bad32, &bad16, &acc0);
                step(dtype, x + (i + LANES) * esize, f, write, sumsq != NULL, &bad32, &bad16, &acc1);
            }
            /* Tiles are whole vectors: at most one is left. (A loop here, one more branch
             * beside the hot loop's, measured up to 25% slower on an AMD EPYC.) */
            if (i < end) {
                step(dtype, x + i * esize, f, write, sumsq != NULL, &bad32, &bad16, &acc0);
                i += LANES;
            }
        } else {
            for (; i < end; i += LANES) step(dtype, x + i * esize, f, write, sumsq != NULL, &bad32, &bad16, &acc0);
        }
        if (sumsq) total += hsum_ps(pairs ? SIMD(_add_ps)(acc0, acc1) : acc0);
    }
    int found = dtype == VRAM_FLOAT32 ? any_flag(bad32) : !HALF_SI(_testz)(bad16, bad16);
    return finish(found, dtype, x + nv * esize, n - nv, factor, write, sumsq, total);
}

/* float64 is computed in float64, as PyTorch does (its opmath type for double is double). */
SPAN_INLINE int span_f64(void *data, int64_t n, float factor, int write, double *sumsq) {
    double *x = (double *)data;
    const vec_pd f = SIMD(_set1_pd)((double)factor);
    flags_t bad = no_flags();
    vec_pd acc = SIMD(_setzero_pd)();
    int64_t nv = n & ~(int64_t)(LANES / 2 - 1);
    for (int64_t i = 0; i < nv; i += LANES / 2) {
        vec_pd y = SIMD(_loadu_pd)(x + i);
        if (write) {
            y = SIMD(_mul_pd)(y, f);
            SIMD(_storeu_pd)(x + i, y);
        }
        bad = flag_nonfinite64(bad, y);
        if (sumsq) acc = SIMD(_add_pd)(acc, SIMD(_mul_pd)(y, y));
    }
    return finish(any_flag(bad), VRAM_FLOAT64, x + nv, n - nv, factor, write, sumsq, sumsq ? hsum_pd(acc) : 0.0);
}

SPAN_INLINE int span_body(vram_dtype_t dtype, void *data, int64_t n, float factor, int write, double *sumsq) {
    if (dtype == VRAM_FLOAT64) return span_f64(data, n, factor, write, sumsq);
    return span_tiled(dtype, data, n, factor, write, sumsq);
}

VRAM__AMP_SPECIALISE(TARGET, span_f32_entry, span_body, VRAM_FLOAT32)
VRAM__AMP_SPECIALISE(TARGET, span_f16_entry, span_body, VRAM_FLOAT16)
VRAM__AMP_SPECIALISE(TARGET, span_bf16_entry, span_body, VRAM_BFLOAT16)
VRAM__AMP_SPECIALISE(TARGET, span_f64_entry, span_body, VRAM_FLOAT64)

/* The path's span table, indexed by vram_dtype_t. */
#define SIMD_SPANS {span_f32_entry, span_f16_entry, span_bf16_entry, span_f64_entry}

#endif
