/* baselines.c — the fixed schedules: store everything, checkpoint_sequential's equal segments
 * (and Chen's sqrt(L) of them), and Revolve's binomial reversal for a given number of
 * snapshots. */
#include <stdlib.h>

#include "../util/error.h"
#include "chain.h"

void vram__sched_none(const vram__chain_t *c, vram__oplist_t *out) {
    for (size_t i = 0; i < c->L; i++) vram__ops_push(out, VRAM_CKPT_FWD_ALL, i);
    vram__ops_push(out, VRAM_CKPT_LOSS, c->L);
    for (size_t i = c->L; i-- > 0;) vram__ops_push(out, VRAM_CKPT_BWD, i);
}

/* torch.utils.checkpoint.checkpoint_sequential: segment_size = L // segments; the first
 * segments-1 segments run under checkpoint (only their input kept), the rest runs normally. */
void vram__sched_segments(const vram__chain_t *c, size_t segments, vram__oplist_t *out) {
    size_t L = c->L, size = L / segments, stored_from = size * (segments - 1);
    for (size_t s = 0; s + 1 < segments; s++) {
        vram__ops_push(out, VRAM_CKPT_FWD_CHECK, s * size);
        for (size_t i = s * size + 1; i < (s + 1) * size; i++) vram__ops_push(out, VRAM_CKPT_FWD_NOSAVE, i);
    }
    for (size_t i = stored_from; i < L; i++) vram__ops_push(out, VRAM_CKPT_FWD_ALL, i);
    vram__ops_push(out, VRAM_CKPT_LOSS, L);
    for (size_t i = L; i-- > stored_from;) vram__ops_push(out, VRAM_CKPT_BWD, i);
    for (size_t s = segments - 1; s-- > 0;) {
        for (size_t i = s * size; i < (s + 1) * size; i++) vram__ops_push(out, VRAM_CKPT_FWD_ALL, i);
        for (size_t i = (s + 1) * size; i-- > s * size;) vram__ops_push(out, VRAM_CKPT_BWD, i);
    }
}

/* Revolve. F[l][s] = least forward advances (taping forwards not counted) to reverse l steps
 * from a stored state with s further snapshots: F[1][s] = 0, F[l][0] = l(l-1)/2 and
 * F[l][s] = min_j j + F[l-j][s-1] + F[j][s]; Griewank and Walther's binomial formula gives
 * the same minimum, which the tests check. Here the "steps" are the stages 0..L-1, and the
 * loss rides along with the last one. */
typedef struct revolve {
    size_t L, S;
    unsigned long long *F; /* (L+1) x (S+1) */
    uint32_t *J;           /* the minimising j */
} revolve_t;

#define AT(r, l, s) ((l) * ((r)->S + 1) + (s))

static void emit(const revolve_t *r, size_t start, size_t l, size_t s, vram__oplist_t *out, size_t L) {
    if (l == 1) {
        vram__ops_push(out, VRAM_CKPT_FWD_ALL, start);
        if (start + 1 == L) vram__ops_push(out, VRAM_CKPT_LOSS, L);
        vram__ops_push(out, VRAM_CKPT_BWD, start);
        return;
    }
    size_t j = r->J[AT(r, l, s)];
    vram__ops_push(out, VRAM_CKPT_FWD_CHECK, start);
    for (size_t i = start + 1; i < start + j; i++) vram__ops_push(out, VRAM_CKPT_FWD_NOSAVE, i);
    emit(r, start + j, l - j, s ? s - 1 : 0, out, L);
    emit(r, start, j, s, out, L);
}

vram_status_t vram__sched_revolve(const vram__chain_t *c, size_t snaps, vram__oplist_t *out) {
    size_t L = c->L, S = snaps < L ? snaps : L;
    revolve_t r = {L, S, calloc((L + 1) * (S + 1), sizeof(unsigned long long)), calloc((L + 1) * (S + 1), sizeof(uint32_t))};
    if (!r.F || !r.J) {
        free(r.F), free(r.J);
        return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for Revolve tables (%zu x %zu)", L, S);
    }
    for (size_t l = 2; l <= L; l++)
        for (size_t s = 0; s <= S; s++) {
            unsigned long long best = ~0ull;
            uint32_t bj = 1;
            for (size_t j = 1; j < l; j++) {
                /* With no snapshot left the only choice is to advance all the way (j = l-1). */
                if (s == 0 && j != l - 1) continue;
                unsigned long long v = j + r.F[AT(&r, l - j, s ? s - 1 : 0)] + r.F[AT(&r, j, s)];
                if (v < best) best = v, bj = (uint32_t)j;
            }
            r.F[AT(&r, l, s)] = best;
            r.J[AT(&r, l, s)] = bj;
        }
    emit(&r, 0, L, S, out, L);
    free(r.F), free(r.J);
    return VRAM_OK;
}
