/* scale_update.c — the host side of the dynamic loss-scale rule (the rule itself is in
 * scale_rule.h, shared with the CUDA kernel). */
#include <math.h>

#include "../util/error.h"
#include "scale_rule.h"

void vram_scale_policy_default(vram_scale_policy_t *policy) {
    policy->growth_factor = 2.0;
    policy->backoff_factor = 0.5;
    policy->growth_interval = 2000;
    policy->hysteresis = 1;
    policy->min_scale = 0.0f;
    policy->max_scale = INFINITY;
}

vram_status_t vram_scale_policy_check(const vram_scale_policy_t *p) {
    if (!p) return vram__fail(VRAM_ERR_INVALID_ARG, "policy is NULL");
    if (!isfinite(p->growth_factor) || p->growth_factor <= 0.0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "growth_factor must be finite and > 0, got %g", p->growth_factor);
    if (!isfinite(p->backoff_factor) || p->backoff_factor <= 0.0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "backoff_factor must be finite and > 0, got %g", p->backoff_factor);
    if (p->growth_interval < 1)
        return vram__fail(VRAM_ERR_INVALID_ARG, "growth_interval must be >= 1, got %d", (int)p->growth_interval);
    if (p->hysteresis < 1)
        return vram__fail(VRAM_ERR_INVALID_ARG, "hysteresis must be >= 1, got %d", (int)p->hysteresis);
    if (!(p->min_scale >= 0.0f) || isinf(p->min_scale))
        return vram__fail(VRAM_ERR_INVALID_ARG, "min_scale must be finite and >= 0, got %g", (double)p->min_scale);
    if (!(p->max_scale > 0.0f))
        return vram__fail(VRAM_ERR_INVALID_ARG, "max_scale must be > 0 (inf for none), got %g", (double)p->max_scale);
    if (p->min_scale > p->max_scale)
        return vram__fail(VRAM_ERR_INVALID_ARG, "min_scale (%g) is above max_scale (%g)", (double)p->min_scale,
                          (double)p->max_scale);
    return VRAM_OK;
}

vram_status_t vram_amp_update_scale(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                    float found_inf, const vram_scale_policy_t *policy) {
    vram_status_t st = vram_scale_policy_check(policy);
    if (st != VRAM_OK) return st;
    if (!scale || !growth_tracker) return vram__fail(VRAM_ERR_INVALID_ARG, "scale and growth_tracker must not be NULL");
    if (policy->hysteresis > 1 && !hysteresis_tracker)
        return vram__fail(VRAM_ERR_INVALID_ARG, "hysteresis is %d but hysteresis_tracker is NULL",
                          (int)policy->hysteresis);
    vram__scale_rule(scale, growth_tracker, hysteresis_tracker, found_inf, policy);
    return VRAM_OK;
}
