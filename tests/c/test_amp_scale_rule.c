/* test_amp_scale_rule.c — the loss-scale rule (vram_amp_update_scale, csrc/kernels/scale_rule.h):
 * against a re-implementation of torch._amp_update_scale_ on random policies and overflow
 * sequences, and hand-worked step sequences for hysteresis, bounds and restored state. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "harness.h"
#include "../../csrc/kernels/amp_internal.h"

static uint64_t rng_state = 0x13198A2E03707344ull;
static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* torch._amp_update_scale_ (reference §2.2): one thread, float scale, double factors. */
static void torch_update_scale(float *scale, int32_t *tracker, float found_inf, double growth, double backoff,
                               int32_t interval) {
    if (found_inf != 0.0f) {
        *scale = (float)(*scale * backoff);
        *tracker = 0;
        return;
    }
    int32_t successful = *tracker + 1;
    float next = (float)(*scale * growth);
    if (successful == interval && isfinite(next)) *scale = next;
    *tracker = successful == interval ? 0 : successful;
}

static void test_update_scale_matches_torch(void) {
    static const float starts[] = {65536.0f, 1.0f, 3e38f, 1e-44f, 0.75f};
    static const double growths[] = {2.0, 1.5, 3.0, 1.0000001}, backoffs[] = {0.5, 0.25, 0.9, 0.1};
    long bad = 0;
    int32_t hyst = 77;
    for (int run = 0; run < 400; run++) {
        vram_scale_policy_t pol;
        vram_scale_policy_default(&pol);
        pol.growth_factor = growths[rnd() % 4];
        pol.backoff_factor = backoffs[rnd() % 4];
        pol.growth_interval = 1 + (int32_t)(rnd() % 6);
        float a = starts[run % 5], b = a;
        int32_t ta = 0, tb = 0;
        for (int step = 0; step < 200; step++) {
            uint64_t k = rnd() % 10;
            float found = k < 6 ? 0.0f : k < 8 ? 1.0f : k < 9 ? 3.0f : NAN; /* a sum, or garbage */
            if (vram_amp_update_scale(&a, &ta, run % 2 ? &hyst : NULL, found, &pol) != VRAM_OK) bad++;
            torch_update_scale(&b, &tb, found, pol.growth_factor, pol.backoff_factor, pol.growth_interval);
            bad += vram__f32_bits(a) != vram__f32_bits(b) || ta != tb;
        }
    }
    CHECK(bad == 0);
    CHECK(hyst == 77); /* untouched with hysteresis 1 */
}

typedef struct { float found, scale; int32_t growth, hyst; } step_t; /* inputs, then the expected state */

static void run_steps(vram_scale_policy_t pol, float scale, int32_t growth, int32_t hyst, const step_t *steps,
                      size_t n, int line) {
    for (size_t i = 0; i < n; i++) {
        CHECK_OK(vram_amp_update_scale(&scale, &growth, &hyst, steps[i].found, &pol));
        int ok = scale == steps[i].scale && growth == steps[i].growth && hyst == steps[i].hyst;
        CHECK(ok);
        if (!ok) {
            fprintf(stderr, "  line %d step %zu: scale %g growth %d hyst %d, want %g %d %d\n", line, i, (double)scale,
                    (int)growth, (int)hyst, (double)steps[i].scale, (int)steps[i].growth, (int)steps[i].hyst);
            return;
        }
    }
}
#define RUN_STEPS(pol, scale, g, h, steps) run_steps(pol, scale, g, h, steps, sizeof steps / sizeof *steps, __LINE__)

static void test_update_scale_policies(void) {
    vram_scale_policy_t pol;
    vram_scale_policy_default(&pol);
    CHECK(pol.growth_factor == 2.0 && pol.backoff_factor == 0.5 && pol.growth_interval == 2000);
    CHECK(pol.hysteresis == 1 && pol.min_scale == 0.0f && isinf(pol.max_scale));
    CHECK_OK(vram_scale_policy_check(&pol));
    CHECK_STATUS(vram_scale_policy_check(NULL), VRAM_ERR_INVALID_ARG);
    vram_scale_policy_t bad[17];
    for (int i = 0; i < 17; i++) bad[i] = pol;
    bad[0].growth_factor = 0, bad[1].growth_factor = -2, bad[2].growth_factor = INFINITY, bad[3].growth_factor = NAN;
    bad[4].backoff_factor = 0, bad[5].backoff_factor = NAN, bad[6].backoff_factor = -INFINITY;
    bad[7].growth_interval = 0, bad[8].growth_interval = -5, bad[9].hysteresis = 0;
    bad[10].min_scale = -1, bad[11].min_scale = INFINITY, bad[12].min_scale = NAN;
    bad[13].max_scale = 0, bad[14].max_scale = NAN, bad[15].max_scale = -1;
    bad[16].min_scale = 10, bad[16].max_scale = 5; /* min above max */
    static const char *const names[17] = {"growth_factor", "growth_factor", "growth_factor", "growth_factor",
                                          "backoff_factor", "backoff_factor", "backoff_factor", "growth_interval",
                                          "growth_interval", "hysteresis", "min_scale", "min_scale", "min_scale",
                                          "max_scale", "max_scale", "max_scale", "min_scale"};
    for (int i = 0; i < 17; i++) {
        float scale = 8.0f;
        int32_t g = 3, h = 2;
        CHECK_STATUS(vram_scale_policy_check(&bad[i]), VRAM_ERR_INVALID_ARG);
        CHECK_CONTAINS(vram_last_error(), names[i]);
        CHECK_STATUS(vram_amp_update_scale(&scale, &g, &h, 1.0f, &bad[i]), VRAM_ERR_INVALID_ARG);
        CHECK(scale == 8.0f && g == 3 && h == 2);
    }
    float scale = 8.0f;
    int32_t g = 0;
    CHECK_STATUS(vram_amp_update_scale(NULL, &g, NULL, 0.0f, &pol), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_amp_update_scale(&scale, NULL, NULL, 0.0f, &pol), VRAM_ERR_INVALID_ARG);
    pol.hysteresis = 2;
    CHECK_STATUS(vram_amp_update_scale(&scale, &g, NULL, 1.0f, &pol), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "hysteresis_tracker");
    CHECK(scale == 8.0f && g == 0);

    /* Hysteresis 3: only the third consecutive overflow backs off, and every one after it;
     * an absorbed overflow still resets the growth tracker; a clean step refills. */
    pol.hysteresis = 3, pol.growth_interval = 2;
    static const step_t hyst3[] = {{1, 1024, 0, 2}, {1, 1024, 0, 1}, {1, 512, 0, 0}, {1, 256, 0, 0},
                                   {0, 256, 1, 3},  {1, 256, 0, 2},  {0, 256, 1, 3}, {0, 512, 0, 3},
                                   {1, 512, 0, 2},  {0, 512, 1, 3},  {1, 512, 0, 2}, {1, 512, 0, 1},
                                   {0, 512, 1, 3},  {1, 512, 0, 2},  {1, 512, 0, 1}, {1, 256, 0, 0}};
    RUN_STEPS(pol, 1024.0f, 1, 3, hyst3);

    /* Floor and ceiling: a backoff stops at min_scale, a growth at max_scale. */
    vram_scale_policy_default(&pol);
    pol.growth_interval = 1, pol.min_scale = 100.0f, pol.max_scale = 1000.0f;
    static const step_t bounds[] = {{1, 100, 0, 9}, {1, 100, 0, 9}, {0, 200, 0, 9}, {0, 400, 0, 9},
                                    {0, 800, 0, 9}, {0, 1000, 0, 9}, {0, 1000, 0, 9}, {1, 500, 0, 9},
                                    {1, 250, 0, 9}, {1, 125, 0, 9}, {1, 100, 0, 9}};
    RUN_STEPS(pol, 150.0f, 0, 9, bounds);
    /* A scale already beyond a bound is neither moved further out nor pulled back. */
    static const step_t below[] = {{1, 50, 0, 9}, {1, 50, 0, 9}, {0, 100, 0, 9}, {1, 100, 0, 9}};
    RUN_STEPS(pol, 50.0f, 0, 9, below);
    static const step_t above[] = {{0, 5000, 0, 9}, {1, 2500, 0, 9}, {0, 2500, 0, 9}, {1, 1250, 0, 9},
                                   {1, 625, 0, 9},  {0, 1000, 0, 9}};
    RUN_STEPS(pol, 5000.0f, 0, 9, above);
    /* No growth to inf even without a ceiling; a tracker above the interval grows (>=). */
    vram_scale_policy_default(&pol);
    pol.growth_interval = 5;
    static const step_t top[] = {{0, 3e38f, 0, 0}, {0, 3e38f, 1, 0}};
    RUN_STEPS(pol, 3e38f, 4, 0, top);
    static const step_t restored[] = {{0, 16, 0, 0}};
    RUN_STEPS(pol, 8.0f, 10, 0, restored);
}

int main(void) {
    RUN(test_update_scale_matches_torch);
    RUN(test_update_scale_policies);
    return harness_finish();
}
