/* chain.h — the checkpoint planners' shared view of a chain: per-stage sizes with the loss as
 * stage L (all zero but its input), and a growable op list. */
#ifndef VRAM_CHECKPOINT_CHAIN_H
#define VRAM_CHECKPOINT_CHAIN_H

#include <stddef.h>
#include <stdint.h>

#include "vramkit.h"

/* Index k = 0..L+1 (L = number of stages; stage L is the loss, a[L+1] = 0: its output is a
 * scalar). */
typedef struct vram__chain {
    size_t L;
    double *f, *b;          /* L+1 */
    uint64_t *a;            /* L+2: a[k] = bytes of x_k (and of its gradient) */
    uint64_t *tape, *ft, *bt, *fat; /* L+1; fat: FWD_ALL's transient */
} vram__chain_t;

/* Validates the stages and the loss (saved >= input, finite non-negative times); a NULL loss
 * costs nothing and reads an output the size of the last stage's input. */
vram_status_t vram__chain_make(const vram_ckpt_stage_t *stages, size_t count, const vram_ckpt_stage_t *loss,
                               vram__chain_t *out);
void vram__chain_free(vram__chain_t *c);

typedef struct vram__oplist {
    vram_ckpt_op_t *ops;
    size_t n, cap;
    int failed; /* out of host memory */
} vram__oplist_t;

void vram__ops_push(vram__oplist_t *l, vram_ckpt_op_kind_t kind, size_t stage);

/* Replay on a chain; VRAM_ERR_INVALID_ARG naming the op on a broken rule. */
vram_status_t vram__simulate(const vram__chain_t *c, const vram_ckpt_op_t *ops, size_t n, double *time,
                             uint64_t *peak);

/* Schedules of the fixed algorithms. */
void vram__sched_none(const vram__chain_t *c, vram__oplist_t *out);
void vram__sched_segments(const vram__chain_t *c, size_t segments, vram__oplist_t *out);
/* Binomial (Revolve) reversal with `snaps` checkpoints besides x_0. */
vram_status_t vram__sched_revolve(const vram__chain_t *c, size_t snaps, vram__oplist_t *out);
/* The least budget of any persistent schedule, exact, and (if out) a schedule that needs it. */
vram_status_t vram__least_memory(const vram__chain_t *c, uint64_t *least, vram__oplist_t *out);
/* The persistent dynamic program; VRAM_ERR_INFEASIBLE if nothing fits in budget. */
vram_status_t vram__sched_optimal(const vram__chain_t *c, uint64_t budget, int slots, vram__oplist_t *out);

#endif
