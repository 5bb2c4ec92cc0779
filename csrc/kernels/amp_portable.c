/* amp_portable.c — the loss-scaling spans in plain C11, for CPUs without AVX2 (aarch64
 * included) and for the tails of the SIMD paths. The conversions are the exact scalar ones
 * of amp_internal.h; accumulation uses eight float32 lanes per tile, like the SIMD paths,
 * so sums of squares agree closely across paths. */
#include "amp_internal.h"

#define LANES 8

/* One macro body per 16/32-bit dtype: LOAD widens the raw element to float, STORE narrows a
 * float to the raw element type, BAD tests a raw element for inf/NaN. */
#define DEFINE_SPAN(NAME, RAW, LOAD, STORE, BAD)                                                    \
    static int NAME(void *data, int64_t n, float factor, int write, double *sumsq) {                 \
        RAW *x = (RAW *)data;                                                                        \
        int bad = 0;                                                                                 \
        double total = 0.0;                                                                          \
        for (int64_t t = 0; t < n; t += VRAM_AMP_TILE) {                                             \
            int64_t end = n - t < VRAM_AMP_TILE ? n : t + VRAM_AMP_TILE;                             \
            float acc[LANES] = {0};                                                                  \
            for (int64_t i = t; i < end; i++) {                                                      \
                RAW raw = x[i];                                                                      \
                if (write) {                                                                         \
                    raw = STORE(LOAD(raw) * factor);                                                 \
                    x[i] = raw;                                                                      \
                }                                                                                    \
                bad |= BAD(raw);                                                                     \
                if (sumsq) {                                                                         \
                    float y = LOAD(raw);                                                             \
                    acc[(i - t) % LANES] += y * y;                                                   \
                }                                                                                    \
            }                                                                                        \
            if (sumsq)                                                                               \
                for (int l = 0; l < LANES; l++) total += acc[l];                                     \
        }                                                                                            \
        if (sumsq) *sumsq += total;                                                                  \
        return bad;                                                                                  \
    }

#define F32_LOAD(r) vram__f32_from_bits(r)
#define F32_STORE(f) vram__f32_bits(f)
#define F32_BAD(r) vram__f32_nonfinite(r)
DEFINE_SPAN(span_f32, uint32_t, F32_LOAD, F32_STORE, F32_BAD)
DEFINE_SPAN(span_f16, uint16_t, vram__f16_to_f32, vram__f32_to_f16, vram__f16_nonfinite)
DEFINE_SPAN(span_bf16, uint16_t, vram__bf16_to_f32, vram__f32_to_bf16, vram__bf16_nonfinite)

/* float64 is computed in float64, as PyTorch does (its opmath type for double is double). */
static int span_f64(void *data, int64_t n, float factor, int write, double *sumsq) {
    double *x = (double *)data, f = (double)factor, total = 0.0;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        double y = x[i];
        if (write) {
            y *= f;
            x[i] = y;
        }
        uint64_t bits;
        memcpy(&bits, &y, sizeof bits);
        bad |= vram__f64_nonfinite(bits);
        total += y * y;
    }
    if (sumsq) *sumsq += total;
    return bad;
}

static int always(void) { return 1; }

const vram__amp_path_t vram__amp_portable = {"portable", always, {span_f32, span_f16, span_bf16, span_f64}};
