/* settings.c — per-pool limits and options, changed at run time under the pool lock. */
#include "internal.h"

#include "../util/error.h"

vram_status_t vram_mem_get_info(vram_pool_t *pool, uint64_t *free_bytes, uint64_t *total_bytes) {
    vram__lock(&pool->lock);
    vram_status_t status = pool->backend->mem_info(pool->ctx, free_bytes, total_bytes);
    /* As the host check sees it: the kernel counts pages reused after MADV_FREE as free until
     * it rescans them, and pages handed out but not yet written not at all. */
    if (status == VRAM_OK && vram_pool_is_host(pool)) {
        uint64_t overstated = vram__pages_lazy_reused_total() + vram__pages_unfaulted(pool);
        *free_bytes = *free_bytes > overstated ? *free_bytes - overstated : 0;
    }
    vram__unlock(&pool->lock);
    return status;
}

vram_status_t vram_set_memory_fraction(vram_pool_t *pool, double fraction) {
    if (!(fraction >= 0.0 && fraction <= 1.0))
        return vram__fail(VRAM_ERR_INVALID_ARG, "invalid memory fraction %g: allowed range is 0 to 1", fraction);
    vram__lock(&pool->lock);
    pool->settings.memory_fraction = fraction;
    vram__settings_update_allowed(&pool->settings, pool->total_capacity);
    vram__unlock(&pool->lock);
    return VRAM_OK;
}

vram_status_t vram_set_memory_limit(vram_pool_t *pool, uint64_t limit_bytes) {
    if (limit_bytes != VRAM_NO_LIMIT && limit_bytes >= VRAM_MAX_REQUEST)
        return vram__fail(VRAM_ERR_INVALID_ARG, "memory limit %llu is absurd: limits must be below 2**62 bytes",
                          (unsigned long long)limit_bytes);
    vram__lock(&pool->lock);
    pool->settings.memory_limit = limit_bytes;
    vram__settings_update_allowed(&pool->settings, pool->total_capacity);
    vram__unlock(&pool->lock);
    return VRAM_OK;
}

/* expandable_segments changes how every segment is laid out, so it changes only while no
 * memory is in use: the cache (all of it free then) is released first, and the next
 * allocation starts with the new layout. With blocks live the change is refused, naming the
 * rule; nothing changes. */
static vram_status_t switch_expandable(vram_pool_t *pool, const vram_settings_t *settings) {
    if (settings->expandable_segments == pool->settings.expandable_segments) return VRAM_OK;
    char name[32];
    vram_device_format(pool->device, name, sizeof name);
    if (settings->expandable_segments && !pool->backend->range_reserve)
        return vram__fail(VRAM_ERR_INVALID_ARG, "expandable_segments is not supported by the %s backend of %s",
                          pool->backend->name, name);
    int64_t active = pool->stats.active[VRAM_STAT_ALL].current;
    if (active > 0) {
        char bytes[32];
        vram_format_size((uint64_t)pool->stats.active_bytes[VRAM_STAT_ALL].current, bytes, sizeof bytes);
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "expandable_segments can be changed only while no memory is in use on %s, but %lld "
                          "block%s (%s) %s allocated or awaiting other streams: free %s (and synchronize) first; "
                          "the cache is then released and the new layout applies to the next allocation",
                          name, (long long)active, active == 1 ? "" : "s", bytes, active == 1 ? "is" : "are",
                          active == 1 ? "it" : "them");
    }
    vram__release_cached_blocks(pool, 0);
    for (const vram__segment_t *seg = pool->segments; seg; seg = seg->next)
        if (seg->expandable != settings->expandable_segments)
            return vram__fail(VRAM_ERR_BACKEND,
                              "expandable_segments was not changed on %s: the backend did not release all of its "
                              "cached memory, and the two layouts cannot be mixed; call empty_cache() and retry",
                              name);
    return VRAM_OK;
}

vram_status_t vram_configure(vram_pool_t *pool, const char *conf) {
    vram__lock(&pool->lock);
    vram_settings_t settings = pool->settings;
    vram_status_t status = vram__settings_parse(conf, "vramkit.configure", &settings, vram_pool_is_host(pool), 1);
    if (status == VRAM_OK) status = switch_expandable(pool, &settings);
    if (status == VRAM_OK) {
        vram__settings_update_allowed(&settings, pool->total_capacity);
        pool->settings = settings;
        pool->stats.max_split_size =
            settings.max_split_size == VRAM_UNLIMITED ? -1 : (int64_t)settings.max_split_size;
        pool->host.reading_valid = 0; /* a new reserve or check applies from the next segment */
        /* A lower cache limit applies at once. */
        if (vram__over_cache_limit(pool)) vram__host_enforce_cache_limit(pool, 0);
    }
    vram__unlock(&pool->lock);
    return status;
}

vram_status_t vram_get_settings(vram_pool_t *pool, vram_settings_t *out) {
    vram__lock(&pool->lock);
    *out = pool->settings;
    vram__unlock(&pool->lock);
    return VRAM_OK;
}
