/* pluggable.c — the C side of vramkit as PyTorch's CUDA allocator (vramkit_torch.h).
 *
 * torch's CUDAPluggableAllocator calls alloc_fn(size, device, stream) for every CUDA storage
 * and free_fn(ptr, size, device, stream) from the storage's deleter, with no Python around
 * them, possibly from several threads and during interpreter teardown. So: no Python here,
 * the process-wide pools (kept for the life of the process, so a tensor freed at exit still
 * finds its pool), and nothing that can fail in free. The C++ exception that reports an
 * out-of-memory to torch lives in malloc_shim.cpp. */
#include <stdatomic.h>
#include <string.h>

#include "vramkit.h"
#include "../alloc/internal.h"
#include "../util/error.h"

/* Where requests for cuda:N go: VRAM_DEVICE_CUDA (the device itself), or a simulated device
 * set by vram_torch_route for tests and dry runs. Read on every call, set rarely. */
static _Atomic int route_kind = VRAM_DEVICE_CUDA;
static _Atomic int route_index;
static atomic_uint_fast64_t stray_frees;
/* Who names the Python stack of an allocation for the history (set by the Python module,
 * context.c); NULL in a process without it. Called before any pool lock is taken. */
static _Atomic(vram_torch_context_fn) context_hook;

void vram_torch_set_context_hook(vram_torch_context_fn hook) {
    atomic_store_explicit(&context_hook, hook, memory_order_release);
}

static vram_status_t pool_for(int device, vram_pool_t **out) {
    int kind = atomic_load_explicit(&route_kind, memory_order_acquire);
    int index = kind == VRAM_DEVICE_CUDA ? device : atomic_load(&route_index);
    /* The common case without building a vram_device_t: the pool exists and this thread is in
     * no private pool (a struct built here and passed by value cost a store-forwarding stall). */
    vram_pool_t *known = device >= 0 && !vram__mempools_in_use() ? vram__known_pool(kind, index) : NULL;
    if (known) {
        *out = known;
        return VRAM_OK;
    }
    vram_device_t target = {(vram_device_kind_t)kind, index, 0};
    if (device < 0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "torch asked vramkit for memory on CUDA device %d, which does not exist",
                          device);
    return vram_alloc_pool(target, out); /* a private pool when this thread is inside vramkit.use_mem_pool */
}

vram_status_t vram_torch_malloc(int64_t size, int device, void *stream, void **out) {
    *out = NULL;
    if (size < 0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "torch asked vramkit for %lld bytes; sizes must be >= 0",
                          (long long)size);
    vram_pool_t *pool;
    vram_status_t status = pool_for(device, &pool);
    if (status != VRAM_OK) return status;
    vram_torch_context_fn hook = atomic_load_explicit(&context_hook, memory_order_acquire);
    uint64_t context = hook && vram_history_enabled(pool) ? hook(pool) : 0;
    return vram_malloc(pool, (uint64_t)size, (vram_stream_t)(uintptr_t)stream, context, out);
}

void vramkit_torch_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)device;
    (void)stream; /* the pool knows the block's stream and size */
    if (!ptr) return;
    vram_pool_t *pool;
    /* The likely pool first (no error text is formatted when it is not the owner). */
    int freed = 0;
    if (device >= 0 && pool_for(device, &pool) == VRAM_OK && vram_try_free(pool, ptr, 0, &freed) == VRAM_OK && freed)
        return;
    if (vram_find_pool(ptr, &pool) == VRAM_OK && vram_free(pool, ptr, 0) == VRAM_OK) return;
    atomic_fetch_add(&stray_frees, 1); /* not vramkit's: torch's deleter must not crash over it */
}

uint64_t vram_torch_stray_frees(void) { return (uint64_t)atomic_load(&stray_frees); }

void vramkit_torch_init(int device_count) { (void)device_count; /* pools are created on first use */ }

void vramkit_torch_empty_cache(void) {
    int n = vram_cuda_device_count();
    int kind = atomic_load(&route_kind);
    for (int i = 0; i < (kind == VRAM_DEVICE_CUDA ? n : 1); i++) {
        vram_pool_t *pool;
        if (pool_for(i, &pool) == VRAM_OK && vram_empty_cache(pool, NULL) != VRAM_OK) continue; /* cannot fail */
    }
}

void vramkit_torch_set_memory_fraction(double fraction, int device) {
    vram_pool_t *pool;
    /* torch checks the fraction before it calls this; a bad one changes nothing. */
    if (pool_for(device, &pool) == VRAM_OK && vram_set_memory_fraction(pool, fraction) != VRAM_OK) return;
}

void vramkit_torch_record_stream(void *ptr, void *stream) {
    vram_pool_t *pool;
    /* Not vramkit's, or no host memory for the stream list: nothing to record, as torch's own
     * allocator does for pointers it does not own. */
    if (ptr && vram_find_pool(ptr, &pool) == VRAM_OK &&
        vram_record_stream(pool, ptr, (vram_stream_t)(uintptr_t)stream) != VRAM_OK)
        return;
}

void *vramkit_torch_base_alloc(void *ptr, size_t *size) {
    vram_pool_t *pool;
    vram_block_info_t info;
    if (!ptr || vram_find_pool(ptr, &pool) != VRAM_OK || vram_block_query(pool, ptr, &info) != VRAM_OK) {
        if (size) *size = 0;
        return NULL;
    }
    if (size) *size = (size_t)info.segment_size;
    return (void *)(uintptr_t)info.segment_address;
}

vram_status_t vram_torch_route(const char *device) {
    vram_device_t d;
    if (!device || vram_device_parse(device, &d) != VRAM_OK || (d.kind != VRAM_DEVICE_CUDA && d.kind != VRAM_DEVICE_SIM))
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "vram_torch_route takes \"cuda\" (the real devices) or a simulated device \"sim:N\"; got "
                          "\"%s\"", device ? device : "(null)");
    if (d.kind == VRAM_DEVICE_SIM && d.index >= vram_sim_count())
        return vram__fail(VRAM_ERR_INVALID_ARG, "vram_torch_route: %s does not exist (%d simulated devices)", device,
                          vram_sim_count());
    atomic_store(&route_index, d.index);
    atomic_store_explicit(&route_kind, (int)d.kind, memory_order_release);
    return VRAM_OK;
}
