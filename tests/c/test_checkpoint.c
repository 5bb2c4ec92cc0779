/* test_checkpoint.c — the checkpoint planner from C: every algorithm's schedule replays in the
 * simulator to the figures it reports and respects the budget; "optimal" is no slower than any
 * baseline that fits and succeeds at exactly the least budget; bad input and tight budgets get
 * the right status. Runs under ASan+UBSan too (tables, recursion, op lists). */
#include <stdlib.h>

#include "harness.h"

static unsigned long long rng_state = 42;
static unsigned rnd(unsigned n) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (unsigned)((rng_state >> 33) % n);
}

static void random_chain(vram_ckpt_stage_t *s, size_t L) {
    for (size_t i = 0; i < L; i++) {
        uint64_t a = 1000 * (1 + rnd(8));
        s[i] = (vram_ckpt_stage_t){1 + rnd(9), 1 + rnd(9), a, a + 1000 * rnd(9), 250 * rnd(4), 250 * rnd(4), 250 * rnd(4)};
    }
}

static void test_every_algorithm_replays_and_fits(void) {
    vram_ckpt_stage_t s[40];
    for (int trial = 0; trial < 60; trial++) {
        size_t L = 1 + rnd(40);
        random_chain(s, L);
        /* a loss with memory of its own (cross-entropy keeps its softmax), or none (NULL) */
        uint64_t out_bytes = 1000 * (1 + rnd(8));
        vram_ckpt_stage_t loss_stage = {rnd(5), rnd(5), out_bytes, out_bytes + 1000 * rnd(5), 250 * rnd(4), 250 * rnd(4),
                                        250 * rnd(4)};
        const vram_ckpt_stage_t *loss = trial % 3 ? &loss_stage : NULL;
        uint64_t least = 0;
        CHECK_OK(vram_ckpt_min_budget(s, L, loss, &least));
        vram_ckpt_schedule_t *all = NULL;
        CHECK_OK(vram_ckpt_plan(s, L, loss, 0, VRAM_CKPT_NONE, 0, 0, &all, NULL));
        if (!all) return;
        uint64_t budget = least + (all->predicted_peak - least) * rnd(100) / 100;
        double best = 1e300;
        for (int alg = VRAM_CKPT_OPTIMAL; alg <= VRAM_CKPT_NONE; alg++) {
            vram_ckpt_schedule_t *p = NULL;
            uint64_t need = 0;
            int segs = 1 + (int)rnd((unsigned)L);
            vram_status_t st = vram_ckpt_plan(s, L, loss, budget, (vram_ckpt_algorithm_t)alg, segs, 0,
                                              &p, &need);
            if (alg == VRAM_CKPT_OPTIMAL) CHECK_OK(st);
            if (st == VRAM_ERR_INFEASIBLE) {
                CHECK(need > budget);
                continue;
            }
            CHECK_OK(st);
            if (!p) continue;
            double time;
            uint64_t peak;
            CHECK_OK(vram_ckpt_simulate(s, L, loss, p->ops, p->num_ops, &time, &peak));
            CHECK(time == p->predicted_time && peak == p->predicted_peak);
            CHECK(peak <= budget);
            if (alg == VRAM_CKPT_OPTIMAL) best = time;
            else CHECK(best <= time);
            vram_ckpt_schedule_free(p);
        }
        vram_ckpt_schedule_t *tight = NULL;
        CHECK_OK(vram_ckpt_plan(s, L, loss, least, VRAM_CKPT_OPTIMAL, 0, 0, &tight, NULL));
        if (tight) CHECK(tight->predicted_peak <= least);
        vram_ckpt_schedule_free(tight);
        vram_ckpt_schedule_free(all);
    }
}

static void test_infeasible_and_bad_input(void) {
    vram_ckpt_stage_t s[5];
    random_chain(s, 5);
    uint64_t least = 0, need = 0;
    vram_ckpt_stage_t loss = {0, 0, 4000, 4000, 0, 0, 0};
    CHECK_OK(vram_ckpt_min_budget(s, 5, &loss, &least));
    vram_ckpt_schedule_t *p = (vram_ckpt_schedule_t *)1;
    CHECK_STATUS(vram_ckpt_plan(s, 5, &loss, least - 1, VRAM_CKPT_OPTIMAL, 0, 0, &p, &need), VRAM_ERR_INFEASIBLE);
    CHECK(p == NULL && need == least);
    CHECK_CONTAINS(vram_last_error(), "below the least");
    CHECK_STATUS(vram_ckpt_plan(s, 0, NULL, 100, VRAM_CKPT_OPTIMAL, 0, 0, &p, NULL), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_ckpt_plan(s, 5, NULL, 0, VRAM_CKPT_OPTIMAL, 0, 0, &p, NULL), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_ckpt_plan(s, 5, NULL, 10000, VRAM_CKPT_SEGMENTS, 6, 0, &p, NULL), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_ckpt_plan(s, 5, NULL, 10000, (vram_ckpt_algorithm_t)9, 0, 0, &p, NULL), VRAM_ERR_INVALID_ARG);
    vram_ckpt_stage_t bad = s[0];
    bad.saved_bytes = bad.input_bytes - 1;
    CHECK_STATUS(vram_ckpt_plan(&bad, 1, NULL, 1 << 30, VRAM_CKPT_NONE, 0, 0, &p, NULL), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "stage 0: saved_bytes");
    CHECK_STATUS(vram_ckpt_plan(s, 5, &bad, 1 << 30, VRAM_CKPT_NONE, 0, 0, &p, NULL), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "loss, stage 5: saved_bytes");
    vram_ckpt_op_t ops[] = {{VRAM_CKPT_BWD, 4}};
    double t;
    uint64_t peak;
    CHECK_STATUS(vram_ckpt_simulate(s, 5, NULL, ops, 1, &t, &peak), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "op 0: BWD(4) out of order");
}

static void test_revolve_snapshots_trade_memory_for_forwards(void) {
    vram_ckpt_stage_t s[30];
    for (int i = 0; i < 30; i++) s[i] = (vram_ckpt_stage_t){1, 1, 100, 100, 0, 0, 0};
    uint64_t least = 0;
    CHECK_OK(vram_ckpt_min_budget(s, 30, NULL, &least));
    double last = 1e300;
    for (uint64_t budget = least; budget < least + 3000; budget += 100) {
        vram_ckpt_schedule_t *p = NULL;
        CHECK_OK(vram_ckpt_plan(s, 30, NULL, budget, VRAM_CKPT_REVOLVE, 0, 0, &p, NULL));
        if (!p) return;
        CHECK(p->predicted_time <= last); /* more memory never costs more forwards */
        last = p->predicted_time;
        vram_ckpt_schedule_free(p);
    }
    /* With a snapshot per stage Revolve still tapes each stage separately (it has no notion of
     * keeping a stage's saved tensors): 29 advances, 30 taping forwards, 30 backwards. */
    CHECK(last == 89.0);
}

/* The loss's own memory, worked out by hand (fwd_tmp, 99, is for forwards that save nothing,
 * so it plays no part here): x_0 = 100; FWD_ALL(0) peaks at 100 + 50 + 10 + 200 = 360 and
 * leaves 350; the loss forward adds its 30 saved bytes and 5 transient (385),
 * its backward the 50-byte gradient and 200 transient on 380 (630); BWD(0) peaks at 350 + 100
 * + 20 = 470. Time 1 + 3 + 4 + 2. */
static void test_loss_memory_and_time(void) {
    vram_ckpt_stage_t s = {1, 2, 100, 300, 99, 20, 10}, loss = {3, 4, 50, 80, 99, 200, 5};
    vram_ckpt_op_t ops[] = {{VRAM_CKPT_FWD_ALL, 0}, {VRAM_CKPT_LOSS, 1}, {VRAM_CKPT_BWD, 0}};
    double t = 0;
    uint64_t peak = 0;
    CHECK_OK(vram_ckpt_simulate(&s, 1, &loss, ops, 3, &t, &peak));
    CHECK(t == 10.0 && peak == 630);
    loss.bwd_tmp = 0; /* now the loss forward's 385 is below BWD(0)'s 470 */
    CHECK_OK(vram_ckpt_simulate(&s, 1, &loss, ops, 3, &t, &peak));
    CHECK(peak == 470);
    uint64_t least = 0;
    CHECK_OK(vram_ckpt_min_budget(&s, 1, &loss, &least));
    CHECK(least == 470);
}

int main(void) {
    RUN(test_every_algorithm_replays_and_fits);
    RUN(test_infeasible_and_bad_input);
    RUN(test_revolve_snapshots_trade_memory_for_forwards);
    RUN(test_loss_memory_and_time);
    return harness_finish();
}
