/* cuda.c — the CUDA backend: cudaMalloc'd segments, real streams and events; expandable
 * segments through the driver's virtual-memory API (cuda_vmm.c).
 *
 * Built only when setup.py finds nvcc (VRAMKIT_WITH_CUDA); the runtime is linked statically,
 * so the module imports on a machine without a driver and CUDA then reports 0 devices.
 * Every call runs with the pool's device current and restores the caller's device. */
#include <stdlib.h>

#include "vramkit.h"
#include "../util/error.h"

#ifdef VRAMKIT_WITH_CUDA
#include <cuda_runtime_api.h>

#include "cuda_vmm.h"

#define EVENT_CACHE 64 /* cudaEventCreate is costly under contention; reuse a few */

typedef struct cuda_ctx {
    int device;
    cudaEvent_t cache[EVENT_CACHE];
    int cached;
    size_t granularity; /* the driver's minimum mapping unit, 0 until range_map asks */
} cuda_ctx_t;

typedef struct device_guard {
    int previous, changed;
} device_guard_t;

static cudaError_t guard_enter(device_guard_t *g, int device) {
    g->changed = 0;
    cudaError_t err = cudaGetDevice(&g->previous);
    if (err != cudaSuccess) return err;
    if (g->previous != device) {
        err = cudaSetDevice(device);
        g->changed = err == cudaSuccess;
    }
    return err;
}

static void guard_exit(const device_guard_t *g) {
    if (g->changed) (void)cudaSetDevice(g->previous);
}

/* Report a CUDA failure with the call, the device and CUDA's own name for the error, then
 * clear the error so it does not surface from an unrelated later call. */
static vram_status_t cuda_fail(const char *call, const cuda_ctx_t *c, cudaError_t err) {
    (void)cudaGetLastError();
    return vram__fail(VRAM_ERR_BACKEND, "%s failed on cuda:%d: %s (%s)", call, c->device, cudaGetErrorName(err),
                      cudaGetErrorString(err));
}

static vram_status_t cuda_segment_alloc(void *ctx, uint64_t size, vram_stream_t stream, uintptr_t *out) {
    (void)stream;
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    cudaError_t err = guard_enter(&g, c->device);
    void *p = NULL;
    if (err == cudaSuccess) err = cudaMalloc(&p, (size_t)size);
    guard_exit(&g);
    if (err == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* not sticky: forget it and let the pool retry */
        return VRAM_ERR_OOM;
    }
    if (err != cudaSuccess) return cuda_fail("cudaMalloc", c, err);
    *out = (uintptr_t)p;
    return VRAM_OK;
}

static void cuda_segment_free(void *ctx, uintptr_t addr, uint64_t size) {
    (void)size;
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    if (guard_enter(&g, c->device) == cudaSuccess) (void)cudaFree((void *)addr);
    guard_exit(&g);
    (void)cudaGetLastError();
}

static vram_status_t cuda_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes) {
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    size_t f = 0, t = 0;
    cudaError_t err = guard_enter(&g, c->device);
    if (err == cudaSuccess) err = cudaMemGetInfo(&f, &t);
    guard_exit(&g);
    if (err != cudaSuccess) return cuda_fail("cudaMemGetInfo", c, err);
    *free_bytes = f;
    *total_bytes = t;
    return VRAM_OK;
}

static vram_status_t cuda_synchronize(void *ctx, vram_stream_t stream) {
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    cudaError_t err = guard_enter(&g, c->device);
    if (err == cudaSuccess)
        err = stream == VRAM_ALL_STREAMS ? cudaDeviceSynchronize() : cudaStreamSynchronize((cudaStream_t)stream);
    guard_exit(&g);
    return err == cudaSuccess ? VRAM_OK : cuda_fail("synchronize", c, err);
}

static vram_status_t cuda_event_record(void *ctx, vram_stream_t stream, void **event) {
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    cudaError_t err = guard_enter(&g, c->device);
    cudaEvent_t e = NULL;
    if (err == cudaSuccess) {
        if (c->cached > 0) e = c->cache[--c->cached];
        else err = cudaEventCreateWithFlags(&e, cudaEventDisableTiming);
    }
    if (err == cudaSuccess) err = cudaEventRecord(e, (cudaStream_t)stream);
    guard_exit(&g);
    if (err != cudaSuccess) {
        if (e) (void)cudaEventDestroy(e);
        return cuda_fail("cudaEventRecord", c, err);
    }
    *event = e;
    return VRAM_OK;
}

static vram_status_t cuda_event_query(void *ctx, void *event, int *done) {
    cudaError_t err = cudaEventQuery((cudaEvent_t)event);
    if (err == cudaErrorNotReady) {
        (void)cudaGetLastError();
        *done = 0;
        return VRAM_OK;
    }
    if (err != cudaSuccess) return cuda_fail("cudaEventQuery", ctx, err);
    *done = 1;
    return VRAM_OK;
}

static vram_status_t cuda_event_synchronize(void *ctx, void *event) {
    cudaError_t err = cudaEventSynchronize((cudaEvent_t)event);
    return err == cudaSuccess ? VRAM_OK : cuda_fail("cudaEventSynchronize", ctx, err);
}

static void cuda_event_destroy(void *ctx, void *event) {
    cuda_ctx_t *c = ctx;
    if (c->cached < EVENT_CACHE) c->cache[c->cached++] = (cudaEvent_t)event;
    else (void)cudaEventDestroy((cudaEvent_t)event);
}

/* Expandable segments (cuda_vmm.c). The driver API works on the thread's current context,
 * which the runtime makes current only lazily: on a thread new to CUDA, guard_enter finds the
 * device already "current" and sets nothing, so make its primary context current here. */
static vram_status_t vmm_enter(device_guard_t *g, const cuda_ctx_t *c) {
    g->changed = 0;
    vram_status_t status = vram__cuda_vmm_load();
    if (status != VRAM_OK) return status;
    cudaError_t err = guard_enter(g, c->device);
    if (err == cudaSuccess && !g->changed && vram__cuda_vmm_no_context()) err = cudaSetDevice(c->device);
    return err == cudaSuccess ? VRAM_OK : cuda_fail("cudaSetDevice", c, err);
}

static vram_status_t cuda_range_reserve(void *ctx, uint64_t size, uintptr_t *out) {
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    vram_status_t status = vmm_enter(&g, c);
    if (status == VRAM_OK) status = vram__cuda_vmm_reserve(c->device, size, out);
    guard_exit(&g);
    return status;
}

static vram_status_t cuda_range_map(void *ctx, uintptr_t addr, uint64_t size, uint64_t page) {
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    vram_status_t status = vmm_enter(&g, c);
    if (status == VRAM_OK) status = vram__cuda_vmm_map(c->device, &c->granularity, addr, size, page);
    guard_exit(&g);
    return status;
}

/* cudaFree waits for the device before freeing; cuMemUnmap does not (PyTorch synchronizes
 * before it too), and the pool does not say which streams used these pages. Kernels still
 * queued on a freed block must not run on unmapped memory, so wait for the whole device. */
static vram_status_t cuda_range_unmap(void *ctx, uintptr_t addr, uint64_t size, uint64_t page) {
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    vram_status_t status = vmm_enter(&g, c);
    cudaError_t err = status == VRAM_OK ? cudaDeviceSynchronize() : cudaSuccess;
    if (err != cudaSuccess) status = cuda_fail("cudaDeviceSynchronize", c, err);
    if (status == VRAM_OK) status = vram__cuda_vmm_unmap(c->device, addr, size, page);
    guard_exit(&g);
    return status;
}

static void cuda_range_release(void *ctx, uintptr_t addr, uint64_t size) {
    cuda_ctx_t *c = ctx;
    device_guard_t g;
    if (vmm_enter(&g, c) == VRAM_OK) vram__cuda_vmm_release(addr, size);
    guard_exit(&g);
}

static void cuda_destroy(void *ctx) {
    cuda_ctx_t *c = ctx;
    while (c->cached > 0) (void)cudaEventDestroy(c->cache[--c->cached]);
    free(c);
}

/* One line per concern: segments, streams, events, expandable segments' ranges. */
static const vram_backend_t cuda_backend = {
    .name = "cuda",
    .segment_alloc = cuda_segment_alloc, .segment_free = cuda_segment_free, .mem_info = cuda_mem_info,
    .synchronize = cuda_synchronize, .destroy = cuda_destroy,
    .event_record = cuda_event_record, .event_query = cuda_event_query, .event_synchronize = cuda_event_synchronize,
    .event_destroy = cuda_event_destroy,
    .range_reserve = cuda_range_reserve, .range_map = cuda_range_map, .range_unmap = cuda_range_unmap,
    .range_release = cuda_range_release,
};

const vram_backend_t *vram_backend_cuda(void) { return &cuda_backend; }
int vram_cuda_compiled(void) { return 1; }

int vram_cuda_device_count(void) {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* no driver or no device: CUDA is simply unavailable */
        return 0;
    }
    return n;
}

vram_status_t vram_backend_cuda_ctx(int device_index, void **ctx) {
    int n = vram_cuda_device_count();
    if (device_index < 0 || device_index >= n)
        return vram__fail(VRAM_ERR_UNAVAILABLE, "cuda:%d is not available: this machine has %d CUDA device%s",
                          device_index, n, n == 1 ? "" : "s");
    cuda_ctx_t *c = calloc(1, sizeof *c);
    if (!c) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for the cuda backend");
    c->device = device_index;
    *ctx = c;
    return VRAM_OK;
}

#else /* built without CUDA */

const vram_backend_t *vram_backend_cuda(void) { return NULL; }
int vram_cuda_compiled(void) { return 0; }
int vram_cuda_device_count(void) { return 0; }

vram_status_t vram_backend_cuda_ctx(int device_index, void **ctx) {
    (void)ctx;
    return vram__fail(VRAM_ERR_UNAVAILABLE,
                      "cuda:%d is not available: vramkit was built without CUDA support (nvcc was not found at "
                      "build time, or VRAMKIT_CUDA=0)", device_index);
}

#endif
