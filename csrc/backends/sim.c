/* sim.c — a simulated device: it hands out addresses from a virtual range and never touches
 * memory, so an 80 GiB GPU, or a recorded trace, can be replayed on a laptop.
 *
 * Every simulated device draws from one process-wide range, so an address identifies its
 * device (raw_free(ptr) finds the right pool), and addresses are never reused: a released
 * range stays unused, which keeps the backend O(1) and makes every segment unique in a
 * trace. (Expandable segments' reserved ranges are the exception: a device reuses its own.) The range starts at 2^48, above the 47-bit user address space where host and CUDA
 * pointers live, and ends at 2^53 so JavaScript viewers keep exact addresses; a process
 * would need petabytes of segment churn to exhaust it.
 *
 * Throwaway pools that nothing looks up by address (trace replay makes one per call) take a
 * private range instead (vram__backend_sim_ctx_private): a process that replays thousands of
 * 80 GiB traces would otherwise draw its 8 PiB from the shared range and leave none for the
 * simulated devices. */
#include <stdlib.h>

#include "host_streams.h"
#include "../alloc/internal.h"
#include "../util/error.h"

#define SIM_BASE ((uint64_t)1 << 48)
#define SIM_END ((uint64_t)1 << 53)
#define SIM_ALIGN ((uint64_t)2 << 20)
/* A private range need not stay exact in JavaScript; it ends where addr + size still fits in
 * 64 bits for any request below 2^62. */
#define SIM_PRIVATE_END ((uint64_t)1 << 63)

static uint64_t next_address = SIM_BASE; /* shared by all simulated devices, updated atomically */

/* What a device has and what is taken of it: a private pool (vramkit.MemPool) on a simulated
 * device draws from its device's, so both pools' locks may update it: atomics. */
typedef struct sim_usage {
    uint64_t capacity, used;
} sim_usage_t;

typedef struct sim_ctx {
    vram__host_streams_t streams; /* first: host_streams.c's entries take the ctx as their own */
    sim_usage_t own_usage;
    sim_usage_t *usage; /* &own_usage, or the device's for a private pool */
    uint64_t *next;     /* the bump pointer: &next_address, or &own_next for a private range */
    uint64_t end;       /* where that range ends */
    uint64_t own_next;
    /* Expandable segments' ranges released by this device, reused by it: empty_cache releases
     * a range (1 1/8 of the capacity) and the next allocation reserves one again, so without
     * reuse a loop of the two would exhaust the shared addresses after ~90,000 turns. */
    struct sim_range { uint64_t addr, size; } released[8];
    int num_released;
} sim_ctx_t;
_Static_assert(offsetof(sim_ctx_t, streams) == 0, "host_streams.c takes the ctx for its streams");

/* Take `size` bytes of addresses (2 MiB-aligned) from the ctx's range. */
static vram_status_t draw_addresses(sim_ctx_t *s, uint64_t size, uintptr_t *out) {
    uint64_t aligned = (size + SIM_ALIGN - 1) / SIM_ALIGN * SIM_ALIGN;
    uint64_t addr = __atomic_load_n(s->next, __ATOMIC_RELAXED);
    do { /* advance only when the range fits, so a refused request consumes nothing */
        if (aligned > s->end - addr)
            return vram__fail(VRAM_ERR_BACKEND,
                              "simulated address range exhausted: %llu bytes of segments drawn, %llu requested",
                              (unsigned long long)(addr - SIM_BASE), (unsigned long long)size);
    } while (!__atomic_compare_exchange_n(s->next, &addr, addr + aligned, 0, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    *out = (uintptr_t)addr;
    return VRAM_OK;
}

/* Count `size` bytes as used if the capacity has them; 0 when it does not. */
static int take(sim_usage_t *u, uint64_t size) {
    uint64_t used = __atomic_load_n(&u->used, __ATOMIC_RELAXED);
    do {
        if (size > u->capacity - used) return 0;
    } while (!__atomic_compare_exchange_n(&u->used, &used, used + size, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return 1;
}

static void give(sim_usage_t *u, uint64_t size) { __atomic_sub_fetch(&u->used, size, __ATOMIC_RELAXED); }

static vram_status_t sim_segment_alloc(void *ctx, uint64_t size, vram_stream_t stream, uintptr_t *out) {
    (void)stream;
    sim_ctx_t *s = ctx;
    if (!take(s->usage, size)) return VRAM_ERR_OOM;
    vram_status_t status = draw_addresses(s, size, out);
    if (status != VRAM_OK) give(s->usage, size);
    return status;
}

static void sim_segment_free(void *ctx, uintptr_t addr, uint64_t size) {
    (void)addr;
    give(((sim_ctx_t *)ctx)->usage, size);
}

/* Expandable segments: a reservation only draws addresses; mapping counts against the
 * capacity, so a 1 TiB device with 1 1/8 TiB ranges per stream costs no memory here. */
static vram_status_t sim_range_reserve(void *ctx, uint64_t size, uintptr_t *out) {
    sim_ctx_t *s = ctx;
    for (int i = 0; i < s->num_released; i++) {
        if (s->released[i].size != size) continue;
        *out = (uintptr_t)s->released[i].addr;
        s->released[i] = s->released[--s->num_released];
        return VRAM_OK;
    }
    return draw_addresses(s, size, out);
}

static vram_status_t sim_range_map(void *ctx, uintptr_t addr, uint64_t size, uint64_t page) {
    (void)addr;
    (void)page;
    sim_ctx_t *s = ctx;
    return take(s->usage, size) ? VRAM_OK : VRAM_ERR_OOM;
}

static vram_status_t sim_range_unmap(void *ctx, uintptr_t addr, uint64_t size, uint64_t page) {
    (void)page;
    sim_segment_free(ctx, addr, size);
    return VRAM_OK;
}

static void sim_range_release(void *ctx, uintptr_t addr, uint64_t size) {
    sim_ctx_t *s = ctx; /* the pool's lock serializes calls on one ctx */
    if (s->num_released < (int)(sizeof s->released / sizeof s->released[0]))
        s->released[s->num_released++] = (struct sim_range){addr, size};
}

static vram_status_t sim_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes) {
    const sim_ctx_t *s = ctx;
    *total_bytes = s->usage->capacity;
    *free_bytes = s->usage->capacity - __atomic_load_n(&s->usage->used, __ATOMIC_RELAXED);
    return VRAM_OK;
}

/* One line per concern: segments, streams and events, expandable segments' ranges. */
static const vram_backend_t sim_backend = {
    .name = "sim",
    .segment_alloc = sim_segment_alloc, .segment_free = sim_segment_free, .mem_info = sim_mem_info,
    VRAM__HOST_STREAM_ENTRIES, .destroy = vram__host_ctx_destroy,
    .range_reserve = sim_range_reserve, .range_map = sim_range_map, .range_unmap = sim_range_unmap,
    .range_release = sim_range_release,
};

const vram_backend_t *vram_backend_sim(void) { return &sim_backend; }

static vram_status_t make_ctx(uint64_t total_bytes, int private_range, void **ctx) {
    if (total_bytes == 0 || total_bytes >= VRAM_MAX_REQUEST)
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "a simulated device needs a capacity between 1 byte and 2**62 bytes; got %llu",
                          (unsigned long long)total_bytes);
    vram_status_t status = vram__host_ctx_new(sizeof(sim_ctx_t), "a simulated device", ctx);
    if (status != VRAM_OK) return status;
    sim_ctx_t *s = *ctx;
    s->own_usage.capacity = total_bytes;
    s->usage = &s->own_usage;
    s->own_next = SIM_BASE;
    s->next = private_range ? &s->own_next : &next_address;
    s->end = private_range ? SIM_PRIVATE_END : SIM_END;
    return VRAM_OK;
}

vram_status_t vram_backend_sim_ctx(uint64_t total_bytes, void **ctx) { return make_ctx(total_bytes, 0, ctx); }

vram_status_t vram__backend_sim_ctx_private(uint64_t total_bytes, void **ctx) { return make_ctx(total_bytes, 1, ctx); }

vram_status_t vram__backend_sim_ctx_sharing(void *device_ctx, void **ctx) {
    const sim_ctx_t *device = device_ctx;
    vram_status_t status = make_ctx(device->usage->capacity, 0, ctx);
    if (status == VRAM_OK) ((sim_ctx_t *)*ctx)->usage = device->usage; /* never freed: device pools live on */
    return status;
}
