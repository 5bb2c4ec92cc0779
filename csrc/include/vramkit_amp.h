/* vramkit_amp.h — fused loss scaling for mixed-precision training.
 * Part of vramkit's public C API; vramkit.h includes it (and it includes vramkit.h for the
 * status codes and export macros), so either can be included first. */
#ifndef VRAMKIT_AMP_H
#define VRAMKIT_AMP_H

#include "vramkit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * Kernels: fused loss scaling for mixed-precision training
 *
 * Gradients of a loss multiplied by `scale` are multiplied back by inv_scale = 1/scale in
 * one pass that also detects inf/NaN (and optionally sums squares for gradient clipping).
 * Arithmetic follows PyTorch's _amp_foreach_non_finite_check_and_unscale_: each element is
 * widened to float32 (float64 tensors stay float64), multiplied, and rounded to nearest-even
 * back into its storage type.
 * ====================================================================================== */

typedef enum vram_dtype {
    VRAM_FLOAT32 = 0,
    VRAM_FLOAT16 = 1,  /* IEEE binary16 */
    VRAM_BFLOAT16 = 2, /* the upper half of a float32 */
    VRAM_FLOAT64 = 3,
} vram_dtype_t;

/* One dense tensor: `numel` elements of `dtype` from `data`, which must be aligned to the
 * element size (any other alignment is fine: misaligned starts take unaligned loads). */
typedef struct vram_tensor {
    void *data;
    int64_t numel;
    vram_dtype_t dtype;
} vram_tensor_t;

/* Bytes per element of a dtype (0 for an unknown value). */
VRAM_API size_t vram_dtype_size(vram_dtype_t dtype);

/* CPU, in place, over every tensor of the list (any mix of dtypes) in one pass:
 *   x = round_to_storage((float)x * inv_scale)   -- skipped (nothing written) if inv_scale == 1
 * *found_inf is set to 1.0f if any input or result is inf/NaN (so a finite gradient that
 * overflows when unscaled by a large inv_scale counts), and left alone otherwise: the caller
 * zeroes it, as with PyTorch. With sumsq != NULL, *sumsq receives the sum of squares of the
 * results (float32 within tiles of 1024 elements, float64 across tiles, in list order, so it
 * does not depend on the thread count). The list is split across vram_get_num_threads()
 * threads when it is large. Inf/NaN tests work on the raw exponent bits. A NaN stays NaN,
 * but which NaN (its payload bits) is unspecified when inv_scale itself is NaN, as in PyTorch. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_unscale_check(const vram_tensor_t *tensors, size_t count,
                                                            float inv_scale, float *found_inf, double *sumsq);
/* CPU, in place: x = round_to_storage((float)x * factor); nothing is written if factor == 1.
 * Used for the clip multiply of gradient clipping. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_scale_inplace(const vram_tensor_t *tensors, size_t count,
                                                            float factor);

/* A tensor that is not dense (a slice such as x[:, ::2], a transposed view with gaps): element
 * (i0, ..., i{ndim-1}) lives at data + sum(ik * strides[k]) elements. shape[k] >= 0; strides
 * may be negative; no two index tuples may reach the same element (a stride-0 or otherwise
 * self-overlapping view is refused, as PyTorch refuses to write into one). ndim <= 64. */
#define VRAM_AMP_MAX_DIMS 64
typedef struct vram_strided_tensor {
    void *data;             /* element (0, ..., 0), aligned to the element size */
    vram_dtype_t dtype;
    int32_t ndim;           /* 0 (a scalar) .. VRAM_AMP_MAX_DIMS */
    const int64_t *shape;   /* ndim entries */
    const int64_t *strides; /* ndim entries, in elements */
} vram_strided_tensor_t;

/* vram_amp_unscale_check and vram_amp_scale_inplace for strided tensors: the same per-element
 * arithmetic (the same span functions run on gathered pieces), so every result is bit for bit
 * what the dense kernels give; sumsq may differ from a dense pass in its last bits (tiles
 * follow rows here). Dense tensors should go through the dense entry points, which are faster. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_unscale_check_strided(const vram_strided_tensor_t *tensors,
                                                                    size_t count, float inv_scale,
                                                                    float *found_inf, double *sumsq);
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_scale_inplace_strided(const vram_strided_tensor_t *tensors,
                                                                    size_t count, float factor);

/* The dynamic loss-scale rule. With hysteresis == 1, min_scale == 0 and max_scale == +inf it
 * is exactly torch._amp_update_scale_: on found_inf != 0 the scale is multiplied by
 * backoff_factor (in double, stored as float) and the growth tracker reset; otherwise the
 * tracker counts clean steps and at growth_interval the scale is multiplied by growth_factor
 * unless that would be inf, and the tracker reset. (PyTorch tests `tracker + 1 == interval`,
 * so a tracker restored above a since-lowered interval never grows again; here `>=`.)
 * Extensions: backoff stops at min_scale and growth
 * at max_scale (a scale already beyond a bound, set by hand or loaded from a checkpoint, is
 * not moved further out by the rule, nor pulled back); with hysteresis N > 1 only the N-th
 * consecutive overflow backs off (NVIDIA Apex's update_scale_hysteresis: the hysteresis
 * tracker refills on every clean step). */
typedef struct vram_scale_policy {
    double growth_factor;    /* finite, > 0 */
    double backoff_factor;   /* finite, > 0 */
    int32_t growth_interval; /* >= 1 */
    int32_t hysteresis;      /* >= 1; 1 backs off on every overflow (PyTorch) */
    float min_scale;         /* >= 0; 0 = no floor */
    float max_scale;         /* > 0, may be +inf (no ceiling); >= min_scale */
} vram_scale_policy_t;

/* Fill a policy with PyTorch's defaults (2.0, 0.5, 2000, no hysteresis, no bounds). */
VRAM_API void vram_scale_policy_default(vram_scale_policy_t *policy);
/* VRAM_OK, or VRAM_ERR_INVALID_ARG naming the first bad field. */
VRAM_API VRAM_NODISCARD vram_status_t vram_scale_policy_check(const vram_scale_policy_t *policy);
/* Host version. hysteresis_tracker may be NULL only when policy->hysteresis == 1. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_update_scale(float *scale, int32_t *growth_tracker,
                                                           int32_t *hysteresis_tracker, float found_inf,
                                                           const vram_scale_policy_t *policy);

/* CUDA versions (VRAM_ERR_UNAVAILABLE when built without CUDA). Tensor data and every scalar
 * pointer are device memory on CUDA device `device`, which is made current for the launch
 * (and the previous device restored); the work is queued on `stream` and nothing waits for it, so a training step needs no host synchronisation. Up to 110 tensors
 * and 320 chunks of 65536 elements per launch, 16-byte vector loads where aligned.
 *   inv_scale, found_inf: float32 scalars; found_inf is set to 1.0f on inf/NaN, as above.
 *   sumsq: a float64 scalar the call ADDS the sum of squares into (zero it first), or NULL. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_unscale_check_cuda(const vram_tensor_t *tensors, size_t count,
                                                                 const float *inv_scale, float *found_inf,
                                                                 double *sumsq, vram_stream_t stream, int device);
/* x *= *factor on the device (a device float32 scalar; nothing written where it equals 1). */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_scale_inplace_cuda(const vram_tensor_t *tensors, size_t count,
                                                                 const float *factor, vram_stream_t stream,
                                                                 int device);
/* One thread: *coef = min(1, max_norm / (sqrt(*sumsq) + 1e-6)) and *norm = sqrt(*sumsq), as
 * torch.nn.utils.clip_grad_norm_ computes them, so clipping needs no host synchronisation;
 * an inf/NaN norm gives *coef = 1 (the step is skipped anyway, so the gradients are left as
 * they are rather than turned into NaN). norm may be NULL. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_clip_coef_cuda(const double *sumsq, double max_norm, float *coef,
                                                             float *norm, vram_stream_t stream, int device);
/* One thread, same rule as vram_amp_update_scale; found_inf is a device float32. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_update_scale_cuda(float *scale, int32_t *growth_tracker,
                                                                int32_t *hysteresis_tracker, const float *found_inf,
                                                                const vram_scale_policy_t *policy,
                                                                vram_stream_t stream, int device);

/* CPU threading and instruction set. The thread count starts at VRAMKIT_NUM_THREADS, else
 * the number of CPUs this process may run on. The SIMD path starts at VRAMKIT_SIMD
 * ("avx512", "avx2", "portable"), else the best the CPU supports. */
VRAM_API int vram_get_num_threads(void);
VRAM_API VRAM_NODISCARD vram_status_t vram_set_num_threads(int threads); /* 1..1024 */
/* The SIMD path in use: "avx512", "avx2" (AVX2 + F16C) or "portable". */
VRAM_API const char *vram_simd_path(void);
/* 1 if this CPU can run the named path. */
VRAM_API int vram_simd_supported(const char *path);
/* Select a path ("auto" = the best supported). VRAM_ERR_INVALID_ARG for an unknown name,
 * VRAM_ERR_UNAVAILABLE when this CPU lacks it; nothing changes then. */
VRAM_API VRAM_NODISCARD vram_status_t vram_set_simd_path(const char *path);


#ifdef __cplusplus
}
#endif
#endif /* VRAMKIT_AMP_H */
