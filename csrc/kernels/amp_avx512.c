/* amp_avx512.c — the loss-scaling spans with AVX-512F (Skylake-SP and later, Zen 4), sixteen
 * float32 lanes per vector. Only the functions carry the target attribute, and the dispatcher
 * calls them only when the CPU (and the OS, which must save the ZMM state) supports AVX-512F
 * alongside AVX2 and F16C. The spans themselves are amp_simd_spans.h, as for amp_avx2.c; this
 * file gives it what is particular to 512-bit vectors. */
#include "amp_internal.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx2,f16c")))
#define SIMD_BITS 512
#define HALF_PREFIX _mm256 /* sixteen 16-bit elements: __m256i */
#define HALF_BITS 256
/* One chain of adds, as this path has always summed (a second would change the sums' last bits). */
#define SPAN16_ACCUMULATORS 1

/* Inf/NaN lanes so far: compare masks OR-ed together (float64 compares fill the low 8 bits). */
typedef __mmask16 flags_t;
TARGET static inline flags_t no_flags(void) { return 0; }
TARGET static inline int any_flag(flags_t bad) { return bad != 0; }

TARGET static inline flags_t flag_nonfinite32(flags_t bad, __m512 y) {
    const __m512i exp = _mm512_set1_epi32(0x7F800000);
    return bad | _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(y), exp), exp);
}

TARGET static inline flags_t flag_nonfinite64(flags_t bad, __m512d y) {
    const __m512i exp = _mm512_set1_epi64(0x7FF0000000000000ll);
    return bad | _mm512_cmpeq_epi64_mask(_mm512_and_si512(_mm512_castpd_si512(y), exp), exp);
}

/* AVX-512F has no 256-bit float32 extract (that is AVX-512DQ): take the upper half as float64 bits. */
TARGET static inline __m256 lower_half_ps(__m512 v) { return _mm512_castps512_ps256(v); }
TARGET static inline __m256 upper_half_ps(__m512 v) {
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}
TARGET static inline __m256d fold_to_pd256(__m512d v) {
    return _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
}

TARGET static inline int low_halves_zero(__m512i bits) {
    return _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0xFFFF)) == 0;
}

/* Sixteen 32-bit lanes holding 16-bit values: plain truncation packs them in order. */
TARGET static inline __m256i narrow_epi32(__m512i v) { return _mm512_cvtepi32_epi16(v); }

TARGET static inline __m512i select_nan(__m512 y, __m512i if_nan, __m512i otherwise) {
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), otherwise, if_nan);
}

#include "amp_simd_spans.h"

static int supported(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

const vram__amp_path_t vram__amp_avx512 = {"avx512", supported, SIMD_SPANS};

#else

static int unsupported(void) { return 0; }
const vram__amp_path_t vram__amp_avx512 = {"avx512", unsupported, {0, 0, 0, 0}};

#endif
