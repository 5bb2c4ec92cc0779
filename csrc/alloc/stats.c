/* stats.c — PyTorch's Stat semantics: increase raises current, peak and allocated; decrease
 * lowers current and raises freed. Resets follow reset_peak / reset_accumulated. */
#include "internal.h"

#include <string.h>

#include "../util/error.h"

void vram__stat_increase(vram_stat_t *stat, int64_t amount) {
    stat->current += amount;
    if (stat->current > stat->peak) stat->peak = stat->current;
    stat->allocated += amount;
}

void vram__stat_decrease(vram_stat_t *stat, int64_t amount) {
    stat->current -= amount;
    stat->freed += amount;
}

void vram__stat_array_increase(vram_stat_t *array, int is_small, int64_t amount) {
    vram__stat_increase(&array[VRAM_STAT_ALL], amount);
    vram__stat_increase(&array[is_small ? VRAM_STAT_SMALL_POOL : VRAM_STAT_LARGE_POOL], amount);
}

void vram__stat_array_decrease(vram_stat_t *array, int is_small, int64_t amount) {
    vram__stat_decrease(&array[VRAM_STAT_ALL], amount);
    vram__stat_decrease(&array[is_small ? VRAM_STAT_SMALL_POOL : VRAM_STAT_LARGE_POOL], amount);
}

/* A net change applied as one increase or one decrease, as PyTorch does for inactive_split,
 * so that "Tot Alloc" and "Tot Freed" match its figures. */
void vram__stat_array_change(vram_stat_t *array, int is_small, int64_t delta) {
    if (delta > 0) vram__stat_array_increase(array, is_small, delta);
    else if (delta < 0) vram__stat_array_decrease(array, is_small, -delta);
}

vram_status_t vram_get_stats(vram_pool_t *pool, vram_stats_t *out) {
    if (!out || out->size < sizeof(vram_stats_t))
        return vram__fail(VRAM_ERR_INVALID_ARG, "vram_get_stats: set out->size = sizeof(vram_stats_t) (%zu)",
                          sizeof(vram_stats_t));
    vram__lock(&pool->lock);
    *out = pool->stats;
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
#undef RESET_COUNTER
    vram__unlock(&pool->lock);
}
