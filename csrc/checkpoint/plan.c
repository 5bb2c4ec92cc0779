/* plan.c — the public checkpoint-planning entry points: build the chain, run the chosen
 * algorithm, replay its schedule through the simulator for the predicted time and peak, and
 * turn "does not fit" into VRAM_ERR_INFEASIBLE naming the least budget that does. */
#include <math.h>
#include <stdlib.h>

#include "../util/error.h"
#include "chain.h"

static vram_status_t replay_peak(const vram__chain_t *c, vram__oplist_t *ops, double *time, uint64_t *peak) {
    if (ops->failed) return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for the schedule");
    return vram__simulate(c, ops->ops, ops->n, time, peak);
}

vram_status_t vram_ckpt_min_budget(const vram_ckpt_stage_t *stages, size_t count, const vram_ckpt_stage_t *loss,
                                   uint64_t *out) {
    if (!out) return vram__fail(VRAM_ERR_INVALID_ARG, "out is NULL");
    vram__chain_t c;
    vram_status_t rc = vram__chain_make(stages, count, loss, &c);
    if (rc == VRAM_OK) rc = vram__least_memory(&c, out, NULL);
    vram__chain_free(&c);
    return rc;
}

vram_status_t vram_ckpt_simulate(const vram_ckpt_stage_t *stages, size_t count, const vram_ckpt_stage_t *loss,
                                 const vram_ckpt_op_t *ops, size_t num_ops, double *time, uint64_t *peak) {
    if (!time || !peak || (num_ops && !ops)) return vram__fail(VRAM_ERR_INVALID_ARG, "ops, time and peak must not be NULL");
    vram__chain_t c;
    vram_status_t rc = vram__chain_make(stages, count, loss, &c);
    if (rc == VRAM_OK) rc = vram__simulate(&c, ops, num_ops, time, peak);
    vram__chain_free(&c);
    return rc;
}

void vram_ckpt_schedule_free(vram_ckpt_schedule_t *s) {
    if (!s) return;
    free(s->ops);
    free(s);
}

/* Revolve with the most snapshots whose schedule fits (all of them when budget is 0). */
static vram_status_t plan_revolve(const vram__chain_t *c, uint64_t budget, vram__oplist_t *out, uint64_t *need) {
    size_t lo = 0, hi = c->L; /* find the largest snapshot count that fits; peaks grow with it */
    vram__oplist_t best = {0};
    int found = 0;
    while (lo <= hi) {
        size_t mid = lo + (hi - lo) / 2;
        vram__oplist_t ops = {0};
        vram_status_t rc = vram__sched_revolve(c, mid, &ops);
        double time;
        uint64_t peak = 0;
        if (rc == VRAM_OK) rc = replay_peak(c, &ops, &time, &peak);
        if (rc != VRAM_OK) {
            free(ops.ops), free(best.ops);
            return rc;
        }
        if (budget == 0 || peak <= budget) {
            free(best.ops);
            best = ops, found = 1, lo = mid + 1;
        } else {
            if (mid == 0) *need = peak;
            free(ops.ops);
            if (mid == 0) break;
            hi = mid - 1;
        }
    }
    if (!found) return vram__fail(VRAM_ERR_INFEASIBLE, "Revolve needs at least %llu bytes", (unsigned long long)*need);
    *out = best;
    return VRAM_OK;
}

/* The dynamic program is exact for sizes rounded up to slots; the rounding can cost it a
 * schedule that fits in exact bytes. So the fixed schedules that fit (store everything, every
 * segment count, Revolve) are replayed too, and the fastest of all is kept: "optimal" is never
 * slower than a baseline at the same budget. */
static vram_status_t keep_best_baseline(const vram__chain_t *c, uint64_t budget, vram__oplist_t *best) {
    double best_time;
    uint64_t peak;
    vram_status_t rc = replay_peak(c, best, &best_time, &peak);
    if (rc != VRAM_OK) return rc;
    for (size_t k = 0; k <= c->L; k++) {
        vram__oplist_t cand = {0};
        if (k == 0) {
            uint64_t need = 0;
            rc = plan_revolve(c, budget, &cand, &need);
            if (rc == VRAM_ERR_INFEASIBLE) continue;
            if (rc != VRAM_OK) return rc;
        } else {
            vram__sched_segments(c, k, &cand); /* k = 1 stores everything */
        }
        double time;
        rc = replay_peak(c, &cand, &time, &peak);
        if (rc != VRAM_OK) {
            free(cand.ops);
            return rc;
        }
        if (peak <= budget && time < best_time) {
            free(best->ops);
            *best = cand, best_time = time;
        } else {
            free(cand.ops);
        }
    }
    return VRAM_OK;
}

vram_status_t vram_ckpt_plan(const vram_ckpt_stage_t *stages, size_t count, const vram_ckpt_stage_t *loss, uint64_t budget,
                             vram_ckpt_algorithm_t algorithm, int segments, int slots, vram_ckpt_schedule_t **out,
                             uint64_t *min_budget) {
    if (!out) return vram__fail(VRAM_ERR_INVALID_ARG, "out is NULL");
    *out = NULL;
    if (slots == 0) slots = 500;
    if (slots < 1 || slots > 100000) return vram__fail(VRAM_ERR_INVALID_ARG, "slots must be 1..100000, got %d", slots);
    if ((unsigned)algorithm > VRAM_CKPT_NONE)
        return vram__fail(VRAM_ERR_INVALID_ARG, "unknown algorithm %d (allowed: optimal, revolve, sqrt, segments, none)",
                          (int)algorithm);
    vram__chain_t c;
    vram_status_t rc = vram__chain_make(stages, count, loss, &c);
    if (rc != VRAM_OK) return rc;
    if (algorithm == VRAM_CKPT_SEGMENTS && (segments < 1 || (size_t)segments > count)) {
        vram__chain_free(&c);
        return vram__fail(VRAM_ERR_INVALID_ARG, "segments must be 1..%zu (the number of stages), got %d", count, segments);
    }
    if (algorithm == VRAM_CKPT_OPTIMAL && budget == 0) {
        vram__chain_free(&c);
        return vram__fail(VRAM_ERR_INVALID_ARG, "the optimal planner needs a memory budget (bytes > 0)");
    }
    uint64_t least = 0, need = 0;
    vram__oplist_t ops = {0};
    rc = vram__least_memory(&c, &least, NULL);
    if (rc != VRAM_OK) goto done;
    switch (algorithm) {
    case VRAM_CKPT_NONE: vram__sched_none(&c, &ops); break;
    case VRAM_CKPT_SEGMENTS: vram__sched_segments(&c, (size_t)segments, &ops); break;
    case VRAM_CKPT_SQRT: {
        size_t k = (size_t)llround(sqrt((double)count));
        vram__sched_segments(&c, k ? k : 1, &ops);
        break;
    }
    case VRAM_CKPT_REVOLVE: rc = plan_revolve(&c, budget, &ops, &need); break;
    case VRAM_CKPT_OPTIMAL:
        if (budget < least) {
            need = least;
            rc = vram__fail(VRAM_ERR_INFEASIBLE, "budget %llu is below the least any schedule needs (%llu bytes)",
                            (unsigned long long)budget, (unsigned long long)least);
            break;
        }
        /* Rounding sizes up to slots can make a budget just above the least look too small:
         * refine the slots, and in the end fall back to the least-memory schedule itself. */
        for (int s = slots; s <= slots * 8; s *= 2) {
            free(ops.ops);
            ops = (vram__oplist_t){0};
            rc = vram__sched_optimal(&c, budget, s, &ops);
            if (rc != VRAM_ERR_INFEASIBLE) break;
        }
        if (rc == VRAM_ERR_INFEASIBLE) {
            free(ops.ops);
            ops = (vram__oplist_t){0};
            rc = vram__least_memory(&c, &least, &ops);
        }
        if (rc == VRAM_OK) rc = keep_best_baseline(&c, budget, &ops);
        break;
    }
    if (rc != VRAM_OK) goto done;
    double time;
    uint64_t peak;
    rc = replay_peak(&c, &ops, &time, &peak);
    if (rc != VRAM_OK) goto done;
    if (budget && peak > budget) {
        need = peak;
        rc = vram__fail(VRAM_ERR_INFEASIBLE, "this schedule needs %llu bytes, above the budget of %llu",
                        (unsigned long long)peak, (unsigned long long)budget);
        goto done;
    }
    vram_ckpt_schedule_t *s = malloc(sizeof *s);
    if (!s) {
        rc = vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for the schedule");
        goto done;
    }
    *s = (vram_ckpt_schedule_t){ops.ops, ops.n, time, peak};
    ops.ops = NULL;
    *out = s;
done:
    if (rc == VRAM_ERR_INFEASIBLE && min_budget) *min_budget = need ? need : least;
    free(ops.ops);
    vram__chain_free(&c);
    return rc;
}
