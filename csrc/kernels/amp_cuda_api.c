/* amp_cuda_api.c — the public CUDA loss-scaling entry points: argument checks on the host,
 * the caller's device made current around the launch, then the launchers in amp_cuda.cu,
 * which only queue work on the caller's stream. Nothing here touches device memory or
 * synchronises, so a bad device pointer surfaces later as a CUDA error on the stream, as
 * with any asynchronous CUDA call. */
#include <stddef.h>
#include <stdint.h>

#include "vramkit.h"
#include "../util/error.h"
#include "amp_internal.h"

#ifdef VRAMKIT_WITH_CUDA
#include <cuda_runtime_api.h>

/* amp_cuda.cu; each returns 0 or a cudaError_t value and launches on the current device. */
int vram__amp_unscale_check_launch(const vram_tensor_t *tensors, uint64_t count, const float *inv_scale,
                                   float *found_inf, double *sumsq, uint64_t stream);
int vram__amp_scale_inplace_launch(const vram_tensor_t *tensors, uint64_t count, const float *factor,
                                   uint64_t stream);
int vram__amp_clip_coef_launch(const double *sumsq, double max_norm, float *coef, float *norm, uint64_t stream);
int vram__amp_update_scale_launch(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                  const float *found_inf, const vram_scale_policy_t *policy, uint64_t stream);

#define NULL_ARG(fn, name) vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s must not be NULL", fn, name)

static vram_status_t check_device(const char *fn, int device) {
    if (device < 0) return vram__fail(VRAM_ERR_INVALID_ARG, "%s: device must be >= 0, got %d", fn, device);
    return VRAM_OK;
}

/* Make `device` current; *previous receives the device to restore, or -1 if none changed. */
static vram_status_t enter_device(const char *fn, int device, int *previous) {
    *previous = -1;
    int current = -1;
    cudaError_t err = cudaGetDevice(&current);
    if (err == cudaSuccess && current != device) {
        err = cudaSetDevice(device);
        if (err == cudaSuccess) *previous = current;
    }
    if (err == cudaSuccess) return VRAM_OK;
    /* These errors are not sticky: clear them so a later launch check does not report them. */
    (void)cudaGetLastError();
    if (err == cudaErrorInvalidDevice || err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver)
        return vram__fail(VRAM_ERR_UNAVAILABLE, "%s: cuda:%d is not available: %s", fn, device,
                          cudaGetErrorString(err));
    return vram__fail(VRAM_ERR_BACKEND, "%s: cuda:%d: %s", fn, device, cudaGetErrorString(err));
}

static vram_status_t leave_device(const char *fn, int previous, int err) {
    if (previous >= 0) (void)cudaSetDevice(previous);
    if (err == 0) return VRAM_OK;
    return vram__fail(VRAM_ERR_BACKEND, "%s: %s", fn, cudaGetErrorString((cudaError_t)err));
}

vram_status_t vram_amp_unscale_check_cuda(const vram_tensor_t *tensors, size_t count, const float *inv_scale,
                                          float *found_inf, double *sumsq, vram_stream_t stream, int device) {
    static const char fn[] = "vram_amp_unscale_check_cuda";
    vram_status_t st = vram__amp_check_list(tensors, count);
    if (st != VRAM_OK) return st;
    if (!inv_scale) return NULL_ARG(fn, "inv_scale");
    if (!found_inf) return NULL_ARG(fn, "found_inf");
    if ((st = check_device(fn, device)) != VRAM_OK) return st;
    /* Checked before the empty-list return so a wrong call fails the same way every time. */
    if (count == 0) return VRAM_OK;
    int previous;
    if ((st = enter_device(fn, device, &previous)) != VRAM_OK) return st;
    int err = vram__amp_unscale_check_launch(tensors, (uint64_t)count, inv_scale, found_inf, sumsq, stream);
    return leave_device(fn, previous, err);
}

vram_status_t vram_amp_scale_inplace_cuda(const vram_tensor_t *tensors, size_t count, const float *factor,
                                          vram_stream_t stream, int device) {
    static const char fn[] = "vram_amp_scale_inplace_cuda";
    vram_status_t st = vram__amp_check_list(tensors, count);
    if (st != VRAM_OK) return st;
    if (!factor) return NULL_ARG(fn, "factor");
    if ((st = check_device(fn, device)) != VRAM_OK) return st;
    if (count == 0) return VRAM_OK;
    int previous;
    if ((st = enter_device(fn, device, &previous)) != VRAM_OK) return st;
    int err = vram__amp_scale_inplace_launch(tensors, (uint64_t)count, factor, stream);
    return leave_device(fn, previous, err);
}

vram_status_t vram_amp_clip_coef_cuda(const double *sumsq, double max_norm, float *coef, float *norm,
                                      vram_stream_t stream, int device) {
    static const char fn[] = "vram_amp_clip_coef_cuda";
    vram_status_t st;
    if (!sumsq) return NULL_ARG(fn, "sumsq");
    if (!coef) return NULL_ARG(fn, "coef");
    if ((st = check_device(fn, device)) != VRAM_OK) return st;
    int previous;
    if ((st = enter_device(fn, device, &previous)) != VRAM_OK) return st;
    int err = vram__amp_clip_coef_launch(sumsq, max_norm, coef, norm, stream);
    return leave_device(fn, previous, err);
}

vram_status_t vram_amp_update_scale_cuda(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                         const float *found_inf, const vram_scale_policy_t *policy,
                                         vram_stream_t stream, int device) {
    static const char fn[] = "vram_amp_update_scale_cuda";
    if (!scale) return NULL_ARG(fn, "scale");
    if (!growth_tracker) return NULL_ARG(fn, "growth_tracker");
    if (!found_inf) return NULL_ARG(fn, "found_inf");
    if (!policy) return NULL_ARG(fn, "policy");
    vram_status_t st = vram_scale_policy_check(policy);
    if (st != VRAM_OK) return st;
    /* The rule would silently ignore the hysteresis without a tracker: refuse instead. */
    if (!hysteresis_tracker && policy->hysteresis > 1)
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: hysteresis_tracker must not be NULL when policy->hysteresis is %d",
                          fn, (int)policy->hysteresis);
    if ((st = check_device(fn, device)) != VRAM_OK) return st;
    int previous;
    if ((st = enter_device(fn, device, &previous)) != VRAM_OK) return st;
    int err = vram__amp_update_scale_launch(scale, growth_tracker, hysteresis_tracker, found_inf, policy, stream);
    return leave_device(fn, previous, err);
}

#else /* built without CUDA */

#define NO_CUDA(fn)                                                                                               \
    vram__fail(VRAM_ERR_UNAVAILABLE, "%s: vramkit was built without CUDA support (nvcc was not found at build "   \
               "time, or VRAMKIT_CUDA=0)", fn)

vram_status_t vram_amp_unscale_check_cuda(const vram_tensor_t *tensors, size_t count, const float *inv_scale,
                                          float *found_inf, double *sumsq, vram_stream_t stream, int device) {
    (void)tensors, (void)count, (void)inv_scale, (void)found_inf, (void)sumsq, (void)stream, (void)device;
    return NO_CUDA("vram_amp_unscale_check_cuda");
}

vram_status_t vram_amp_scale_inplace_cuda(const vram_tensor_t *tensors, size_t count, const float *factor,
                                          vram_stream_t stream, int device) {
    (void)tensors, (void)count, (void)factor, (void)stream, (void)device;
    return NO_CUDA("vram_amp_scale_inplace_cuda");
}

vram_status_t vram_amp_clip_coef_cuda(const double *sumsq, double max_norm, float *coef, float *norm,
                                      vram_stream_t stream, int device) {
    (void)sumsq, (void)max_norm, (void)coef, (void)norm, (void)stream, (void)device;
    return NO_CUDA("vram_amp_clip_coef_cuda");
}

vram_status_t vram_amp_update_scale_cuda(float *scale, int32_t *growth_tracker, int32_t *hysteresis_tracker,
                                         const float *found_inf, const vram_scale_policy_t *policy,
                                         vram_stream_t stream, int device) {
    (void)scale, (void)growth_tracker, (void)hysteresis_tracker, (void)found_inf, (void)policy, (void)stream,
        (void)device;
    return NO_CUDA("vram_amp_update_scale_cuda");
}

#endif
