/* blocks.c — block structs from per-pool slabs.
 *
 * Splitting and merging create and drop block structs on every cached alloc/free; a slab
 * with a free list keeps that to a pointer pop. Callers reserve before they change any
 * state, so running out of host memory never leaves a half-done operation. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

#define BLOCKS_PER_CHUNK 256

vram_status_t vram__reserve_blocks(vram_pool_t *pool, uint64_t needed) {
    if (pool->num_spare >= needed) return VRAM_OK;
    if (pool->num_chunks == pool->cap_chunks) {
        uint64_t cap = pool->cap_chunks ? pool->cap_chunks * 2 : 16;
        void **chunks = realloc(pool->block_chunks, cap * sizeof *chunks);
        if (!chunks) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for allocator bookkeeping");
        pool->block_chunks = chunks;
        pool->cap_chunks = cap;
    }
    vram__block_t *chunk = calloc(BLOCKS_PER_CHUNK, sizeof *chunk);
    if (!chunk) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for allocator bookkeeping");
    pool->block_chunks[pool->num_chunks++] = chunk;
    for (int i = 0; i < BLOCKS_PER_CHUNK; i++) vram__block_delete(pool, &chunk[i]);
    return VRAM_OK;
}

vram__block_t *vram__block_new(vram_pool_t *pool) {
    vram__block_t *block = pool->spare_blocks;
    pool->spare_blocks = block->next;
    pool->num_spare--;
    *block = (vram__block_t){0};
    return block;
}

void vram__block_delete(vram_pool_t *pool, vram__block_t *block) {
    if (block->stream_uses) {
        free(block->stream_uses);
        block->stream_uses = NULL;
    }
    block->next = pool->spare_blocks;
    pool->spare_blocks = block;
    pool->num_spare++;
}

void vram__free_all_blocks(vram_pool_t *pool) {
    for (uint64_t i = 0; i < pool->num_chunks; i++) {
        vram__block_t *chunk = pool->block_chunks[i];
        for (int j = 0; j < BLOCKS_PER_CHUNK; j++) free(chunk[j].stream_uses);
        free(chunk);
    }
    free(pool->block_chunks);
    pool->block_chunks = NULL;
    pool->num_chunks = pool->cap_chunks = 0;
    pool->spare_blocks = NULL;
    pool->num_spare = 0;
}
