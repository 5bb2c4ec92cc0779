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

static int queue_push(vram__stream_queue_t *q, void *event, vram__block_t *block) {
    if (q->count == q->capacity) {
        uint64_t cap = q->capacity ? q->capacity * 2 : 16;
        vram__pending_t *items = malloc(cap * sizeof *items);
        if (!items) return -1;
        for (uint64_t i = 0; i < q->count; i++) items[i] = q->items[(q->head + i) % q->capacity];
        free(q->items);
        q->items = items;
        q->capacity = cap;
        q->head = 0;
    }
    q->items[(q->head + q->count) % q->capacity] = (vram__pending_t){event, block};
    q->count++;
    return 0;
}

static void event_done(vram_pool_t *pool, vram__pending_t *item) {
    pool->backend->event_destroy(pool->ctx, item->event);
    pool->num_pending--;
    if (--item->block->event_count == 0) vram__free_block(pool, item->block, 0);
}

vram_status_t vram__insert_events(vram_pool_t *pool, vram__block_t *block) {
    vram_status_t status = VRAM_OK;
    for (uint32_t i = 0; i < block->num_stream_uses; i++) {
        vram_stream_t stream = block->stream_uses[i];
        void *event = NULL;
        vram__stream_queue_t *q = queue_for(pool, stream);
        status = q ? pool->backend->event_record(pool->ctx, stream, &event)
                   : vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory queueing a stream event");
        if (status == VRAM_OK && queue_push(q, event, block) != 0) {
            pool->backend->event_destroy(pool->ctx, event);
            status = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory queueing a stream event");
        }
        if (status != VRAM_OK) {
            /* Could not defer: wait for that stream now instead, which is always safe. */
            vram_status_t sync = pool->backend->synchronize(pool->ctx, stream);
            if (sync != VRAM_OK) status = sync;
            continue;
        }
        block->event_count++;
        pool->num_pending++;
    }
    block->num_stream_uses = 0;
    if (block->event_count == 0) vram__free_block(pool, block, 0);
    /* The block is consistent either way; report a backend failure but not a fallback. */
    return status == VRAM_ERR_HOST_MEMORY ? VRAM_OK : status;
}

void vram__process_events(vram_pool_t *pool) {
    for (uint64_t i = 0; i < pool->num_queues; i++) {
        vram__stream_queue_t *q = &pool->queues[i];
        while (q->count) {
            vram__pending_t *item = &q->items[q->head];
            int done = 0;
            /* A failed query counts as unfinished; synchronize settles it later. */
            if (pool->backend->event_query(pool->ctx, item->event, &done) != VRAM_OK || !done) break;
            vram__pending_t copy = *item;
            q->head = (q->head + 1) % q->capacity;
            q->count--;
            event_done(pool, &copy);
        }
    }
}

void vram__synchronize_and_free_events(vram_pool_t *pool) {
    pool->stats.num_sync_all_streams++;
    for (uint64_t i = 0; i < pool->num_queues; i++) {
        vram__stream_queue_t *q = &pool->queues[i];
        while (q->count) {
            vram__pending_t copy = q->items[q->head];
            q->head = (q->head + 1) % q->capacity;
            q->count--;
            (void)pool->backend->event_synchronize(pool->ctx, copy.event);
            event_done(pool, &copy);
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
    vram__unlock(&pool->lock);
    return VRAM_OK;
}
