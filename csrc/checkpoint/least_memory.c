/* least_memory.c — the least memory any persistent schedule needs, and a schedule that needs
 * exactly that. It is the optimal program with time replaced by peak memory and without the
 * memory axis: Need(i, l) is the least m for which Opt(i, l, m) is finite, in exact bytes, so
 * it costs O(L^3) time and O(L^2) memory whatever the sizes. ("Keep only x_0 and recompute"
 * is not always least: recomputing a stage's forward while the gradient arriving from above is
 * held can cost more than keeping its saved tensors from the first pass.) */
#include <stdlib.h>

#include "../util/error.h"
#include "chain.h"

#define WHAT_CHAIN (-1)

static inline uint64_t max2(uint64_t x, uint64_t y) { return x > y ? x : y; }

typedef struct need_table {
    size_t L;
    uint64_t *need; /* (L+1) x (L+1), [i][l] for i <= l */
    int32_t *what;
} need_table_t;

#define AT(t, i, l) ((i) * ((t)->L + 1) + (l))

static void rebuild(const vram__chain_t *c, const need_table_t *t, size_t i, size_t l, vram__oplist_t *out) {
    if (i == l) {
        if (i == c->L) {
            vram__ops_push(out, VRAM_CKPT_LOSS, i);
        } else {
            vram__ops_push(out, VRAM_CKPT_FWD_ALL, i);
            vram__ops_push(out, VRAM_CKPT_BWD, i);
        }
        return;
    }
    int32_t w = t->what[AT(t, i, l)];
    if (w == WHAT_CHAIN) {
        vram__ops_push(out, VRAM_CKPT_FWD_ALL, i);
        rebuild(c, t, i + 1, l, out);
        vram__ops_push(out, VRAM_CKPT_BWD, i);
    } else {
        size_t j = (size_t)w;
        vram__ops_push(out, VRAM_CKPT_FWD_CHECK, i);
        for (size_t k = i + 1; k < j; k++) vram__ops_push(out, VRAM_CKPT_FWD_NOSAVE, k);
        rebuild(c, t, j, l, out);
        rebuild(c, t, i, j - 1, out);
    }
}

vram_status_t vram__least_memory(const vram__chain_t *c, uint64_t *least, vram__oplist_t *out) {
    size_t L = c->L;
    need_table_t t = {L, malloc((L + 1) * (L + 1) * sizeof(uint64_t)), malloc((L + 1) * (L + 1) * sizeof(int32_t))};
    if (!t.need || !t.what) {
        free(t.need), free(t.what);
        return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for a %zu-stage table", L);
    }
    const uint64_t *a = c->a;
    for (size_t d = 0; d <= L; d++)
        for (size_t i = 0; i + d <= L; i++) {
            size_t l = i + d;
            uint64_t bwd = a[i + 1] + c->tape[i] + a[i] + c->bt[i];
            uint64_t best;
            int32_t what = WHAT_CHAIN;
            if (d == 0) {
                best = max2(2 * a[i + 1] + c->tape[i] + c->fat[i], bwd);
            } else {
                best = max2(max2(a[l + 1] + a[i + 1] + c->tape[i] + c->fat[i], bwd),
                            c->tape[i] + a[i + 1] + t.need[AT(&t, i + 1, l)]);
                uint64_t phase = a[l + 1] + a[i + 1] + c->ft[i];
                for (size_t j = i + 1; j <= l; j++) {
                    uint64_t v = max2(max2(phase, a[j] + t.need[AT(&t, j, l)]), t.need[AT(&t, i, j - 1)]);
                    if (v < best) best = v, what = (int32_t)j;
                    phase = max2(phase, a[l + 1] + a[j] + a[j + 1] + c->ft[j]);
                }
            }
            t.need[AT(&t, i, l)] = best;
            t.what[AT(&t, i, l)] = what;
        }
    *least = a[0] + t.need[AT(&t, 0, L)];
    if (out) rebuild(c, &t, 0, L, out);
    free(t.need), free(t.what);
    return VRAM_OK;
}
