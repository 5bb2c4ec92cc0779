/* optimal.c — the persistent dynamic program (rotor's, on vramkit's execution model; the
 * recurrence is written out in docs/checkpoint_model.md).
 *
 * Opt(i, l, m): least time to turn "x_i stored (outside m), delta_{l+1} present (inside m)"
 * into "delta_i in place of x_i" with m memory slots. Either
 *   (a) checkpoint: forward i..j-1 without saving, keep x_j, solve [j..l] in m - a_j, then
 *       [i..j-1] in m (delta_j has taken x_j's place), or
 *   (b) chain: forward i saving everything, solve [i+1..l] in m - tape_i - a_{i+1}, then
 *       backward i.
 * Sizes are rounded up to slots of budget/slots bytes, so a plan never exceeds the budget.
 * Time O(M L^3), memory O(M L^2): one double and one int16 per (i <= l, m). */
#include <math.h>
#include <stdlib.h>

#include "../util/error.h"
#include "chain.h"

#define WHAT_CHAIN (-1)
#define WHAT_NONE (-2)

typedef struct table {
    size_t L, M; /* stages 0..L (L is the loss), memory 0..M slots */
    double *f, *b;
    int64_t *a, *tape, *ft, *bt, *fat; /* in slots */
    double *opt;
    int16_t *what; /* j for (a), WHAT_CHAIN for (b), WHAT_NONE when infeasible */
} table_t;

static inline size_t cell(const table_t *t, size_t i, size_t l, int64_t m) {
    return ((l * (l + 1)) / 2 + i) * (t->M + 1) + (size_t)m;
}

/* Each (i, l) row is filled for all m at once, option by option: for a fixed j the two table
 * rows it reads are walked in m order, so the inner loop streams through memory (and
 * vectorises) instead of jumping between rows for every m. */
static void fill(table_t *t) {
    const int64_t M = (int64_t)t->M;
    const int64_t *a = t->a;
    for (size_t d = 0; d <= t->L; d++)
        for (size_t i = 0; i + d <= t->L; i++) {
            size_t l = i + d;
            double *best = &t->opt[cell(t, i, l, 0)];
            int16_t *what = &t->what[cell(t, i, l, 0)];
            for (int64_t m = 0; m <= M; m++) best[m] = INFINITY, what[m] = WHAT_NONE;
            int64_t bwd_need = a[i + 1] + t->tape[i] + a[i] + t->bt[i];
            if (d == 0) {
                int64_t need = 2 * a[i + 1] + t->tape[i] + t->fat[i];
                if (bwd_need > need) need = bwd_need;
                for (int64_t m = need; m <= M; m++) best[m] = t->f[i] + t->b[i], what[m] = WHAT_CHAIN;
                continue;
            }
            /* (b) chain: forward i keeping everything, solve [i+1..l], backward i */
            int64_t keep = t->tape[i] + a[i + 1];
            int64_t from = a[l + 1] + keep + t->fat[i];
            if (bwd_need > from) from = bwd_need;
            if (keep > from) from = keep;
            const double *sub = &t->opt[cell(t, i + 1, l, 0)];
            double fb = t->f[i] + t->b[i];
            for (int64_t m = from; m <= M; m++) {
                double v = fb + sub[m - keep];
                if (v < best[m]) best[m] = v, what[m] = WHAT_CHAIN;
            }
            /* (a) checkpoint at j: forward i..j-1 without saving, keep x_j */
            int64_t phase = a[l + 1] + a[i + 1] + t->ft[i];
            double sumf = t->f[i];
            for (size_t j = i + 1; j <= l; j++) {
                int64_t lo = phase > a[j] ? phase : a[j];
                const double *right = &t->opt[cell(t, j, l, 0)];    /* [j..l] in m - a_j */
                const double *left = &t->opt[cell(t, i, j - 1, 0)]; /* [i..j-1] in m */
                int64_t aj = a[j];
                for (int64_t m = lo; m <= M; m++) {
                    double v = sumf + right[m - aj] + left[m];
                    if (v < best[m]) best[m] = v, what[m] = (int16_t)j;
                }
                int64_t step = a[l + 1] + a[j] + a[j + 1] + t->ft[j];
                if (step > phase) phase = step;
                sumf += t->f[j];
            }
        }
}

static void rebuild(const table_t *t, size_t i, size_t l, int64_t m, vram__oplist_t *out) {
    int16_t w = t->what[cell(t, i, l, m)];
    if (i == l) {
        if (i == t->L) {
            vram__ops_push(out, VRAM_CKPT_LOSS, i);
        } else {
            vram__ops_push(out, VRAM_CKPT_FWD_ALL, i);
            vram__ops_push(out, VRAM_CKPT_BWD, i);
        }
    } else if (w == WHAT_CHAIN) {
        vram__ops_push(out, VRAM_CKPT_FWD_ALL, i);
        rebuild(t, i + 1, l, m - t->tape[i] - t->a[i + 1], out);
        vram__ops_push(out, VRAM_CKPT_BWD, i);
    } else {
        size_t j = (size_t)w;
        vram__ops_push(out, VRAM_CKPT_FWD_CHECK, i);
        for (size_t k = i + 1; k < j; k++) vram__ops_push(out, VRAM_CKPT_FWD_NOSAVE, k);
        rebuild(t, j, l, m - t->a[j], out);
        rebuild(t, i, j - 1, m, out);
    }
}

static int64_t slots_of(uint64_t bytes, uint64_t unit) { return (int64_t)((bytes + unit - 1) / unit); }

vram_status_t vram__sched_optimal(const vram__chain_t *c, uint64_t budget, int slots, vram__oplist_t *out) {
    if (c->L > 30000) return vram__fail(VRAM_ERR_INVALID_ARG, "optimal planning supports at most 30000 stages");
    uint64_t unit = budget / (uint64_t)slots;
    if (unit == 0) unit = 1;
    table_t t = {.L = c->L, .M = (size_t)(budget / unit), .f = c->f, .b = c->b};
    size_t n = c->L + 2, pairs = (c->L + 1) * (c->L + 2) / 2;
    t.a = malloc(n * sizeof *t.a);
    t.tape = malloc(n * sizeof *t.tape);
    t.ft = malloc(n * sizeof *t.ft);
    t.bt = malloc(n * sizeof *t.bt);
    t.fat = malloc(n * sizeof *t.fat);
    t.opt = malloc(pairs * (t.M + 1) * sizeof *t.opt);
    t.what = malloc(pairs * (t.M + 1) * sizeof *t.what);
    vram_status_t rc = VRAM_OK;
    if (!t.a || !t.tape || !t.ft || !t.bt || !t.fat || !t.opt || !t.what) {
        rc = vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for the planning table (%zu stages x %zu slots)", c->L,
                        t.M);
        goto done;
    }
    for (size_t k = 0; k < n; k++) {
        t.a[k] = slots_of(c->a[k], unit);
        t.tape[k] = k <= c->L ? slots_of(c->tape[k], unit) : 0;
        t.ft[k] = k <= c->L ? slots_of(c->ft[k], unit) : 0;
        t.bt[k] = k <= c->L ? slots_of(c->bt[k], unit) : 0;
        t.fat[k] = k <= c->L ? slots_of(c->fat[k], unit) : 0;
    }
    int64_t top = (int64_t)t.M - t.a[0];
    if (top < 0) {
        rc = vram__fail(VRAM_ERR_INFEASIBLE, "the input alone exceeds the budget");
        goto done;
    }
    fill(&t);
    if (isinf(t.opt[cell(&t, 0, c->L, top)])) {
        rc = vram__fail(VRAM_ERR_INFEASIBLE, "no persistent schedule fits %llu bytes at %d slots",
                        (unsigned long long)budget, slots);
        goto done;
    }
    rebuild(&t, 0, c->L, top, out);
done:
    free(t.a), free(t.tape), free(t.ft), free(t.bt), free(t.fat), free(t.opt), free(t.what);
    return rc;
}
