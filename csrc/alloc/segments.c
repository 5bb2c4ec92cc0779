/* segments.c — the bookkeeping that classic segments (pool.c) and expandable ones
 * (expandable.c) share: a segment entering and leaving the pool's list with the block that
 * tiles it, and the edits of a segment's block chain that splitting and merging make.
 * Written once so both layouts keep the same invariants (vram_pool_check verifies them). */
#include "internal.h"

#include <stdlib.h>

vram__block_t *vram__segment_add(vram_pool_t *pool, vram__segment_t *seg, uintptr_t addr, uint64_t size,
                                 vram_stream_t stream, int is_small) {
    vram__block_t *block = vram__block_new(pool);
    block->addr = addr;
    block->size = size;
    block->stream = stream;
    block->segment = seg;
    seg->addr = addr;
    seg->size = size;
    seg->stream = stream;
    seg->is_small = (uint8_t)is_small;
    seg->head = block;
    seg->prev = NULL;
    seg->next = pool->segments;
    if (pool->segments) pool->segments->prev = seg;
    pool->segments = seg;
    return block;
}

void vram__segment_remove(vram_pool_t *pool, vram__segment_t *seg) {
    if (seg->prev) seg->prev->next = seg->next;
    else pool->segments = seg->next;
    if (seg->next) seg->next->prev = seg->prev;
    vram__block_delete(pool, seg->head);
    free(seg);
}

vram__block_t *vram__block_splice(vram_pool_t *pool, vram__block_t *block, uintptr_t addr, uint64_t size, int after) {
    vram__block_t *n = vram__block_new(pool);
    n->addr = addr;
    n->size = size;
    n->stream = block->stream;
    n->segment = block->segment;
    if (after) {
        n->prev = block;
        n->next = block->next;
        if (n->next) n->next->prev = n;
        block->next = n;
    } else {
        n->next = block;
        n->prev = block->prev;
        if (n->prev) n->prev->next = n;
        else block->segment->head = n;
        block->prev = n;
    }
    return n;
}

void vram__block_absorb(vram__block_t *block, vram__block_t *gone) {
    block->size += gone->size;
    if (gone == block->prev) {
        block->addr = gone->addr;
        block->prev = gone->prev;
        if (block->prev) block->prev->next = block;
        else block->segment->head = block;
    } else {
        block->next = gone->next;
        if (block->next) block->next->prev = block;
    }
}

/* The merged block takes the index node of the last neighbour it absorbs: a replace is one
 * descent where a remove and an insert are two, and free is the allocator's hot path. */
int vram__merge_free(vram_pool_t *pool, vram__block_t *block, uint64_t *absorbed_bytes) {
    vram__free_index_t *index = vram__index_for(pool, block->segment->is_small);
    vram__block_t *prev = block->prev, *next = block->next;
    int merge_prev = prev && prev->in_index, merge_next = next && next->in_index;
    uint64_t bytes = (merge_prev ? prev->size : 0) + (merge_next ? next->size : 0);
    if (absorbed_bytes) *absorbed_bytes = bytes;
    if (merge_prev) { /* [prev block] -> [block] */
        vram__block_absorb(block, prev);
        if (merge_next) vram__index_remove(index, prev);
        else vram__index_replace(index, prev, block);
        vram__block_delete(pool, prev);
    }
    if (merge_next) { /* [block next] -> [block] */
        vram__block_absorb(block, next);
        vram__index_replace(index, next, block);
        vram__block_delete(pool, next);
    }
    if (!merge_prev && !merge_next) vram__index_insert(index, block);
    return merge_prev + merge_next;
}
