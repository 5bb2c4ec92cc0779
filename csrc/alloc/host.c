/* host.c — the cpu pool must never be the reason the OOM killer ends a process.
 *
 * On a GPU, cudaMalloc fails when memory is short and the OOM ladder (free the cache, retry,
 * raise) runs. On Linux mmap almost never fails (overcommit): the pages are found when they
 * are first touched, and if they are not there the kernel kills the process. So before a host
 * pool maps a segment it asks the host (MemAvailable, free swap, the cgroup's limit; see
 * backends/host_memory.c) and refuses the segment as an OOM when it would not fit, which
 * runs the same ladder. Separately, the cache is bounded: wholly free segments beyond
 * host_cache_limit are unmapped, least recently freed first. */
#include "internal.h"

#include "../util/clock.h"

/* A reading is reused for up to this long by segments small against its room: a 20 MiB
 * segment need not pay for reading /proc and the cgroup files (10-50 us) each time. */
#define READING_TTL_NS ((uint64_t)100 * 1000 * 1000)

vram_status_t vram__host_check_room(vram_pool_t *pool, uint64_t size) {
    if (!pool->backend->host_memory || !pool->settings.host_memory_check) return VRAM_OK;
    vram__host_state_t *h = &pool->host;
    uint64_t reserve = pool->settings.host_reserve;
    uint64_t need = size > UINT64_MAX - reserve ? UINT64_MAX : size + reserve;
    uint64_t now = vram__now_ns();
    if (h->reading_valid && now - h->read_ns < READING_TTL_NS && h->room > h->mapped_since &&
        need <= (h->room - h->mapped_since) / 2) {
        h->mapped_since += size;
        return VRAM_OK;
    }
    vram_host_memory_t info;
    if (pool->backend->host_memory(pool->ctx, &info) != VRAM_OK) return VRAM_OK; /* cannot tell: do not refuse */
    /* What the kernel's figure leaves out: pages we reused after MADV_FREE are still counted as
     * available, and pages handed out but not yet written are not counted as used (every byte
     * handed out is taken to be written, as NumPy arrays nearly always are). */
    h->reading = info;
    h->lazy_reused = vram__pages_lazy_reused_total();
    h->unfaulted = vram__pages_unfaulted(pool);
    uint64_t overstated = h->lazy_reused + h->unfaulted;
    h->room = info.available > overstated ? info.available - overstated : 0;
    h->read_ns = now;
    h->mapped_since = size;
    h->reading_valid = 1;
    if (need <= h->room) return VRAM_OK;
    h->reading_valid = 0; /* the ladder is about to free memory: read again on the retry */
    h->rejected = 1;
    h->refused_size = size;
    pool->stats.num_host_memory_rejections++;
    return VRAM_ERR_OOM;
}

void vram__host_enforce_cache_limit(vram_pool_t *pool, uint64_t context) {
    while (vram__over_cache_limit(pool)) {
        vram__segment_t *oldest = NULL;
        for (vram__segment_t *seg = pool->segments; seg; seg = seg->next)
            if (vram__is_whole_free(seg->head) && (!oldest || seg->freed_at < oldest->freed_at)) oldest = seg;
        if (!oldest) return;
        pool->stats.num_host_cache_limit_releases++;
        vram__release_block(pool, oldest->head, context);
    }
}
