/* mempool.c — private pools on a device (torch.cuda.MemPool) and the per-thread choice of the
 * pool that takes a thread's allocations (torch.cuda.use_mem_pool).
 *
 * A private pool is an ordinary pool with a backend ctx of its own on the same device: its
 * cache, counters and history are its own, so `empty_cache` of it leaves the device's pool (and
 * other private pools) alone, which is the point of separating, say, an inference cache from
 * training memory. A simulated device's private pools draw on the device's capacity; cpu and
 * CUDA pools draw on the real memory anyway. Like device pools they are never destroyed: memory
 * handed out from them may be freed during interpreter teardown. */
#include "internal.h"

#include <stdlib.h>

#include "../util/error.h"

#define MAX_NESTED_USES 16

static vram__mutex_t mempool_lock = VRAM__MUTEX_INITIALIZER;
static vram_pool_t **mempools; /* private pool N is mempools[N - 1] */
static int *use_counts;        /* active vram_mempool_use, all threads */
static int num_mempools, cap_mempools;

/* This thread's uses, innermost last. */
static _Thread_local vram_pool_t *thread_uses[MAX_NESTED_USES];
static _Thread_local int thread_depth;

static vram_status_t make_ctx(vram_pool_t *device_pool, void **ctx) {
    vram_device_t d = device_pool->device;
    switch (d.kind) {
    case VRAM_DEVICE_CPU: return vram_backend_cpu_ctx(ctx);
    case VRAM_DEVICE_CUDA: return vram_backend_cuda_ctx(d.index, ctx);
    case VRAM_DEVICE_SIM: return vram__backend_sim_ctx_sharing(device_pool->ctx, ctx);
    }
    return vram__fail(VRAM_ERR_INVALID_ARG, "unknown device kind %d", (int)d.kind);
}

vram_status_t vram_mempool_create(vram_device_t device, vram_device_t *out) {
    if (device.mempool != 0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "a private pool is made on a device ('cpu', 'cuda:N', 'sim:N'), "
                                                "not on another private pool");
    vram_pool_t *device_pool;
    vram_status_t status = vram_device_pool(device, &device_pool);
    if (status != VRAM_OK) return status;
    vram__lock(&mempool_lock);
    if (num_mempools == cap_mempools) {
        int cap = cap_mempools ? cap_mempools * 2 : 8;
        vram_pool_t **pools = realloc(mempools, (size_t)cap * sizeof *pools);
        if (pools) mempools = pools;
        int *counts = pools ? realloc(use_counts, (size_t)cap * sizeof *counts) : NULL;
        if (counts) use_counts = counts;
        if (!pools || !counts) {
            vram__unlock(&mempool_lock);
            return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for the private pool table");
        }
        cap_mempools = cap;
    }
    void *ctx = NULL;
    vram_device_t named = device;
    named.mempool = num_mempools + 1;
    status = make_ctx(device_pool, &ctx);
    vram_pool_t *pool = NULL;
    if (status == VRAM_OK) status = vram_pool_create(device_pool->backend, ctx, named, getenv("VRAMKIT_ALLOC_CONF"), &pool);
    if (status == VRAM_OK) {
        mempools[num_mempools] = pool;
        use_counts[num_mempools] = 0;
        num_mempools++;
        *out = named;
    }
    vram__unlock(&mempool_lock);
    return status;
}

/* The private pool a name refers to, checked against the device it names. Caller holds the lock. */
static vram_status_t lookup(vram_device_t name, int *slot) {
    int n = name.mempool;
    if (n < 1 || n > num_mempools)
        return vram__fail(VRAM_ERR_INVALID_ARG, "private pool %d does not exist (%d made with vramkit.MemPool)", n,
                          num_mempools);
    vram_device_t d = mempools[n - 1]->device;
    if (d.kind != name.kind || d.index != name.index) {
        char buf[48];
        vram_device_format(d, buf, sizeof buf);
        return vram__fail(VRAM_ERR_INVALID_ARG, "private pool %d is %s, on another device", n, buf);
    }
    *slot = n - 1;
    return VRAM_OK;
}

vram_status_t vram__mempool_get(vram_device_t name, vram_pool_t **out) {
    int slot;
    vram__lock(&mempool_lock);
    vram_status_t status = lookup(name, &slot);
    if (status == VRAM_OK) *out = mempools[slot];
    vram__unlock(&mempool_lock);
    return status;
}

vram_status_t vram_mempool_use(vram_device_t mempool) {
    int slot;
    vram__lock(&mempool_lock);
    vram_status_t status = lookup(mempool, &slot);
    if (status == VRAM_OK && thread_depth == MAX_NESTED_USES)
        status = vram__fail(VRAM_ERR_INVALID_ARG, "more than %d private pools in use at once on one thread",
                            MAX_NESTED_USES);
    if (status == VRAM_OK) {
        thread_uses[thread_depth++] = mempools[slot];
        use_counts[slot]++;
    }
    vram__unlock(&mempool_lock);
    return status;
}

vram_status_t vram_mempool_unuse(vram_device_t mempool) {
    int slot;
    vram__lock(&mempool_lock);
    vram_status_t status = lookup(mempool, &slot);
    if (status == VRAM_OK && (thread_depth == 0 || thread_uses[thread_depth - 1] != mempools[slot]))
        status = vram__fail(VRAM_ERR_INVALID_ARG, "private pool %d is not the innermost one in use on this thread: "
                                                  "uses end in the reverse order of their start", mempool.mempool);
    if (status == VRAM_OK) {
        thread_depth--;
        use_counts[slot]--;
    }
    vram__unlock(&mempool_lock);
    return status;
}

int vram_mempool_use_count(vram_device_t mempool) {
    int count = -1, n = mempool.mempool;
    vram__lock(&mempool_lock);
    if (n >= 1 && n <= num_mempools && mempools[n - 1]->device.kind == mempool.kind &&
        mempools[n - 1]->device.index == mempool.index)
        count = use_counts[n - 1];
    vram__unlock(&mempool_lock);
    return count;
}

vram_pool_t *vram_mempool_in_use(vram_device_t device) {
    for (int i = thread_depth - 1; i >= 0; i--) { /* thread-local: no lock */
        vram_device_t d = thread_uses[i]->device;
        if (d.kind == device.kind && d.index == device.index) return thread_uses[i];
    }
    return NULL;
}

int vram__mempools_in_use(void) { return thread_depth > 0; }

vram_status_t vram_alloc_pool(vram_device_t device, vram_pool_t **out) {
    vram_pool_t *in_use = device.mempool == 0 ? vram_mempool_in_use(device) : NULL;
    if (in_use) {
        *out = in_use;
        return VRAM_OK;
    }
    return vram_device_pool(device, out);
}

int vram__mempool_owner(const void *ptr, vram_pool_t **out) {
    vram__lock(&mempool_lock);
    int found = 0;
    for (int i = 0; i < num_mempools && !found; i++) {
        vram_pool_t *pool = mempools[i];
        vram__lock(&pool->lock);
        found = vram__ptrmap_get(&pool->live, (uintptr_t)ptr) != NULL;
        vram__unlock(&pool->lock);
        if (found) *out = pool;
    }
    vram__unlock(&mempool_lock);
    return found;
}
