/* history.c — the allocation history: a ring buffer of trace entries, PyTorch's
 * _record_memory_history, read out by snapshots. */
#include "internal.h"

#include <stdlib.h>

#include "../util/clock.h"
#include "../util/error.h"

void vram__trace_record(vram_pool_t *pool, vram_trace_action_t action, uint64_t addr, uint64_t size,
                        vram_stream_t stream, uint64_t context, uint64_t device_free) {
    vram__history_t *h = &pool->history;
    vram_trace_entry_t *e = &h->entries[h->written % h->capacity];
    e->action = (uint32_t)action;
    e->addr = addr;
    e->size = size;
    e->stream = stream;
    e->time_ns = vram__now_ns();
    e->device_free = device_free;
    e->context = context;
    h->written++;
}

vram_status_t vram_history_enable(vram_pool_t *pool, uint64_t max_entries) {
    if (max_entries > ((uint64_t)1 << 32))
        return vram__fail(VRAM_ERR_INVALID_ARG, "max_entries %llu is too large: at most 2**32 entries are kept",
                          (unsigned long long)max_entries);
    vram_trace_entry_t *entries = NULL;
    if (max_entries && !(entries = malloc(max_entries * sizeof *entries)))
        return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for a history of %llu entries",
                          (unsigned long long)max_entries);
    vram__lock(&pool->lock);
    /* Keep the newest entries that fit, so re-enabling with a new size loses nothing needed. */
    vram__history_t *h = &pool->history;
    uint64_t kept = h->written < h->capacity ? h->written : h->capacity;
    if (kept > max_entries) kept = max_entries;
    for (uint64_t i = 0; i < kept; i++)
        entries[i] = h->entries[(h->written - kept + i) % h->capacity];
    free(h->entries);
    h->entries = entries;
    h->capacity = max_entries;
    h->written = kept;
    __atomic_store_n(&pool->history_on, max_entries > 0, __ATOMIC_RELAXED);
    vram__unlock(&pool->lock);
    return VRAM_OK;
}

int vram_history_enabled(const vram_pool_t *pool) { return __atomic_load_n(&pool->history_on, __ATOMIC_RELAXED); }
