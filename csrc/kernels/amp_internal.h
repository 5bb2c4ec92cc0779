/* amp_internal.h — what the CPU loss-scaling paths share: exact scalar conversions between
 * float32 and the 16-bit storage types, the raw-bit inf/NaN tests, and the table of span
 * functions each SIMD path (portable, AVX2+F16C, AVX-512) provides. */
#ifndef VRAM_KERNELS_AMP_INTERNAL_H
#define VRAM_KERNELS_AMP_INTERNAL_H

#include <stdint.h>
#include <string.h>

#include "vramkit.h"

/* Sums of squares are accumulated in float32 over tiles of this many elements, then added
 * in float64; every path uses the same tiling relative to the start of a work item. */
#define VRAM_AMP_TILE 1024
/* A work item (the unit handed to a thread) covers at most this many elements of one tensor,
 * always a multiple of VRAM_AMP_TILE, so tiles never depend on how work is divided. */
#define VRAM_AMP_CHUNK (64 * VRAM_AMP_TILE)

static inline uint32_t vram__f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline float vram__f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline int vram__f32_nonfinite(uint32_t bits) { return (bits & 0x7F800000u) == 0x7F800000u; }
static inline int vram__f16_nonfinite(uint16_t bits) { return (bits & 0x7C00u) == 0x7C00u; }
static inline int vram__bf16_nonfinite(uint16_t bits) { return (bits & 0x7F80u) == 0x7F80u; }
static inline int vram__f64_nonfinite(uint64_t bits) {
    return (bits & 0x7FF0000000000000ull) == 0x7FF0000000000000ull;
}

/* binary16 -> float32, exact for every input (subnormals included; NaN payloads kept). */
static inline float vram__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    if (exp == 0x1F) return vram__f32_from_bits(sign | 0x7F800000u | (man << 13));
    if (exp != 0) return vram__f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
    if (man == 0) return vram__f32_from_bits(sign);
    /* Subnormal: value = man * 2^-24, exact in float32. */
    float mag = (float)man * 5.9604644775390625e-08f;
    return vram__f32_from_bits(sign | vram__f32_bits(mag));
}

/* float32 -> binary16, round to nearest even; overflow gives inf, NaN stays NaN (quieted),
 * as the F16C instruction and NumPy do. */
static inline uint16_t vram__f32_to_f16(float f) {
    uint32_t x = vram__f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7FFFFFFFu;
    if (ax >= 0x7F800000u) /* inf or NaN */
        return (uint16_t)(sign | 0x7C00u | (ax > 0x7F800000u ? 0x200u | ((ax >> 13) & 0x3FFu) : 0u));
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to >= 65520: inf */
    if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal or zero */
        if (ax < 0x33000000u) return sign;                    /* below 2^-25: rounds to zero */
        uint32_t man = (ax & 0x7FFFFFu) | 0x800000u;
        uint32_t shift = 126u - (ax >> 23); /* value = man * 2^(e-150) = (man >> (126-e)) * 2^-24 */
        uint32_t kept = man >> shift, rest = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rest > half || (rest == half && (kept & 1u))) kept++;
        return (uint16_t)(sign | kept);
    }
    /* Normal: rebias the exponent and round the 13 dropped mantissa bits to nearest even;
     * a carry out of the mantissa correctly bumps the exponent. */
    uint32_t r = ax - 0x38000000u;
    r += 0x0FFFu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

static inline float vram__bf16_to_f32(uint16_t b) { return vram__f32_from_bits((uint32_t)b << 16); }

/* float32 -> bfloat16, round to nearest even; NaN stays NaN (quieted, sign and top payload
 * kept), as ml_dtypes does. */
static inline uint16_t vram__f32_to_bf16(float f) {
    uint32_t x = vram__f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

/* One span of one tensor: multiply `n` elements at `data` by `factor` (written back only when
 * `write`), return nonzero if any input or result is inf/NaN, and when `sumsq` is not NULL
 * add the sum of squares of the results to it (float32 per VRAM_AMP_TILE, float64 across). */
typedef int (*vram__amp_span_fn)(void *data, int64_t n, float factor, int write, double *sumsq);

/* A span entry point NAME for DTYPE that calls BODY(DTYPE, data, n, factor, write, sumsq),
 * an always-inline body, with write and "sum or not" fixed, so each of the four inlined
 * copies has a branch-free inner loop. ATTR is the SIMD target attribute of the file. */
#define VRAM__AMP_SPECIALISE(ATTR, NAME, BODY, DTYPE)                                            \
    ATTR static int NAME(void *data, int64_t n, float factor, int write, double *sumsq) {       \
        if (!write) return sumsq ? BODY(DTYPE, data, n, factor, 0, sumsq) : BODY(DTYPE, data, n, factor, 0, NULL); \
        return sumsq ? BODY(DTYPE, data, n, factor, 1, sumsq) : BODY(DTYPE, data, n, factor, 1, NULL); \
    }

typedef struct vram__amp_path {
    const char *name;
    int (*supported)(void);
    vram__amp_span_fn span[4]; /* indexed by vram_dtype_t */
} vram__amp_path_t;

extern const vram__amp_path_t vram__amp_portable;
extern const vram__amp_path_t vram__amp_avx2;
extern const vram__amp_path_t vram__amp_avx512;

/* Validate a tensor list: tensors != NULL when count > 0, a known dtype, numel >= 0, data
 * non-NULL and aligned to the element size when numel > 0, and numel * element size below
 * 2^62. VRAM_ERR_INVALID_ARG names the first offending index ("tensor 3: ..."). */
vram_status_t vram__amp_check_list(const vram_tensor_t *tensors, size_t count);

/* The SIMD path in use (VRAMKIT_SIMD or the best supported, chosen on first use); the dense
 * and strided entry points share it so both round every element the same way. */
const vram__amp_path_t *vram__amp_current_path(void);

/* How many items ahead the passes prefetch, and how many of an item's first bytes. */
#define VRAM_AMP_PREFETCH_AHEAD 4
#define VRAM_AMP_PREFETCH_BYTES 512

/* Below this many elements a call runs on the calling thread: waking workers costs a few
 * microseconds, which only pays off once a pass takes tens of microseconds. */
#define VRAM_AMP_PARALLEL_MIN (4 * VRAM_AMP_CHUNK)

#endif
