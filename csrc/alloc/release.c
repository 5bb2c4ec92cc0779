/* release.c — giving cached segments back to the backend: empty_cache, the OOM retry
 * paths, and the garbage collector behind garbage_collection_threshold. Only segments that
 * are wholly free can go back: one live block pins its whole segment. Expandable segments
 * give back free pages instead (expandable.c); only empty_cache and the OOM ladder do. */
#include "internal.h"

#include <limits.h>
#include <stdlib.h>

#include "../util/error.h"

void vram__release_block(vram_pool_t *pool, vram__block_t *block, uint64_t context) {
    vram__segment_t *seg = block->segment;
    int is_small = seg->is_small;
    vram__index_remove(vram__index_for(pool, is_small), block);
    vram__whole_free_count(pool, seg, 0);
    vram__pages_drop(pool, seg);
    pool->backend->segment_free(pool->ctx, seg->addr, seg->size);
    vram__stat_array_decrease(pool->stats.segment, is_small, 1);
    vram__stat_array_decrease(pool->stats.reserved_bytes, is_small, (int64_t)seg->size);
    if (seg->oversize) vram__stat_decrease(&pool->stats.oversize_segments, 1);
    pool->stats.num_device_free++;
    vram__trace(pool, VRAM_TRACE_SEGMENT_FREE, seg->addr, seg->size, seg->stream, context, 0);
    vram__segment_remove(pool, seg); /* block, wholly free, is the segment's only block */
}

void vram__release_cached_blocks(vram_pool_t *pool, uint64_t context) {
    vram__synchronize_and_free_events(pool);
    for (vram__segment_t *seg = pool->segments, *next; seg; seg = next) {
        next = seg->next;
        if (vram__is_whole_free(seg->head)) vram__release_block(pool, seg->head, context);
    }
    vram__expandable_release_all(pool, context);
}

/* Process-wide, as torch's toggle is, and read without a pool lock on every free: the user's
 * flag, and how many caching_allocator_disabled() blocks are active on any thread. A block
 * that saved and restored the flag would, with two threads (A enters, B enters, A exits, B
 * exits), restore "off" last and leave caching off for good; a count cannot, and the flag
 * stays the user's default, which applies again once the last block ends. */
static int caching_flag = 1;
static int disabled_blocks;

void vram_set_caching_enabled(int enabled) { __atomic_store_n(&caching_flag, enabled ? 1 : 0, __ATOMIC_RELAXED); }

int vram_caching_enabled(void) {
    return __atomic_load_n(&caching_flag, __ATOMIC_RELAXED) && __atomic_load_n(&disabled_blocks, __ATOMIC_RELAXED) == 0;
}

int vram_caching_disabled_blocks(void) { return __atomic_load_n(&disabled_blocks, __ATOMIC_RELAXED); }

/* Compare-and-swap loops, so neither an overflow nor an unmatched exit ever changes the count. */
vram_status_t vram_caching_disable_enter(void) {
    int n = __atomic_load_n(&disabled_blocks, __ATOMIC_RELAXED);
    do {
        if (n == INT_MAX)
            return vram__fail(VRAM_ERR_INVALID_ARG, "%d caching-disabled blocks are already active: the most there can "
                                                    "be at once", n);
    } while (!__atomic_compare_exchange_n(&disabled_blocks, &n, n + 1, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
    return VRAM_OK;
}

vram_status_t vram_caching_disable_exit(void) {
    int n = __atomic_load_n(&disabled_blocks, __ATOMIC_RELAXED);
    do {
        if (n == 0)
            return vram__fail(VRAM_ERR_INVALID_ARG, "no caching-disabled block is active: each exit must match an "
                                                    "earlier enter (caching_allocator_disabled() does both)");
    } while (!__atomic_compare_exchange_n(&disabled_blocks, &n, n - 1, 1, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
    return VRAM_OK;
}

vram_status_t vram_empty_cache(vram_pool_t *pool, uint64_t *released) {
    vram__lock(&pool->lock);
    int64_t before = pool->stats.reserved_bytes[VRAM_STAT_ALL].current;
    vram__release_cached_blocks(pool, 0);
    int64_t after = pool->stats.reserved_bytes[VRAM_STAT_ALL].current;
    vram__unlock(&pool->lock);
    if (released) *released = (uint64_t)(before - after);
    return VRAM_OK;
}

/* With max_split_size set, oversize cached blocks are freed to make room: the smallest one
 * that covers the request, else the largest ones first until enough is freed. */
int vram__release_available_cached_blocks(vram_pool_t *pool, vram__free_index_t *index, vram_stream_t stream,
                                          uint64_t rounded, uint64_t context) {
    uint64_t max_split = pool->settings.max_split_size;
    if (max_split == VRAM_UNLIMITED) return 0;
    uint64_t want = rounded < max_split ? max_split : rounded;
    vram__block_t *fit = vram__index_lower_bound(index, stream, want);
    if (fit && fit->stream == stream && vram__is_whole_free(fit)) {
        vram__release_block(pool, fit, context);
        return 1;
    }
    uint64_t released = 0;
    vram__block_t *candidate = vram__index_before(index, stream, want, 0);
    while (released < want && candidate && candidate->stream == stream && candidate->size >= max_split) {
        vram__block_t *before = vram__index_before(index, candidate->stream, candidate->size, candidate->addr);
        if (vram__is_whole_free(candidate)) {
            released += candidate->size;
            vram__release_block(pool, candidate, context);
        }
        candidate = before;
    }
    return released >= want;
}

/* PyTorch's garbage_collect_cached_blocks: above threshold × allowed memory, free whole
 * large-pool segments whose age (free-index lookups since they became free) is at least the
 * average, repeating until the excess is reclaimed. Where PyTorch needs a memory fraction for
 * this, we fall back to the device's capacity, so the option works on its own. */
void vram__garbage_collect(vram_pool_t *pool, uint64_t context) {
    uint64_t allowed = pool->settings.allowed_bytes;
    if (allowed > pool->total_capacity) allowed = pool->total_capacity;
    uint64_t threshold = (uint64_t)(pool->settings.garbage_collection_threshold * (double)allowed);
    uint64_t reserved = (uint64_t)pool->stats.reserved_bytes[VRAM_STAT_ALL].current;
    if (reserved <= threshold) return;
    uint64_t target = reserved - threshold, reclaimed = 0, now = pool->large.lookups;
    uint64_t total_age = 0, freeable = 0;
    for (vram__segment_t *seg = pool->segments; seg; seg = seg->next) {
        if (!seg->is_small && vram__is_whole_free(seg->head)) {
            total_age += now - seg->head->gc_count_base;
            freeable++;
        }
    }
    int freed_one = 1;
    while (reclaimed < target && freed_one && freeable > 0) {
        double age_threshold = (double)total_age / (double)freeable;
        freed_one = 0;
        for (vram__segment_t *seg = pool->segments, *next; seg; seg = next) {
            next = seg->next;
            vram__block_t *b = seg->head;
            if (seg->is_small || !vram__is_whole_free(b)) continue;
            uint64_t age = now - b->gc_count_base;
            if ((double)age < age_threshold) continue;
            freed_one = 1;
            reclaimed += seg->size;
            total_age -= age;
            freeable--;
            vram__release_block(pool, b, context);
        }
    }
}
