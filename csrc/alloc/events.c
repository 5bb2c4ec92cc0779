/* events.c — record_stream and deferred reuse.
 *
 * A block used on streams other than its own is not reused when freed: one event is recorded
 * on each of those streams, and the block returns to the free index once all have completed.
 * Completion is polled at the start of each malloc (PyTorch's process_events), one FIFO per
 * stream, stopping at the first unfinished event of each stream. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

vram_status_t vram_record_stream(vram_pool_t *pool, void *ptr, vram_stream_t stream) {
    vram__lock(&pool->lock);
    vram__block_t *block = vram__ptrmap_get(&pool->live, (uintptr_t)ptr);
    vram_status_t status = VRAM_OK;
    if (!block) {
        char name[32];
        vram_device_format(pool->device, name, sizeof name);
        status = vram__fail(VRAM_ERR_INVALID_ARG, "record_stream: pointer %p is not a live allocation of vramkit on %s",
                            ptr, name);
        goto done;
    }
    if (stream == block->stream) goto done; /* its own stream orders itself */
    for (uint32_t i = 0; i < block->num_stream_uses; i++)
        if (block->stream_uses[i] == stream) goto done;
    if (block->num_stream_uses == block->cap_stream_uses) {
        uint32_t cap = block->cap_stream_uses ? block->cap_stream_uses * 2 : 4;
        vram_stream_t *uses = realloc(block->stream_uses, cap * sizeof *uses);
        if (!uses) {
            status = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory recording a stream use");
            goto done;
        }
        block->stream_uses = uses;
        block->cap_stream_uses = cap;
    }
    block->stream_uses[block->num_stream_uses++] = stream;
done:
    vram__unlock(&pool->lock);
    return status;
}

static vram__stream_queue_t *queue_for(vram_pool_t *pool, vram_stream_t stream) {
    for (uint64_t i = 0; i < pool->num_queues; i++)
        if (pool->queues[i].stream == stream) return &pool->queues[i];
    if (pool->num_queues == pool->cap_queues) {
        uint64_t cap = pool->cap_queues ? pool->cap_queues * 2 : 4;
        vram__stream_queue_t *queues = realloc(pool->queues, cap * sizeof *queues);
        if (!queues) return NULL;
        pool->queues = queues;
        pool->cap_queues = cap;
    }
    vram__stream_queue_t *q = &pool->queues[pool->num_queues++];
    memset(q, 0, sizeof *q);
    q->stream = stream;
    return q;
}

static int queue_reserve(vram__stream_queue_t *q, uint64_t extra) {
    if (q->count + extra <= q->capacity) return 0;
    uint64_t cap = q->capacity ? q->capacity : 16;
    while (cap < q->count + extra) cap *= 2;
    vram__pending_t *items = malloc(cap * sizeof *items);
    if (!items) return -1;
    for (uint64_t i = 0; i < q->count; i++) items[i] = q->items[(q->head + i) % q->capacity];
    free(q->items);
    q->items = items;
    q->capacity = cap;
    q->head = 0;
    return 0;
}

/* Room was reserved by vram__reserve_events. */
static void queue_push(vram__stream_queue_t *q, void *event, vram__block_t *block) {
    q->items[(q->head + q->count) % q->capacity] = (vram__pending_t){event, block};
    q->count++;
}

static vram__pending_t queue_pop(vram__stream_queue_t *q) {
    vram__pending_t item = q->items[q->head];
    q->head = (q->head + 1) % q->capacity;
    q->count--;
    return item;
}

vram_status_t vram__reserve_events(vram_pool_t *pool, const vram__block_t *block) {
    for (uint32_t i = 0; i < block->num_stream_uses; i++) {
        vram__stream_queue_t *q = queue_for(pool, block->stream_uses[i]);
        if (!q || queue_reserve(q, 1) != 0)
            return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory queueing a stream event");
    }
    return VRAM_OK;
}

void vram__insert_events(vram_pool_t *pool, vram__block_t *block) {
    for (uint32_t i = 0; i < block->num_stream_uses; i++) {
        vram_stream_t stream = block->stream_uses[i];
        void *event = NULL;
        /* If no event can be recorded, queue a NULL one: "synchronize this stream first". The
         * block is never reused before one of the two has shown the stream's work finished. */
        if (pool->backend->event_record(pool->ctx, stream, &event) != VRAM_OK) event = NULL;
        queue_push(queue_for(pool, stream), event, block);
        block->event_count++;
        pool->num_pending++;
    }
    block->num_stream_uses = 0;
}

/* Has the work behind this entry finished? Waits only for a NULL ("synchronize") entry. */
static int settled(vram_pool_t *pool, vram_stream_t stream, void *event, int wait) {
    int done = 0;
    if (!event) return pool->backend->synchronize(pool->ctx, stream) == VRAM_OK;
    if (wait) return pool->backend->event_synchronize(pool->ctx, event) == VRAM_OK;
    return pool->backend->event_query(pool->ctx, event, &done) == VRAM_OK && done;
}

static void event_done(vram_pool_t *pool, vram__pending_t *item) {
    if (item->event) pool->backend->event_destroy(pool->ctx, item->event);
    pool->num_pending--;
    if (--item->block->event_count == 0) vram__free_block(pool, item->block, 0);
}

void vram__process_events(vram_pool_t *pool) {
    for (uint64_t i = 0; i < pool->num_queues; i++) {
        vram__stream_queue_t *q = &pool->queues[i];
        /* A failed query counts as unfinished; a later synchronize settles it. */
        while (q->count && settled(pool, q->stream, q->items[q->head].event, 0)) {
            vram__pending_t item = queue_pop(q);
            event_done(pool, &item);
        }
    }
}

void vram__synchronize_and_free_events(vram_pool_t *pool) {
    pool->stats.num_sync_all_streams++;
    for (uint64_t i = 0; i < pool->num_queues; i++) {
        vram__stream_queue_t *q = &pool->queues[i];
        /* Entries whose wait fails stay queued, in order: their blocks must not be reused. */
        for (uint64_t n = q->count; n > 0; n--) {
            vram__pending_t item = queue_pop(q);
            if (settled(pool, q->stream, item.event, 1)) event_done(pool, &item);
            else queue_push(q, item.event, item.block);
        }
    }
}

void vram__free_queues(vram_pool_t *pool) {
    for (uint64_t i = 0; i < pool->num_queues; i++) free(pool->queues[i].items);
    free(pool->queues);
    pool->queues = NULL;
    pool->num_queues = pool->cap_queues = 0;
}

vram_status_t vram_pool_synchronize(vram_pool_t *pool, vram_stream_t stream) {
    /* Wait without the pool lock, so other threads keep allocating meanwhile. */
    vram_status_t status = pool->backend->synchronize(pool->ctx, stream);
    if (status != VRAM_OK) return status;
    vram__lock(&pool->lock);
    if (pool->num_pending) vram__process_events(pool);
    if (vram__over_cache_limit(pool)) vram__host_enforce_cache_limit(pool, 0);
    vram__unlock(&pool->lock);
    return VRAM_OK;
}
