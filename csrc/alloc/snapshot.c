/* snapshot.c — copy the segments, blocks and history out under one lock, so the Python
 * layer can build PyTorch's snapshot dicts without holding the pool (building Python objects
 * can run the garbage collector, which may free vramkit memory and re-enter the pool). */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

static int by_address(const void *a, const void *b) {
    const vram_snapshot_segment_t *x = a, *y = b;
    return (x->address > y->address) - (x->address < y->address);
}

/* Copy the blocks from `b` up to the next unmapped block (the whole segment when classic)
 * as one snapshot segment; returns where the copy stopped. */
static vram__block_t *copy_run(vram_snapshot_t *snap, const vram__segment_t *seg, vram__block_t *b,
                               vram_snapshot_segment_t *s, uint64_t *bi) {
    s->address = b->addr;
    s->stream = seg->stream;
    s->is_small = seg->is_small;
    s->is_expandable = seg->expandable;
    s->first_block = *bi;
    for (; b && !b->unmapped; b = b->next, (*bi)++) {
        vram_snapshot_block_t *o = &snap->blocks[*bi];
        o->address = b->addr;
        o->size = b->size;
        o->requested_size = b->requested;
        o->state = b->allocated ? 1u : (b->event_count > 0 ? 2u : 0u);
        o->context = b->context;
        s->total_size += b->size;
        if (b->allocated) s->allocated_size += b->size;
        if (b->allocated || b->event_count > 0) {
            s->active_size += b->size;
            s->requested_size += b->requested;
        }
    }
    s->num_blocks = *bi - s->first_block;
    return b;
}

vram_status_t vram_pool_snapshot(vram_pool_t *pool, vram_snapshot_t **out) {
    *out = NULL;
    vram_snapshot_t *snap = calloc(1, sizeof *snap);
    if (!snap) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for a snapshot");
    snap->device = pool->device;
    vram__lock(&pool->lock);
    /* An expandable segment is reported as PyTorch reports it: one segment per run of mapped
     * blocks, unmapped space left out. */
    uint64_t nseg = 0, nblk = 0;
    for (vram__segment_t *seg = pool->segments; seg; seg = seg->next) {
        if (!seg->expandable) nseg++;
        for (vram__block_t *b = seg->head; b; b = b->next) {
            if (b->unmapped) continue;
            nblk++;
            if (seg->expandable && (!b->prev || b->prev->unmapped)) nseg++;
        }
    }
    const vram__history_t *h = &pool->history;
    uint64_t ntrace = h->written < h->capacity ? h->written : h->capacity;
    snap->segments = calloc(nseg ? nseg : 1, sizeof *snap->segments);
    snap->blocks = calloc(nblk ? nblk : 1, sizeof *snap->blocks);
    snap->trace = calloc(ntrace ? ntrace : 1, sizeof *snap->trace);
    if (!snap->segments || !snap->blocks || !snap->trace) {
        vram__unlock(&pool->lock);
        vram_snapshot_free(snap);
        return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for a snapshot");
    }
    uint64_t bi = 0, si = 0;
    for (vram__segment_t *seg = pool->segments; seg; seg = seg->next) {
        for (vram__block_t *head = seg->head; head;) {
            if (head->unmapped) {
                head = head->next;
                continue;
            }
            head = copy_run(snap, seg, head, &snap->segments[si++], &bi);
        }
    }
    for (uint64_t i = 0; i < ntrace; i++) snap->trace[i] = h->entries[(h->written - ntrace + i) % h->capacity];
    vram__unlock(&pool->lock);
    snap->num_segments = nseg;
    snap->num_blocks = nblk;
    snap->num_trace = ntrace;
    /* Blocks stay grouped per segment; only the segment order changes, so ranges hold. */
    qsort(snap->segments, nseg, sizeof *snap->segments, by_address);
    *out = snap;
    return VRAM_OK;
}

void vram_snapshot_free(vram_snapshot_t *snap) {
    if (!snap) return;
    free(snap->segments);
    free(snap->blocks);
    free(snap->trace);
    free(snap);
}
