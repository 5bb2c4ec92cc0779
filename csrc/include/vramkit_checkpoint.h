/* vramkit_checkpoint.h — activation-checkpoint planning for a chain of stages.
 * Part of vramkit's public C API; vramkit.h includes it (and it includes vramkit.h for the
 * status codes and export macros), so either can be included first. */
#ifndef VRAMKIT_CHECKPOINT_H
#define VRAMKIT_CHECKPOINT_H

#include "vramkit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * Checkpoint: activation-checkpoint schedules for a chain of stages under a memory budget
 *
 * The execution model (docs/checkpoint_model.md): stage i reads x_i (input_bytes) and
 * writes x_{i+1}; its backward needs saved_bytes (its input plus what autograd saves). The
 * loss is stage L: it reads x_L (its input_bytes) and keeps its own saved tensors until its
 * backward, which follows its forward at once. A schedule is a sequence of
 *   FWD_NOSAVE(i)  forward under no_grad, x_i dropped afterwards (unless kept below);
 *   FWD_CHECK(i)   forward under no_grad, x_i kept as a checkpoint until BWD(i);
 *   FWD_ALL(i)     forward with autograd, keeping what BWD(i) needs;
 *   LOSS           the loss and its gradient (its forward and backward, back to back);
 *   BWD(i)         backward of stage i (requires a FWD_ALL(i) since the last BWD(i+1)).
 * The simulator replays a schedule and returns its time and exact peak bytes; every planner's
 * output is replayed by it, so predicted figures never come from the planner's own estimate.
 * ====================================================================================== */

typedef struct vram_ckpt_stage {
    double fwd_time, bwd_time; /* any unit; >= 0 */
    uint64_t input_bytes;      /* x_i */
    uint64_t saved_bytes;      /* what the backward needs, input included: >= input_bytes */
    uint64_t fwd_tmp, bwd_tmp; /* transient memory during a forward that saves nothing / the backward */
    uint64_t fwd_all_tmp;      /* transient memory during a saving forward (FWD_ALL), beyond what it
                                * saves: what a no-grad forward frees as it goes is often kept then */
} vram_ckpt_stage_t;

typedef enum vram_ckpt_op_kind {
    VRAM_CKPT_FWD_NOSAVE = 0,
    VRAM_CKPT_FWD_CHECK = 1,
    VRAM_CKPT_FWD_ALL = 2,
    VRAM_CKPT_LOSS = 3,
    VRAM_CKPT_BWD = 4,
} vram_ckpt_op_kind_t;

typedef struct vram_ckpt_op {
    uint32_t kind;  /* vram_ckpt_op_kind_t */
    uint32_t stage; /* L for LOSS */
} vram_ckpt_op_t;

typedef enum vram_ckpt_algorithm {
    VRAM_CKPT_OPTIMAL = 0,  /* the persistent dynamic program: least time within the budget */
    VRAM_CKPT_REVOLVE = 1,  /* binomial checkpointing with as many snapshots as fit (homogeneous) */
    VRAM_CKPT_SQRT = 2,     /* round(sqrt(L)) equal segments (Chen et al.) */
    VRAM_CKPT_SEGMENTS = 3, /* `segments` equal segments, the last one stored: checkpoint_sequential */
    VRAM_CKPT_NONE = 4,     /* store everything */
} vram_ckpt_algorithm_t;

typedef struct vram_ckpt_schedule {
    vram_ckpt_op_t *ops;
    size_t num_ops;
    double predicted_time;   /* sum of the op times */
    uint64_t predicted_peak; /* exact peak bytes, x_0 included */
} vram_ckpt_schedule_t;

/* Plan a schedule for `count` stages (count >= 1) followed by a loss. `loss` is the loss as
 * one more stage: input_bytes is the size of the chain's output (the loss input, and its
 * gradient), saved_bytes what the loss keeps for its backward (input included), fwd_tmp and
 * bwd_tmp its transients, and its times; its output is a scalar (size 0), and its forward and
 * backward run back to back (the LOSS op). NULL: a loss that costs nothing and reads an output
 * the size of the last stage's input.
 * budget: bytes (x_0 included); 0 means no limit for the fixed algorithms (SQRT, SEGMENTS,
 * NONE, and REVOLVE with as many snapshots as stages). slots: the memory discretisation of
 * OPTIMAL (sizes are rounded up to budget/slots, so a plan never exceeds the budget);
 * 0 = 500. segments: for SEGMENTS (1..count). VRAM_ERR_INFEASIBLE when no schedule of the
 * algorithm fits; the message and *min_budget (if not NULL) give the least budget that works
 * for it. */
VRAM_API VRAM_NODISCARD vram_status_t vram_ckpt_plan(const vram_ckpt_stage_t *stages, size_t count,
                                                    const vram_ckpt_stage_t *loss, uint64_t budget,
                                                    vram_ckpt_algorithm_t algorithm, int segments, int slots,
                                                    vram_ckpt_schedule_t **out, uint64_t *min_budget);
VRAM_API void vram_ckpt_schedule_free(vram_ckpt_schedule_t *schedule);
/* Replay a schedule: VRAM_ERR_INVALID_ARG (naming the op) if it breaks a rule. */
VRAM_API VRAM_NODISCARD vram_status_t vram_ckpt_simulate(const vram_ckpt_stage_t *stages, size_t count,
                                                        const vram_ckpt_stage_t *loss, const vram_ckpt_op_t *ops,
                                                        size_t num_ops, double *time, uint64_t *peak);
/* The least budget any (persistent) schedule needs, exact in bytes. */
VRAM_API VRAM_NODISCARD vram_status_t vram_ckpt_min_budget(const vram_ckpt_stage_t *stages, size_t count,
                                                          const vram_ckpt_stage_t *loss, uint64_t *out);


#ifdef __cplusplus
}
#endif
#endif /* VRAMKIT_CHECKPOINT_H */
