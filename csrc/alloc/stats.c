/* stats.c — reading and resetting the counters (their updates are inline in internal.h).
 * Resets follow torch.cuda.reset_peak_memory_stats / reset_accumulated_memory_stats. */
#include "internal.h"

#include <string.h>

#include "../util/error.h"

vram_status_t vram_get_stats(vram_pool_t *pool, vram_stats_t *out) {
    if (!out || out->size < sizeof(vram_stats_t))
        return vram__fail(VRAM_ERR_INVALID_ARG, "vram_get_stats: set out->size = sizeof(vram_stats_t) (%zu)",
                          sizeof(vram_stats_t));
    vram__lock(&pool->lock);
    *out = pool->stats;
    uint64_t cache_limit = pool->settings.host_cache_limit;
    out->host_cache_limit = cache_limit == UINT64_MAX ? -1 : (int64_t)cache_limit;
    out->host_reclaimable_bytes = (int64_t)(pool->host.reclaimable_units * VRAM__PAGE_UNIT);
    out->host_lazy_reused_bytes = (int64_t)(pool->host.lazy_reused_units * VRAM__PAGE_UNIT);
    out->host_untouched_bytes = (int64_t)(pool->host.fresh_units * VRAM__PAGE_UNIT);
    vram__unlock(&pool->lock);
    out->size = sizeof(vram_stats_t);
    out->version = VRAM_STATS_VERSION;
    return VRAM_OK;
}

static void reset_peak(vram_stat_t *stat) { stat->peak = stat->current; }
static void reset_accumulated(vram_stat_t *stat) { stat->allocated = stat->freed = 0; }

void vram_reset_peak(vram_pool_t *pool) {
    vram__lock(&pool->lock);
    vram_stats_t *s = &pool->stats;
#define RESET_ARRAY(key, label, is_bytes) \
    for (int t = 0; t < VRAM_STAT_TYPES; t++) reset_peak(&s->key[t]);
    VRAM_STAT_ARRAYS(RESET_ARRAY)
#undef RESET_ARRAY
#define RESET_SINGLE(key, label) reset_peak(&s->key);
    VRAM_STAT_SINGLES(RESET_SINGLE)
#undef RESET_SINGLE
    vram__unlock(&pool->lock);
}

void vram_reset_accumulated(vram_pool_t *pool) {
    vram__lock(&pool->lock);
    vram_stats_t *s = &pool->stats;
#define RESET_ARRAY(key, label, is_bytes) \
    for (int t = 0; t < VRAM_STAT_TYPES; t++) reset_accumulated(&s->key[t]);
    VRAM_STAT_ARRAYS(RESET_ARRAY)
#undef RESET_ARRAY
#define RESET_SINGLE(key, label) reset_accumulated(&s->key);
    VRAM_STAT_SINGLES(RESET_SINGLE)
#undef RESET_SINGLE
#define RESET_COUNTER(key) s->key = 0;
    VRAM_STAT_COUNTERS(RESET_COUNTER)
    VRAM_HOST_COUNTERS(RESET_COUNTER)
#undef RESET_COUNTER
    vram__unlock(&pool->lock);
}
