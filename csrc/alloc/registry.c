/* registry.c — device names and the process-wide pools, one per device.
 *
 * Pools are created on first use and never destroyed: NumPy arrays and buffers may be freed
 * during interpreter teardown, after any module-level cleanup would have run. Lock order is
 * registry, then pool; a pool never calls back into the registry. */
#include "internal.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

static vram__mutex_t registry_lock = VRAM__MUTEX_INITIALIZER;
static vram_pool_t *cpu_pool;
static vram_pool_t **cuda_pools; /* indexed by device, sized on first use */
static int num_cuda = -1;
static vram_pool_t **sim_pools;
static int num_sim, cap_sim;

/* Pools are never destroyed, so one already made can be found without the registry lock:
 * every allocation torch makes through vramkit looks its pool up twice (alloc and free), and
 * the lock was two fifths of what the torch hooks added to an alloc+free pair. */
#define FAST_SLOTS 64
static _Atomic(vram_pool_t *) fast_cpu, fast_cuda[FAST_SLOTS], fast_sim[FAST_SLOTS];

/* (The fields one by one: read as a pair from the struct the caller passed, they cost a
 * store-forwarding stall that was half of this lookup.) */
static _Atomic(vram_pool_t *) *fast_slot(int kind, int index) {
    if (index < 0 || index >= FAST_SLOTS) return NULL;
    switch (kind) {
    case VRAM_DEVICE_CPU: return &fast_cpu;
    case VRAM_DEVICE_CUDA: return &fast_cuda[index];
    case VRAM_DEVICE_SIM: return &fast_sim[index];
    default: return NULL;
    }
}

#define DEVICE_FORMS "'cpu', 'cuda', 'cuda:N' or 'sim:N' (a simulated device made by vramkit.sim.create), " \
                     "optionally followed by '/mempool:N' (a private pool made by vramkit.MemPool)"
#define MEMPOOL_SUFFIX "/mempool:"

static int parse_index(const char *text, int *out) {
    if (*text < '0' || *text > '9') return -1;
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || *end || v > 1000000) return -1;
    *out = (int)v;
    return 0;
}

static vram_status_t parse_device(const char *text, vram_device_t *out);

vram_status_t vram_device_parse(const char *text, vram_device_t *out) {
    if (!text) return vram__fail(VRAM_ERR_INVALID_ARG, "no device given: use " DEVICE_FORMS);
    const char *suffix = strstr(text, MEMPOOL_SUFFIX);
    if (!suffix) return parse_device(text, out);
    char device[32];
    size_t len = (size_t)(suffix - text);
    int pool;
    if (len >= sizeof device || parse_index(suffix + strlen(MEMPOOL_SUFFIX), &pool) != 0 || pool < 1)
        return vram__fail(VRAM_ERR_INVALID_ARG, "unknown device '%.64s': use " DEVICE_FORMS, text);
    memcpy(device, text, len);
    device[len] = 0;
    vram_status_t status = parse_device(device, out);
    if (status == VRAM_OK) out->mempool = pool;
    return status;
}

static vram_status_t parse_device(const char *text, vram_device_t *out) {
    if (!strcmp(text, "cpu")) {
        *out = (vram_device_t){VRAM_DEVICE_CPU, 0, 0};
        return VRAM_OK;
    }
    if (!strcmp(text, "cuda")) {
        *out = (vram_device_t){VRAM_DEVICE_CUDA, 0, 0};
        return VRAM_OK;
    }
    int index;
    if (!strncmp(text, "cuda:", 5) && parse_index(text + 5, &index) == 0) {
        *out = (vram_device_t){VRAM_DEVICE_CUDA, index, 0};
        return VRAM_OK;
    }
    if (!strncmp(text, "sim:", 4) && parse_index(text + 4, &index) == 0) {
        *out = (vram_device_t){VRAM_DEVICE_SIM, index, 0};
        return VRAM_OK;
    }
    return vram__fail(VRAM_ERR_INVALID_ARG, "unknown device '%.64s': use " DEVICE_FORMS, text);
}

static int format_device(vram_device_t device, char *buf, size_t len) {
    switch (device.kind) {
    case VRAM_DEVICE_CPU: return snprintf(buf, len, "cpu");
    case VRAM_DEVICE_CUDA: return snprintf(buf, len, "cuda:%d", device.index);
    case VRAM_DEVICE_SIM: return snprintf(buf, len, "sim:%d", device.index);
    }
    return snprintf(buf, len, "unknown");
}

int vram_device_format(vram_device_t device, char *buf, size_t len) {
    int n = format_device(device, buf, len);
    if (device.mempool == 0 || n < 0) return n;
    return n + snprintf((size_t)n < len ? buf + n : NULL, (size_t)n < len ? len - (size_t)n : 0, MEMPOOL_SUFFIX "%d",
                        device.mempool);
}

static vram_status_t make_pool(const vram_backend_t *backend, void *ctx, vram_device_t device, vram_pool_t **out) {
    return vram_pool_create(backend, ctx, device, getenv("VRAMKIT_ALLOC_CONF"), out);
}

static vram_status_t cpu_get(vram_pool_t **out) {
    if (!cpu_pool) {
        void *ctx = NULL;
        vram_status_t status = vram_backend_cpu_ctx(&ctx);
        if (status == VRAM_OK) status = make_pool(vram_backend_cpu(), ctx, (vram_device_t){VRAM_DEVICE_CPU, 0, 0}, &cpu_pool);
        if (status != VRAM_OK) return status;
    }
    *out = cpu_pool;
    return VRAM_OK;
}

static vram_status_t cuda_get(int index, vram_pool_t **out) {
    if (num_cuda < 0) {
        int n = vram_cuda_device_count();
        cuda_pools = n > 0 ? calloc((size_t)n, sizeof *cuda_pools) : NULL;
        if (n > 0 && !cuda_pools) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for the device table");
        num_cuda = n;
    }
    if (index < 0 || index >= num_cuda) {
        if (!vram_cuda_compiled())
            return vram__fail(VRAM_ERR_UNAVAILABLE,
                              "cuda:%d is not available: vramkit was built without CUDA support", index);
        return vram__fail(VRAM_ERR_UNAVAILABLE, "cuda:%d is not available: this machine has %d CUDA device%s", index,
                          num_cuda, num_cuda == 1 ? "" : "s");
    }
    if (!cuda_pools[index]) {
        void *ctx = NULL;
        vram_status_t status = vram_backend_cuda_ctx(index, &ctx);
        if (status == VRAM_OK)
            status = make_pool(vram_backend_cuda(), ctx, (vram_device_t){VRAM_DEVICE_CUDA, index, 0}, &cuda_pools[index]);
        if (status != VRAM_OK) return status;
    }
    *out = cuda_pools[index];
    return VRAM_OK;
}

vram_pool_t *vram__known_pool(int kind, int index) {
    _Atomic(vram_pool_t *) *slot = fast_slot(kind, index);
    return slot ? atomic_load_explicit(slot, memory_order_acquire) : NULL;
}

vram_status_t vram_device_pool(vram_device_t device, vram_pool_t **out) {
    *out = NULL;
    if (device.mempool != 0) return vram__mempool_get(device, out);
    _Atomic(vram_pool_t *) *slot = fast_slot((int)device.kind, device.index);
    vram_pool_t *known = vram__known_pool((int)device.kind, device.index);
    if (known) {
        *out = known;
        return VRAM_OK;
    }
    vram_status_t status;
    vram__lock(&registry_lock);
    switch (device.kind) {
    case VRAM_DEVICE_CPU: status = cpu_get(out); break;
    case VRAM_DEVICE_CUDA: status = cuda_get(device.index, out); break;
    case VRAM_DEVICE_SIM:
        if (device.index >= 0 && device.index < num_sim) {
            *out = sim_pools[device.index];
            status = VRAM_OK;
        } else {
            status = vram__fail(VRAM_ERR_UNAVAILABLE,
                                "sim:%d does not exist: %d simulated device%s exist%s; make one with "
                                "vramkit.sim.create(total_bytes)", device.index, num_sim, num_sim == 1 ? "" : "s",
                                num_sim == 1 ? "s" : "");
        }
        break;
    default: status = vram__fail(VRAM_ERR_INVALID_ARG, "unknown device kind %d", (int)device.kind);
    }
    vram__unlock(&registry_lock);
    if (status == VRAM_OK && slot) atomic_store_explicit(slot, *out, memory_order_release);
    return status;
}

vram_status_t vram_sim_create(uint64_t total_bytes, vram_device_t *out) {
    void *ctx = NULL;
    vram_status_t status = vram_backend_sim_ctx(total_bytes, &ctx);
    if (status != VRAM_OK) return status;
    vram__lock(&registry_lock);
    if (num_sim == cap_sim) {
        int cap = cap_sim ? cap_sim * 2 : 8;
        vram_pool_t **pools = realloc(sim_pools, (size_t)cap * sizeof *pools);
        if (!pools) {
            vram__unlock(&registry_lock);
            vram_backend_sim()->destroy(ctx);
            return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for the device table");
        }
        sim_pools = pools;
        cap_sim = cap;
    }
    vram_device_t device = {VRAM_DEVICE_SIM, num_sim, 0};
    status = make_pool(vram_backend_sim(), ctx, device, &sim_pools[num_sim]);
    if (status == VRAM_OK) {
        num_sim++;
        *out = device;
    }
    vram__unlock(&registry_lock);
    return status;
}

int vram_sim_count(void) {
    vram__lock(&registry_lock);
    int n = num_sim;
    vram__unlock(&registry_lock);
    return n;
}

static int owns(vram_pool_t *pool, const void *ptr) {
    if (!pool) return 0;
    vram__lock(&pool->lock);
    int found = vram__ptrmap_get(&pool->live, (uintptr_t)ptr) != NULL;
    vram__unlock(&pool->lock);
    return found;
}

vram_status_t vram_find_pool(const void *ptr, vram_pool_t **out) {
    *out = NULL;
    vram__lock(&registry_lock);
    if (owns(cpu_pool, ptr)) *out = cpu_pool;
    for (int i = 0; !*out && i < num_cuda; i++)
        if (owns(cuda_pools[i], ptr)) *out = cuda_pools[i];
    for (int i = 0; !*out && i < num_sim; i++)
        if (owns(sim_pools[i], ptr)) *out = sim_pools[i];
    if (!*out) vram__mempool_owner(ptr, out);
    vram__unlock(&registry_lock);
    if (*out) return VRAM_OK;
    return vram__fail(VRAM_ERR_INVALID_ARG,
                      "pointer %p is not a live allocation of vramkit on any device: it was never returned by "
                      "vramkit, does not start an allocation, or was already freed", ptr);
}
