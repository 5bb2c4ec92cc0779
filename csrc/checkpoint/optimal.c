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
 * Time O(M L^3), memory O(M L^2): one float and one int16 per (i <= l, m). */
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
    float *opt; /* float halves the table's bytes; the loop is bound by memory traffic */
    int16_t *what; /* j for (a), WHAT_CHAIN for (b), WHAT_NONE when infeasible */
    int64_t *first; /* per (i, l): the least m with a finite Opt (M + 1 if none) */
} table_t;

static inline size_t pair(size_t i, size_t l) { return (l * (l + 1)) / 2 + i; }

static inline size_t cell(const table_t *t, size_t i, size_t l, int64_t m) {
    return pair(i, l) * (t->M + 1) + (size_t)m;
}

/* The inner loop of every option: best[m] = min(best[m], add + right[m] + left[m]) over a run
 * of m, noting the option in what[m]. Written without branches on restrict pointers so it
 * vectorises; it is most of the planner's time. With GCC on x86-64 an AVX2 copy (8 floats and
 * their int16 tags a step) is chosen at run time with __builtin_cpu_supports; no ifunc, which
 * sanitizer runtimes do not survive. */
#define VRAM__RELAX_BODY                                                                  \
    for (int64_t m = 0; m < n; m++) {                                                     \
        float v = add + right[m] + (left ? left[m] : 0.0f);                               \
        int better = v < best[m];                                                         \
        best[m] = better ? v : best[m];                                                   \
        what[m] = better ? tag : what[m];                                                 \
    }
#define VRAM__RELAX_ARGS                                                                  \
    float *restrict best, int16_t *restrict what, const float *restrict right, const float *restrict left, \
        float add, int16_t tag, int64_t n

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define VRAM__RELAX_DISPATCH 1
__attribute__((optimize("O3"))) static void relax_portable(VRAM__RELAX_ARGS) { VRAM__RELAX_BODY }
__attribute__((target("avx2"), optimize("O3"))) static void relax_avx2(VRAM__RELAX_ARGS) { VRAM__RELAX_BODY }
#else
static void relax_portable(VRAM__RELAX_ARGS) { VRAM__RELAX_BODY }
#endif

typedef void (*relax_fn)(VRAM__RELAX_ARGS);

static relax_fn pick_relax(void) {
#ifdef VRAM__RELAX_DISPATCH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2")) return relax_avx2;
#endif
    return relax_portable;
}

static inline int64_t max64(int64_t x, int64_t y) { return x > y ? x : y; }

/* Each (i, l) row is filled for all m at once, option by option: for a fixed j the two table
 * rows it reads are walked in m order, so the inner loop streams through memory and
 * vectorises. Two bounds cut the work: nothing below a sub-problem's least memory (`first`)
 * can be finite, and from the least m at which storing everything in [i..l] fits, the time is
 * the sum of its forwards and backwards, which no schedule beats. */
static void fill(table_t *t) {
    const relax_fn relax = pick_relax();
    const int64_t M = (int64_t)t->M;
    const int64_t *a = t->a;
    int64_t *store_all = malloc(((t->L + 1) * (t->L + 2) / 2) * sizeof *store_all);
    double *sum_fb = malloc(((t->L + 1) * (t->L + 2) / 2) * sizeof *sum_fb);
    if (!store_all || !sum_fb) { /* the bound is an optimisation: without memory for it, go without */
        free(store_all), free(sum_fb);
        store_all = NULL, sum_fb = NULL;
    }
    for (size_t d = 0; d <= t->L; d++)
        for (size_t i = 0; i + d <= t->L; i++) {
            size_t l = i + d, p = pair(i, l);
            float *best = &t->opt[cell(t, i, l, 0)];
            int16_t *what = &t->what[cell(t, i, l, 0)];
            for (int64_t m = 0; m <= M; m++) best[m] = INFINITY, what[m] = WHAT_NONE;
            int64_t bwd_need = a[i + 1] + t->tape[i] + a[i] + t->bt[i];
            double fb = t->f[i] + t->b[i];
            if (d == 0) {
                int64_t need = max64(2 * a[i + 1] + t->tape[i] + t->fat[i], bwd_need);
                for (int64_t m = need; m <= M; m++) best[m] = (float)fb, what[m] = WHAT_CHAIN;
                t->first[p] = need > M ? M + 1 : need;
                if (store_all) store_all[p] = need, sum_fb[p] = fb;
                continue;
            }
            /* (b) chain: forward i keeping everything, solve [i+1..l], backward i */
            int64_t keep = t->tape[i] + a[i + 1];
            int64_t from = max64(max64(a[l + 1] + keep + t->fat[i], bwd_need), keep);
            /* storing everything fits from here on, at the least possible time */
            int64_t all = store_all ? max64(from, keep + store_all[pair(i + 1, l)]) : M + 1;
            int64_t top = all <= M ? all - 1 : M; /* the options run over m <= top */
            if (store_all) store_all[p] = all, sum_fb[p] = fb + sum_fb[pair(i + 1, l)];
            int64_t lo = max64(from, keep + t->first[pair(i + 1, l)]);
            if (lo <= top)
                relax(best + lo, what + lo, &t->opt[cell(t, i + 1, l, 0)] + (lo - keep), NULL, (float)fb, WHAT_CHAIN,
                      top - lo + 1);
            /* (a) checkpoint at j: forward i..j-1 without saving, keep x_j */
            int64_t phase = a[l + 1] + a[i + 1] + t->ft[i];
            double sumf = t->f[i];
            for (size_t j = i + 1; j <= l; j++) {
                int64_t aj = a[j];
                lo = max64(max64(phase, aj), max64(aj + t->first[pair(j, l)], t->first[pair(i, j - 1)]));
                if (lo <= top) {
                        const float *right = &t->opt[cell(t, j, l, 0)] + (lo - aj); /* [j..l] in m - a_j */
                    const float *left = &t->opt[cell(t, i, j - 1, 0)] + lo;     /* [i..j-1] in m */
                    relax(best + lo, what + lo, right, left, (float)sumf, (int16_t)j, top - lo + 1);
                }
                phase = max64(phase, a[l + 1] + aj + a[j + 1] + t->ft[j]);
                sumf += t->f[j];
            }
            if (store_all && all <= M) {
                float v = (float)sum_fb[p];
                for (int64_t m = all; m <= M; m++) best[m] = v, what[m] = WHAT_CHAIN;
            }
            int64_t f0 = 0;
            while (f0 <= M && isinf(best[f0])) f0++;
            t->first[p] = f0;
        }
    free(store_all);
    free(sum_fb);
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
    t.first = malloc(pairs * sizeof *t.first);
    vram_status_t rc = VRAM_OK;
    if (!t.a || !t.tape || !t.ft || !t.bt || !t.fat || !t.opt || !t.what || !t.first) {
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
    free(t.a), free(t.tape), free(t.ft), free(t.bt), free(t.fat), free(t.opt), free(t.what), free(t.first);
    return rc;
}
