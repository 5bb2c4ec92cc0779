/* amp_avx2.c — the loss-scaling spans with AVX2 and F16C (Haswell and later, Zen), eight
 * float32 lanes per vector. Compiled for the baseline ISA: only these functions carry the
 * target attribute, and the dispatcher calls them only when the CPU reports AVX2 and F16C.
 * Tails shorter than a vector go to the portable spans, which round identically. */
#include "amp_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,f16c")))

/* Sum eight float32 lanes in float64, in a fixed order, so results are reproducible. */
TARGET static inline double hsum_ps(__m256 v) {
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    __m256d s = _mm256_add_pd(lo, hi);
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(s), _mm256_extractf128_pd(s, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

TARGET static inline __m256i nonfinite32(__m256 y) {
    const __m256i exp = _mm256_set1_epi32(0x7F800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(y), exp), exp);
}

/* Round eight float32 to bfloat16 (nearest even, NaN quieted) and pack them in order. */
TARGET static inline __m128i to_bf16(__m256 y) {
    __m256i bits = _mm256_castps_si256(y);
    /* With a power-of-two inv_scale (GradScaler's usual case) the products of bfloat16 values
     * are exact, so their low halves are zero and rounding would change nothing: skip it. */
    if (_mm256_testz_si256(bits, _mm256_set1_epi32(0xFFFF))) {
        __m256i out = _mm256_srli_epi32(bits, 16);
        return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
    }
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)); /* one compare, no mask */
    __m256i quiet = _mm256_or_si256(bits, _mm256_set1_epi32(0x00400000));
    __m256i out = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, is_nan), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1));
}

TARGET static inline __m256 from_bf16(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

TARGET static inline __m128i nonfinite16(__m128i h, int exp_mask) {
    const __m128i exp = _mm_set1_epi16((short)exp_mask);
    return _mm_cmpeq_epi16(_mm_and_si128(h, exp), exp);
}

/* Check-only pass over 16-bit elements without a sum: sixteen raw elements per compare. */
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

TARGET static inline __attribute__((always_inline)) int span_f32_impl(void *data, int64_t n, float factor,
                                                                   int write, double *sumsq) {
    float *x = (float *)data;
    const __m256 f = _mm256_set1_ps(factor);
    __m256i bad = _mm256_setzero_si256();
    double total = 0.0;
    int64_t nv = n & ~(int64_t)7, i = 0;
    while (i < nv) {
        int64_t end = nv - i < VRAM_AMP_TILE ? nv : i + VRAM_AMP_TILE;
        __m256 acc = _mm256_setzero_ps();
        for (; i < end; i += 8) {
            __m256 y = _mm256_loadu_ps(x + i);
            if (write) {
                y = _mm256_mul_ps(y, f);
                _mm256_storeu_ps(x + i, y);
            }
            bad = _mm256_or_si256(bad, nonfinite32(y));
            if (sumsq) acc = _mm256_add_ps(acc, _mm256_mul_ps(y, y));
        }
        if (sumsq) total += hsum_ps(acc);
    }
    int found = !_mm256_testz_si256(bad, bad);
    found |= vram__amp_portable.span[VRAM_FLOAT32](x + nv, n - nv, factor, write, sumsq ? &total : NULL);
    if (sumsq) *sumsq += total;
    return found;
}

VRAM__AMP_SPECIALISE(TARGET, span_f32)

/* The 16-bit spans share one body: CONVERT_IN widens eight raw elements, CONVERT_OUT rounds
 * back, EXP is the exponent mask of the storage type. Two accumulators alternate so the
 * sum of squares is not limited by the latency of one chain of adds. */
#define DEFINE_SPAN16(NAME, DTYPE, CONVERT_IN, CONVERT_OUT, EXP)                                    \
    TARGET static inline __attribute__((always_inline)) void NAME##_step(                          \
        uint16_t *p, __m256 f, int write, int sum, __m128i *bad, __m256 *acc) {                     \
        __m128i h = _mm_loadu_si128((const __m128i *)p);                                           \
        if (write) {                                                                                 \
            h = CONVERT_OUT(_mm256_mul_ps(CONVERT_IN(h), f));                                        \
            _mm_storeu_si128((__m128i *)p, h);                                                       \
        }                                                                                            \
        *bad = _mm_or_si128(*bad, nonfinite16(h, EXP));                                              \
        if (sum) {                                                                                   \
            __m256 y = CONVERT_IN(h);                                                                \
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(y, y));                                         \
        }                                                                                            \
    }                                                                                                \
    TARGET static inline __attribute__((always_inline)) int NAME##_impl(void *data, int64_t n, float factor,   \
                                                                     int write, double *sumsq) {     \
        uint16_t *x = (uint16_t *)data;                                                              \
        if (!write && !sumsq) return check16(x, n, EXP);                                             \
        const __m256 f = _mm256_set1_ps(factor);                                                     \
        __m128i bad = _mm_setzero_si128();                                                           \
        double total = 0.0;                                                                          \
        int64_t nv = n & ~(int64_t)7, i = 0;                                                         \
        while (i < nv) {                                                                             \
            int64_t end = nv - i < VRAM_AMP_TILE ? nv : i + VRAM_AMP_TILE;                           \
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                           \
            for (; i + 16 <= end; i += 16) {                                                         \
                NAME##_step(x + i, f, write, sumsq != NULL, &bad, &acc0);                            \
                NAME##_step(x + i + 8, f, write, sumsq != NULL, &bad, &acc1);                        \
            }                                                                                        \
            if (i < end) {                                                                           \
                NAME##_step(x + i, f, write, sumsq != NULL, &bad, &acc0);                            \
                i += 8;                                                                              \
            }                                                                                        \
            if (sumsq) total += hsum_ps(_mm256_add_ps(acc0, acc1));                                  \
        }                                                                                            \
        int found = !_mm_testz_si128(bad, bad);                                                      \
        found |= vram__amp_portable.span[DTYPE](x + nv, n - nv, factor, write, sumsq ? &total : NULL); \
        if (sumsq) *sumsq += total;                                                                  \
        return found;                                                                                \
    }                                                                                                \
    VRAM__AMP_SPECIALISE(TARGET, NAME)

#define F16_IN(h) _mm256_cvtph_ps(h)
#define F16_OUT(y) _mm256_cvtps_ph((y), _MM_FROUND_TO_NEAREST_INT)
DEFINE_SPAN16(span_f16, VRAM_FLOAT16, F16_IN, F16_OUT, 0x7C00)
DEFINE_SPAN16(span_bf16, VRAM_BFLOAT16, from_bf16, to_bf16, 0x7F80)

TARGET static inline __attribute__((always_inline)) int span_f64_impl(void *data, int64_t n, float factor,
                                                                   int write, double *sumsq) {
    double *x = (double *)data;
    const __m256d f = _mm256_set1_pd((double)factor);
    const __m256i exp = _mm256_set1_epi64x(0x7FF0000000000000ll);
    __m256i bad = _mm256_setzero_si256();
    __m256d acc = _mm256_setzero_pd();
    int64_t nv = n & ~(int64_t)3;
    for (int64_t i = 0; i < nv; i += 4) {
        __m256d y = _mm256_loadu_pd(x + i);
        if (write) {
            y = _mm256_mul_pd(y, f);
            _mm256_storeu_pd(x + i, y);
        }
        bad = _mm256_or_si256(bad, _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_castpd_si256(y), exp), exp));
        if (sumsq) acc = _mm256_add_pd(acc, _mm256_mul_pd(y, y));
    }
    double total = 0.0;
    if (sumsq) {
        __m128d h = _mm_add_pd(_mm256_castpd256_pd128(acc), _mm256_extractf128_pd(acc, 1));
        total = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    }
    int found = !_mm256_testz_si256(bad, bad);
    found |= vram__amp_portable.span[VRAM_FLOAT64](x + nv, n - nv, factor, write, sumsq ? &total : NULL);
    if (sumsq) *sumsq += total;
    return found;
}

VRAM__AMP_SPECIALISE(TARGET, span_f64)

static int supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

const vram__amp_path_t vram__amp_avx2 = {"avx2", supported, {span_f32, span_f16, span_bf16, span_f64}};

#else /* not x86-64: the path exists but is never supported */

static int unsupported(void) { return 0; }
const vram__amp_path_t vram__amp_avx2 = {"avx2", unsupported, {0, 0, 0, 0}};

#endif
