/* amp_avx512.c — the loss-scaling spans with AVX-512F (Skylake-SP and later, Zen 4), sixteen
 * float32 lanes per vector. Same structure and rounding as amp_avx2.c; only the functions
 * carry the target attribute, and the dispatcher calls them only when the CPU (and the OS,
 * which must save the ZMM state) supports AVX-512F alongside AVX2 and F16C. */
#include "amp_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx2,f16c")))

/* Sum sixteen float32 lanes in float64 in a fixed order. */
TARGET static inline double hsum_ps(__m512 v) {
    __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
    __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m512d s = _mm512_add_pd(lo, hi);
    __m256d q = _mm256_add_pd(_mm512_castpd512_pd256(s), _mm512_extractf64x4_pd(s, 1));
    __m128d h = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
    return _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
}

TARGET static inline __mmask16 nonfinite32(__m512 y) {
    const __m512i exp = _mm512_set1_epi32(0x7F800000);
    return _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(y), exp), exp);
}

/* Round sixteen float32 to bfloat16 (nearest even, NaN quieted) and pack them in order. */
TARGET static inline __m256i to_bf16(__m512 y) {
    __m512i bits = _mm512_castps_si512(y);
    /* Exact products (a power-of-two inv_scale) have zero low halves: no rounding needed. */
    if (_mm512_test_epi32_mask(bits, _mm512_set1_epi32(0xFFFF)) == 0)
        return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bits, 16));
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
    __mmask16 is_nan = _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q);
    __m512i quiet = _mm512_or_si512(bits, _mm512_set1_epi32(0x00400000));
    __m512i out = _mm512_srli_epi32(_mm512_mask_blend_epi32(is_nan, rounded, quiet), 16);
    return _mm512_cvtepi32_epi16(out); /* values fit in 16 bits: plain truncation */
}

TARGET static inline __m512 from_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

TARGET static inline __m256i nonfinite16(__m256i h, int exp_mask) {
    const __m256i exp = _mm256_set1_epi16((short)exp_mask);
    return _mm256_cmpeq_epi16(_mm256_and_si256(h, exp), exp);
}

TARGET static inline __attribute__((always_inline)) int span_f32_impl(void *data, int64_t n, float factor,
                                                                   int write, double *sumsq) {
    float *x = (float *)data;
    const __m512 f = _mm512_set1_ps(factor);
    __mmask16 bad = 0;
    double total = 0.0;
    int64_t nv = n & ~(int64_t)15, i = 0;
    while (i < nv) {
        int64_t end = nv - i < VRAM_AMP_TILE ? nv : i + VRAM_AMP_TILE;
        __m512 acc = _mm512_setzero_ps();
        for (; i < end; i += 16) {
            __m512 y = _mm512_loadu_ps(x + i);
            if (write) {
                y = _mm512_mul_ps(y, f);
                _mm512_storeu_ps(x + i, y);
            }
            bad |= nonfinite32(y);
            if (sumsq) acc = _mm512_add_ps(acc, _mm512_mul_ps(y, y));
        }
        if (sumsq) total += hsum_ps(acc);
    }
    int found = bad != 0;
    found |= vram__amp_portable.span[VRAM_FLOAT32](x + nv, n - nv, factor, write, sumsq ? &total : NULL);
    if (sumsq) *sumsq += total;
    return found;
}

VRAM__AMP_SPECIALISE(TARGET, span_f32)

/* The 16-bit spans share one body: CONVERT_IN widens sixteen raw elements, CONVERT_OUT
 * rounds back, EXP is the exponent mask of the storage type. */
#define DEFINE_SPAN16(NAME, DTYPE, CONVERT_IN, CONVERT_OUT, EXP)                                   \
    TARGET static inline __attribute__((always_inline)) int NAME##_impl(void *data, int64_t n, float factor,   \
                                                                     int write, double *sumsq) {         \
        uint16_t *x = (uint16_t *)data;                                                             \
        const __m512 f = _mm512_set1_ps(factor);                                                    \
        __m256i bad = _mm256_setzero_si256();                                                       \
        double total = 0.0;                                                                         \
        int64_t nv = n & ~(int64_t)15, i = 0;                                                       \
        while (i < nv) {                                                                            \
            int64_t end = nv - i < VRAM_AMP_TILE ? nv : i + VRAM_AMP_TILE;                          \
            __m512 acc = _mm512_setzero_ps();                                                       \
            for (; i < end; i += 16) {                                                              \
                __m256i h = _mm256_loadu_si256((const __m256i *)(x + i));                           \
                if (write) {                                                                        \
                    h = CONVERT_OUT(_mm512_mul_ps(CONVERT_IN(h), f));                               \
                    _mm256_storeu_si256((__m256i *)(x + i), h);                                     \
                }                                                                                   \
                bad = _mm256_or_si256(bad, nonfinite16(h, EXP));                                    \
                if (sumsq) {                                                                        \
                    __m512 y = CONVERT_IN(h);                                                       \
                    acc = _mm512_add_ps(acc, _mm512_mul_ps(y, y));                                  \
                }                                                                                   \
            }                                                                                       \
            if (sumsq) total += hsum_ps(acc);                                                       \
        }                                                                                           \
        int found = !_mm256_testz_si256(bad, bad);                                                  \
        found |= vram__amp_portable.span[DTYPE](x + nv, n - nv, factor, write, sumsq ? &total : NULL); \
        if (sumsq) *sumsq += total;                                                                 \
        return found;                                                                                   \
    }                                                                                                   \
    VRAM__AMP_SPECIALISE(TARGET, NAME)

#define F16_IN(h) _mm512_cvtph_ps(h)
#define F16_OUT(y) _mm512_cvtps_ph((y), _MM_FROUND_TO_NEAREST_INT)
DEFINE_SPAN16(span_f16, VRAM_FLOAT16, F16_IN, F16_OUT, 0x7C00)
DEFINE_SPAN16(span_bf16, VRAM_BFLOAT16, from_bf16, to_bf16, 0x7F80)

TARGET static inline __attribute__((always_inline)) int span_f64_impl(void *data, int64_t n, float factor,
                                                                   int write, double *sumsq) {
    double *x = (double *)data;
    const __m512d f = _mm512_set1_pd((double)factor);
    const __m512i exp = _mm512_set1_epi64(0x7FF0000000000000ll);
    __mmask8 bad = 0;
    __m512d acc = _mm512_setzero_pd();
    int64_t nv = n & ~(int64_t)7;
    for (int64_t i = 0; i < nv; i += 8) {
        __m512d y = _mm512_loadu_pd(x + i);
        if (write) {
            y = _mm512_mul_pd(y, f);
            _mm512_storeu_pd(x + i, y);
        }
        bad |= _mm512_cmpeq_epi64_mask(_mm512_and_si512(_mm512_castpd_si512(y), exp), exp);
        if (sumsq) acc = _mm512_add_pd(acc, _mm512_mul_pd(y, y));
    }
    double total = 0.0;
    if (sumsq) {
        __m256d q = _mm256_add_pd(_mm512_castpd512_pd256(acc), _mm512_extractf64x4_pd(acc, 1));
        __m128d h = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
        total = _mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h)));
    }
    int found = bad != 0;
    found |= vram__amp_portable.span[VRAM_FLOAT64](x + nv, n - nv, factor, write, sumsq ? &total : NULL);
    if (sumsq) *sumsq += total;
    return found;
}

VRAM__AMP_SPECIALISE(TARGET, span_f64)

static int supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

const vram__amp_path_t vram__amp_avx512 = {"avx512", supported, {span_f32, span_f16, span_bf16, span_f64}};

#else

static int unsupported(void) { return 0; }
const vram__amp_path_t vram__amp_avx512 = {"avx512", unsupported, {0, 0, 0, 0}};

#endif
