/* amp_avx2.c — the loss-scaling spans with AVX2 and F16C (Haswell and later, Zen), eight
 * float32 lanes per vector. Compiled for the baseline ISA: only these functions carry the
 * target attribute, and the dispatcher calls them only when the CPU reports AVX2 and F16C.
 * The spans themselves are amp_simd_spans.h; this file gives it what is particular to
 * 256-bit vectors. */
#include "amp_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx2,f16c")))
#define SIMD_BITS 256
#define HALF_PREFIX _mm /* eight 16-bit elements: __m128i */
#define HALF_BITS 128
/* Two chains of adds for the 16-bit sums: one chain of eight lanes is bound by add latency. */
#define SPAN16_ACCUMULATORS 2

/* Inf/NaN lanes so far: compare results OR-ed together (AVX2 has no mask registers). */
typedef __m256i flags_t;
TARGET static inline flags_t no_flags(void) { return _mm256_setzero_si256(); }
TARGET static inline int any_flag(flags_t bad) { return !_mm256_testz_si256(bad, bad); }

TARGET static inline flags_t flag_nonfinite32(flags_t bad, __m256 y) {
    const __m256i exp = _mm256_set1_epi32(0x7F800000);
    return _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(y), exp), exp));
}

TARGET static inline flags_t flag_nonfinite64(flags_t bad, __m256d y) {
    const __m256i exp = _mm256_set1_epi64x(0x7FF0000000000000ll);
    return _mm256_or_si256(bad, _mm256_cmpeq_epi64(_mm256_and_si256(_mm256_castpd_si256(y), exp), exp));
}

TARGET static inline __m128 lower_half_ps(__m256 v) { return _mm256_castps256_ps128(v); }
TARGET static inline __m128 upper_half_ps(__m256 v) { return _mm256_extractf128_ps(v, 1); }
TARGET static inline __m256d fold_to_pd256(__m256d v) { return v; }

/* bfloat16 rounding: all low halves zero (nothing to round)? */
TARGET static inline int low_halves_zero(__m256i bits) { return _mm256_testz_si256(bits, _mm256_set1_epi32(0xFFFF)); }

/* Eight 32-bit lanes holding 16-bit values, packed in order. */
TARGET static inline __m128i narrow_epi32(__m256i v) {
    return _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
}

TARGET static inline __m256i select_nan(__m256 y, __m256i if_nan, __m256i otherwise) {
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)); /* one compare, no mask */
    return _mm256_blendv_epi8(otherwise, if_nan, is_nan);
}

#include "amp_simd_spans.h"

static int supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

const vram__amp_path_t vram__amp_avx2 = {"avx2", supported, SIMD_SPANS};

#else /* not x86-64: the path exists but is never supported */

static int unsupported(void) { return 0; }
const vram__amp_path_t vram__amp_avx2 = {"avx2", unsupported, {0, 0, 0, 0}};

#endif
