/* chain.c — chain construction, the op list, and the simulator that every planner's output
 * is replayed through (docs/checkpoint_model.md is the rule book). */
#include "chain.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

static vram_status_t check_stage(const vram_ckpt_stage_t *s, const char *what, size_t i) {
    if (!(s->fwd_time >= 0) || !(s->bwd_time >= 0) || isinf(s->fwd_time) || isinf(s->bwd_time))
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s %zu: times must be finite and >= 0", what, i);
    if (s->saved_bytes < s->input_bytes)
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s %zu: saved_bytes (%llu) must include the input (input_bytes %llu)",
                          what, i, (unsigned long long)s->saved_bytes, (unsigned long long)s->input_bytes);
    if (s->saved_bytes > (1ull << 56) || s->fwd_tmp > (1ull << 56) || s->bwd_tmp > (1ull << 56) ||
        s->fwd_all_tmp > (1ull << 56))
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s %zu: sizes above 2^56 bytes are absurd", what, i);
    return VRAM_OK;
}

static void put_stage(vram__chain_t *c, size_t i, const vram_ckpt_stage_t *s) {
    c->f[i] = s->fwd_time;
    c->b[i] = s->bwd_time;
    c->a[i] = s->input_bytes;
    c->tape[i] = s->saved_bytes - s->input_bytes;
    c->ft[i] = s->fwd_tmp;
    c->bt[i] = s->bwd_tmp;
    c->fat[i] = s->fwd_all_tmp;
}

vram_status_t vram__chain_make(const vram_ckpt_stage_t *s, size_t L, const vram_ckpt_stage_t *loss, vram__chain_t *c) {
    memset(c, 0, sizeof *c);
    if (L == 0 || !s) return vram__fail(VRAM_ERR_INVALID_ARG, "a chain needs at least one stage");
    if (L > 100000) return vram__fail(VRAM_ERR_INVALID_ARG, "a chain of %zu stages is too long (at most 100000)", L);
    vram_status_t rc;
    for (size_t i = 0; i < L; i++)
        if ((rc = check_stage(&s[i], "stage", i)) != VRAM_OK) return rc;
    /* (the loss is stage L; "loss L" in a message names it by that index) */
    if (loss && (rc = check_stage(loss, "loss, stage", L)) != VRAM_OK) return rc;
    c->L = L;
    c->f = calloc(L + 1, sizeof *c->f);
    c->b = calloc(L + 1, sizeof *c->b);
    c->a = calloc(L + 2, sizeof *c->a);
    c->tape = calloc(L + 1, sizeof *c->tape);
    c->ft = calloc(L + 1, sizeof *c->ft);
    c->bt = calloc(L + 1, sizeof *c->bt);
    c->fat = calloc(L + 1, sizeof *c->fat);
    if (!c->f || !c->b || !c->a || !c->tape || !c->ft || !c->bt || !c->fat) {
        vram__chain_free(c);
        return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for a chain of %zu stages", L);
    }
    for (size_t i = 0; i < L; i++) put_stage(c, i, &s[i]);
    if (loss) put_stage(c, L, loss);
    else c->a[L] = s[L - 1].input_bytes; /* a free loss; everything else zero */
    return VRAM_OK;
}

void vram__chain_free(vram__chain_t *c) {
    free(c->f), free(c->b), free(c->a), free(c->tape), free(c->ft), free(c->bt), free(c->fat);
    memset(c, 0, sizeof *c);
}

void vram__ops_push(vram__oplist_t *l, vram_ckpt_op_kind_t kind, size_t stage) {
    if (l->failed) return;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        vram_ckpt_op_t *ops = realloc(l->ops, cap * sizeof *ops);
        if (!ops) {
            l->failed = 1;
            return;
        }
        l->ops = ops, l->cap = cap;
    }
    l->ops[l->n++] = (vram_ckpt_op_t){(uint32_t)kind, (uint32_t)stage};
}

/* Simulator state per index k: which of x_k, tape_k, delta_k are present, and whether x_k is
 * held (checkpoint, or kept by FWD_ALL for its backward). */
enum { X = 1, TAPE = 2, DELTA = 4, HELD = 8 };

static const char *const kind_names[] = {"FWD_NOSAVE", "FWD_CHECK", "FWD_ALL", "LOSS", "BWD"};

vram_status_t vram__simulate(const vram__chain_t *c, const vram_ckpt_op_t *ops, size_t n, double *time_out,
                             uint64_t *peak_out) {
    size_t L = c->L;
    unsigned char *st = calloc(L + 2, 1);
    if (!st) return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory to simulate %zu stages", L);
    st[0] = X | HELD;                  /* the caller's input stays until BWD(0) */
    uint64_t cur = c->a[0], peak = cur; /* bytes present */
    double time = 0.0;
    size_t next_bwd = L; /* the loss (stage L) comes first, then L-1 .. 0 */
    vram_status_t rc = VRAM_OK;
#define BAD(...) do { rc = vram__fail(VRAM_ERR_INVALID_ARG, __VA_ARGS__); goto done; } while (0)
    for (size_t k = 0; k < n; k++) {
        size_t i = ops[k].stage;
        uint32_t kind = ops[k].kind;
        if (kind > VRAM_CKPT_BWD) BAD("op %zu: unknown kind %u", k, kind);
        if (i > L || (kind == VRAM_CKPT_LOSS) != (i == L))
            BAD("op %zu: %s(%zu) names no such stage (stages 0..%zu, LOSS is %zu)", k, kind_names[kind], i, L - 1, L);
        if (kind <= VRAM_CKPT_FWD_ALL) {
            if (!(st[i] & X)) BAD("op %zu: %s(%zu) needs x_%zu, which is not in memory", k, kind_names[kind], i, i);
            if (st[i] & DELTA) BAD("op %zu: %s(%zu) after BWD(%zu)", k, kind_names[kind], i, i);
            uint64_t during = cur + c->a[i + 1] + (kind == VRAM_CKPT_FWD_ALL ? c->tape[i] + c->fat[i] : c->ft[i]);
            if (during > peak) peak = during;
            time += c->f[i];
            if (kind == VRAM_CKPT_FWD_ALL) {
                if (st[i] & TAPE) BAD("op %zu: FWD_ALL(%zu) twice before BWD(%zu)", k, i, i);
                st[i] |= TAPE | HELD;
                cur += c->tape[i];
            } else if (kind == VRAM_CKPT_FWD_CHECK) {
                st[i] |= HELD;
            } else if (!(st[i] & HELD)) {
                st[i] &= (unsigned char)~X;
                cur -= c->a[i];
            }
            /* The output is kept only while its own backward is still to come. */
            if (!(st[i + 1] & DELTA) && !(st[i + 1] & X) && next_bwd >= i + 1) {
                st[i + 1] |= X;
                cur += c->a[i + 1];
            }
        } else {
            /* LOSS is FWD_ALL(L) then BWD(L), back to back (the user's loss and its backward);
             * BWD(i) needs tape_i, x_i and delta_{i+1}. */
            if (kind == VRAM_CKPT_LOSS) {
                if (!(st[L] & X)) BAD("op %zu: LOSS needs x_%zu, which is not in memory", k, L);
                if (next_bwd != L) BAD("op %zu: LOSS twice", k);
                uint64_t fwd = cur + c->tape[L] + c->fat[L]; /* its output, a scalar, has size 0 */
                if (fwd > peak) peak = fwd;
                cur += c->tape[L];
                time += c->f[L] + c->b[L];
            } else {
                if (i != next_bwd) BAD("op %zu: BWD(%zu) out of order (expected %s%zu)", k, i,
                                       next_bwd == L ? "LOSS before BWD " : "BWD ", next_bwd == L ? L - 1 : next_bwd);
                if (!(st[i] & TAPE)) BAD("op %zu: BWD(%zu) without FWD_ALL(%zu) since", k, i, i);
                time += c->b[i];
            }
            uint64_t during = cur + c->a[i] + c->bt[i];
            if (during > peak) peak = during;
            cur += c->a[i];                       /* delta_i */
            cur -= c->a[i] + c->tape[i];          /* x_i and tape_i */
            if (i < L) cur -= c->a[i + 1];        /* delta_{i+1} */
            st[i] = DELTA;
            if (i < L) st[i + 1] &= (unsigned char)~DELTA;
            next_bwd = i - 1; /* wraps past 0: nothing may follow BWD(0) but is checked below */
        }
    }
    if (!(st[0] & DELTA)) BAD("the schedule ends before BWD(0)");
    *time_out = time;
    *peak_out = peak;
done:
#undef BAD
    free(st);
    return rc;
}
