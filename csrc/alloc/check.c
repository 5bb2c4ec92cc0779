/* check.c — vram_pool_check: walk every segment, block, index and counter and compare them.
 * Tests call it after every operation of randomized runs, so it reports the first violation
 * precisely rather than asserting. Cost: O(blocks x pending events); pending events are few. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

#include "../util/error.h"

#define CORRUPT(...) vram__fail(VRAM_ERR_CORRUPT, __VA_ARGS__)

typedef struct recount {
    int64_t allocation, allocated_bytes, active, active_bytes, requested_bytes;
    int64_t segment, reserved_bytes, inactive_split, inactive_split_bytes;
    int64_t free_blocks, whole_free_segments, whole_free_bytes;
} recount_t;

static uint64_t pending_for(const vram_pool_t *pool, const vram__block_t *block) {
    uint64_t n = 0;
    for (uint64_t i = 0; i < pool->num_queues; i++) {
        const vram__stream_queue_t *q = &pool->queues[i];
        for (uint64_t j = 0; j < q->count; j++)
            if (q->items[(q->head + j) % q->capacity].block == block) n++;
    }
    return n;
}

static vram_status_t check_block(const vram_pool_t *pool, const vram__segment_t *seg, const vram__block_t *b,
                                 recount_t *rc, int64_t *oversize_allocs) {
    unsigned long long a = (unsigned long long)b->addr;
    if (b->segment != seg) return CORRUPT("block 0x%llx points at the wrong segment", a);
    if (b->stream != seg->stream) return CORRUPT("block 0x%llx has a stream other than its segment's", a);
    if (b->size == 0 || b->size % VRAM_MIN_BLOCK) return CORRUPT("block 0x%llx has size %llu, not a positive multiple of 512", a, (unsigned long long)b->size);
    if (b->next && b->next->prev != b) return CORRUPT("block 0x%llx: next->prev does not point back", a);
    int awaiting = b->event_count > 0;
    if (b->allocated + b->in_index + awaiting + b->unmapped != 1)
        return CORRUPT("block 0x%llx is in %d states (allocated %d, free %d, awaiting %d, unmapped %d); it must be in "
                       "exactly one", a, b->allocated + b->in_index + awaiting + b->unmapped, b->allocated, b->in_index,
                       awaiting, b->unmapped);
    if (b->unmapped && !seg->expandable) return CORRUPT("block 0x%llx is unmapped outside an expandable segment", a);
    if (b->event_count < 0) return CORRUPT("block 0x%llx has a negative event count", a);
    if ((uint64_t)b->event_count != pending_for(pool, b))
        return CORRUPT("block 0x%llx counts %d events but %llu are queued", a, b->event_count,
                       (unsigned long long)pending_for(pool, b));
    if (b->in_index && b->next && b->next->in_index)
        return CORRUPT("free blocks 0x%llx and 0x%llx are adjacent but not merged", a, (unsigned long long)b->next->addr);
    if (b->allocated) {
        if (vram__ptrmap_get(&pool->live, b->addr) != b) return CORRUPT("allocated block 0x%llx is missing from the pointer map", a);
        if (b->requested == 0 || b->requested > b->size) return CORRUPT("allocated block 0x%llx has requested size %llu for a %llu-byte block", a, (unsigned long long)b->requested, (unsigned long long)b->size);
        if (b->num_stream_uses > 0 && b->stream_uses == NULL) return CORRUPT("block 0x%llx lost its stream uses", a);
        rc->allocation++;
        rc->allocated_bytes += (int64_t)b->size;
        if (b->oversize) (*oversize_allocs)++;
    } else if (b->oversize) {
        return CORRUPT("block 0x%llx is not allocated but still counted as an oversize allocation", a);
    }
    if (b->allocated || awaiting) {
        rc->active++;
        rc->active_bytes += (int64_t)b->size;
        rc->requested_bytes += (int64_t)b->requested;
    }
    if (b->in_index) {
        rc->free_blocks++;
        if (vram__is_split(b) && !seg->expandable) { /* PyTorch leaves expandable segments out */
            rc->inactive_split++;
            rc->inactive_split_bytes += (int64_t)b->size;
        }
    }
    return VRAM_OK;
}

static vram_status_t check_stat(const char *name, const vram_stat_t *s, int64_t expected_current) {
    if (s->current != expected_current)
        return CORRUPT("counter %s.current is %lld but a recount gives %lld", name, (long long)s->current, (long long)expected_current);
    if (s->peak < s->current) return CORRUPT("counter %s.peak %lld is below current %lld", name, (long long)s->peak, (long long)s->current);
    return VRAM_OK;
}

/* The aggregate entry equals small + large for every field but peak. */
static vram_status_t check_array(const char *name, const vram_stat_t *array, int64_t small, int64_t large) {
    char label[64];
    static const char *const types[] = {"all", "small_pool", "large_pool"};
    const int64_t expected[3] = {small + large, small, large};
    for (int t = 0; t < VRAM_STAT_TYPES; t++) {
        snprintf(label, sizeof label, "%s.%s", name, types[t]);
        vram_status_t status = check_stat(label, &array[t], expected[t]);
        if (status != VRAM_OK) return status;
    }
    const vram_stat_t *all = &array[VRAM_STAT_ALL], *s = &array[VRAM_STAT_SMALL_POOL], *l = &array[VRAM_STAT_LARGE_POOL];
    if (all->allocated != s->allocated + l->allocated || all->freed != s->freed + l->freed)
        return CORRUPT("counter %s.all accumulates differently from small_pool + large_pool", name);
    return VRAM_OK;
}

static vram_status_t check_locked(vram_pool_t *pool) {
    recount_t rc[2]; /* [0] large, [1] small */
    memset(rc, 0, sizeof rc);
    int64_t oversize_allocs = 0, oversize_segs = 0;
    vram_status_t status;
    const vram__segment_t *prev_seg = NULL;
    for (const vram__segment_t *seg = pool->segments; seg; prev_seg = seg, seg = seg->next) {
        unsigned long long sa = (unsigned long long)seg->addr;
        if (seg->prev != prev_seg) return CORRUPT("segment list links broken at 0x%llx", sa);
        if (!seg->head || seg->head->prev) return CORRUPT("segment 0x%llx has no proper first block", sa);
        if (seg->is_small && !seg->expandable && seg->size != VRAM_SMALL_BUFFER) return CORRUPT("small-pool segment 0x%llx has size %llu, not 2 MiB", sa, (unsigned long long)seg->size);
        recount_t *r = &rc[seg->is_small ? 1 : 0];
        if (seg->expandable) { /* reserved = mapped pages; PyTorch's segment counter leaves them out */
            if ((status = vram__expandable_check(seg)) != VRAM_OK) return status;
            if (seg->oversize) return CORRUPT("expandable segment 0x%llx is counted as oversize", sa);
            r->reserved_bytes += (int64_t)seg->mapped;
        } else {
            r->segment++;
            r->reserved_bytes += (int64_t)seg->size;
        }
        if (seg->oversize) oversize_segs++;
        uintptr_t expect = seg->addr;
        for (const vram__block_t *b = seg->head; b; b = b->next) {
            if (b->addr != expect)
                return CORRUPT("segment 0x%llx: block at 0x%llx where 0x%llx was expected (blocks must tile the segment)",
                               sa, (unsigned long long)b->addr, (unsigned long long)expect);
            status = check_block(pool, seg, b, r, &oversize_allocs);
            if (status != VRAM_OK) return status;
            expect += b->size;
        }
        if (expect != seg->addr + seg->size)
            return CORRUPT("segment 0x%llx: blocks cover %llu bytes of %llu", sa,
                           (unsigned long long)(expect - seg->addr), (unsigned long long)seg->size);
        if (vram__is_whole_free(seg->head)) {
            r->whole_free_segments++;
            r->whole_free_bytes += (int64_t)seg->size;
        }
    }
    if ((uint64_t)(rc[0].whole_free_segments + rc[1].whole_free_segments) != pool->whole_free_segments ||
        (uint64_t)(rc[0].whole_free_bytes + rc[1].whole_free_bytes) != pool->whole_free_bytes)
        return CORRUPT("%llu segments (%llu bytes) are counted wholly free but %lld (%lld bytes) are",
                       (unsigned long long)pool->whole_free_segments, (unsigned long long)pool->whole_free_bytes,
                       (long long)(rc[0].whole_free_segments + rc[1].whole_free_segments),
                       (long long)(rc[0].whole_free_bytes + rc[1].whole_free_bytes));
    if ((status = vram__pages_check(pool)) != VRAM_OK) return status;
    uint64_t indexed;
    for (int small = 0; small <= 1; small++) {
        const vram__free_index_t *index = small ? &pool->small : &pool->large;
        if ((status = vram__index_check(index, &indexed)) != VRAM_OK) return status;
        if ((int64_t)indexed != rc[small].free_blocks)
            return CORRUPT("the %s pool's free index holds %llu blocks but %lld free blocks exist", small ? "small" : "large",
                           (unsigned long long)indexed, (long long)rc[small].free_blocks);
    }
    if ((int64_t)pool->live.count != rc[0].allocation + rc[1].allocation)
        return CORRUPT("the pointer map holds %llu entries but %lld blocks are allocated",
                       (unsigned long long)pool->live.count, (long long)(rc[0].allocation + rc[1].allocation));
    uint64_t queued = 0;
    for (uint64_t i = 0; i < pool->num_queues; i++) queued += pool->queues[i].count;
    if (queued != pool->num_pending) return CORRUPT("%llu events are queued but %llu are counted as pending", (unsigned long long)queued, (unsigned long long)pool->num_pending);

    const vram_stats_t *s = &pool->stats;
#define CHECK_ARRAY(key, label, is_bytes) \
    if ((status = check_array(#key, s->key, rc[1].key, rc[0].key)) != VRAM_OK) return status;
    VRAM_STAT_ARRAYS(CHECK_ARRAY)
#undef CHECK_ARRAY
    if ((status = check_stat("oversize_allocations", &s->oversize_allocations, oversize_allocs)) != VRAM_OK) return status;
    if ((status = check_stat("oversize_segments", &s->oversize_segments, oversize_segs)) != VRAM_OK) return status;
    return VRAM_OK;
}

vram_status_t vram_pool_check(vram_pool_t *pool) {
    vram__lock(&pool->lock);
    vram_status_t status = check_locked(pool);
    vram__unlock(&pool->lock);
    return status;
}
