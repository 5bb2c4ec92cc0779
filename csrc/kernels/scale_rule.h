/* scale_rule.h — the dynamic loss-scale rule, written once for the host (C) and the device
 * (CUDA): vram_amp_update_scale runs it on the CPU, and a one-thread kernel runs the same
 * code on the GPU, so both give bit-identical scales. See vram_scale_policy_t in vramkit.h.
 *
 * Arithmetic matches torch._amp_update_scale_: `scale * factor` is formed in double (the
 * factors are doubles) and rounded once to float. */
#ifndef VRAM_KERNELS_SCALE_RULE_H
#define VRAM_KERNELS_SCALE_RULE_H

#include <stdint.h>

#include "vramkit.h"

#ifdef __CUDACC__
#define VRAM_HD __host__ __device__ __forceinline__
#define VRAM_RULE_ISFINITE(x) isfinite(x)
#else
#include <math.h>
#define VRAM_HD static inline
#define VRAM_RULE_ISFINITE(x) isfinite(x)
#endif

/* `hysteresis_tracker` may be NULL when policy->hysteresis == 1. */
VRAM_HD void vram__scale_rule(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker, float found_inf,
                              const vram_scale_policy_t *p) {
    if (found_inf != 0.0f) {
        if (p->hysteresis > 1 && hysteresis_tracker) {
            /* Apex semantics: count down; only when the allowance is used up does it back off.
             * The tracker stays at 0 (not below) so every further consecutive overflow backs
             * off too, and it cannot underflow over a long run of overflows. */
            int32_t left = *hysteresis_tracker - 1;
            *hysteresis_tracker = left > 0 ? left : 0;
            if (left > 0) {
                *growth_tracker = 0;
                return;
            }
        }
        float backed = (float)((double)*scale * p->backoff_factor);
        /* Backoff stops at the floor; a scale already below it (set by the user or loaded from
         * a checkpoint) is neither raised nor lowered further. */
        if (backed < p->min_scale) backed = *scale >= p->min_scale ? p->min_scale : *scale;
        *scale = backed;
        *growth_tracker = 0;
        return;
    }
    if (p->hysteresis > 1 && hysteresis_tracker) *hysteresis_tracker = p->hysteresis;
    int32_t successful = *growth_tracker + 1;
    if (successful >= p->growth_interval) {
        float grown = (float)((double)*scale * p->growth_factor);
        /* Growth stops at the ceiling; a scale already above it is neither lowered nor grown. */
        if (grown > p->max_scale) grown = *scale <= p->max_scale ? p->max_scale : *scale;
        /* PyTorch #98876: never grow to inf. */
        if (VRAM_RULE_ISFINITE(grown)) *scale = grown;
        *growth_tracker = 0;
    } else {
        *growth_tracker = successful;
    }
}

#endif
