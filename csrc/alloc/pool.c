/* pool.c — the caching allocator's malloc and free, following PyTorch's policy:
 * best fit within the request's stream, split what is left over, merge with free
 * neighbours on free, and draw a new segment only when the cache has nothing that fits. */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#include "../util/address_space.h"
#include "../util/error.h"

vram_status_t vram_pool_create(const vram_backend_t *backend, void *backend_ctx, vram_device_t device,
                               const char *conf, vram_pool_t **out) {
    *out = NULL;
    vram_settings_t settings;
    int host = backend->host_memory != NULL;
    vram__settings_default(&settings, host);
    vram_status_t status = vram__settings_parse(conf, "VRAMKIT_ALLOC_CONF", &settings, host, 0);
    if (status == VRAM_OK && settings.expandable_segments && !backend->range_reserve)
        status = vram__fail(VRAM_ERR_INVALID_ARG, "VRAMKIT_ALLOC_CONF: expandable_segments is not supported by the %s backend",
                            backend->name);
    if (status != VRAM_OK) goto fail;
    uint64_t free_bytes = 0, total = 0;
    status = backend->mem_info(backend_ctx, &free_bytes, &total);
    if (status != VRAM_OK) goto fail;

    vram_pool_t *pool = calloc(1, sizeof *pool);
    if (!pool) {
        status = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory creating a pool");
        goto fail;
    }
    if (vram__mutex_init(&pool->lock) != 0) {
        free(pool);
        status = vram__fail(VRAM_ERR_HOST_MEMORY, "could not create the pool's mutex");
        goto fail;
    }
    pool->backend = backend;
    pool->ctx = backend_ctx;
    pool->device = device;
    pool->total_capacity = total;
    pool->settings = settings;
    vram__settings_update_allowed(&pool->settings, total);
    pool->host.tracked = backend->release_pages != NULL;
    pool->small.is_small = 1;
    pool->small.rng = 0x2545F491u;
    pool->large.rng = 0x9E3779B9u;
    vram__ptrmap_init(&pool->live);
    pool->stats.size = sizeof pool->stats;
    pool->stats.version = VRAM_STATS_VERSION;
    pool->stats.max_split_size = -1;
    if (settings.max_split_size != VRAM_UNLIMITED) pool->stats.max_split_size = (int64_t)settings.max_split_size;
    *out = pool;
    return VRAM_OK;
fail:
    if (backend->destroy) backend->destroy(backend_ctx);
    return status;
}

void vram_pool_destroy(vram_pool_t *pool) {
    if (!pool) return;
    /* Return every segment to the backend; outstanding pointers become invalid. */
    vram__synchronize_and_free_events(pool);
    for (vram__segment_t *seg = pool->segments, *next; seg; seg = next) {
        next = seg->next;
        if (seg->expandable) {
            vram__expandable_destroy(pool, seg);
        } else {
            vram__pages_drop(pool, seg);
            pool->backend->segment_free(pool->ctx, seg->addr, seg->size);
        }
        free(seg);
    }
    vram__free_queues(pool);
    vram__free_all_blocks(pool);
    vram__ptrmap_destroy(&pool->live);
    free(pool->history.entries);
    if (pool->backend->destroy) pool->backend->destroy(pool->ctx);
    vram__mutex_destroy(&pool->lock);
    free(pool);
}

vram_device_t vram_pool_device(const vram_pool_t *pool) { return pool->device; }

int vram_pool_is_host(const vram_pool_t *pool) { return pool->backend->host_memory != NULL; }

/* PyTorch's get_free_block: best fit on the stream, with the oversize rules. Returns the block,
 * still in the index (take_block takes it out, or lets its split remainder take its place). */
static vram__block_t *get_free_block(vram_pool_t *pool, vram__free_index_t *index, vram_stream_t stream,
                                     uint64_t rounded) {
    index->lookups++;
    vram__block_t *block = vram__index_lower_bound(index, stream, rounded);
    if (!block || block->stream != stream) return NULL;
    if (block->segment->expandable) block = vram__expandable_best(index, block);
    uint64_t max_split = pool->settings.max_split_size;
    /* Never hand an oversize block to a small request: it could not be split back. */
    if (rounded < max_split && block->size >= max_split) return NULL;
    /* An oversize request may take a larger block only within the rounding tolerance. */
    if (rounded >= max_split && block->size >= rounded + pool->settings.max_non_split_rounding) return NULL;
    return block;
}

/* Draw a new segment from the backend, as one free block not yet in the index. */
static vram_status_t alloc_segment(vram_pool_t *pool, int is_small, vram_stream_t stream, uint64_t size,
                                   uint64_t context, int is_retry, vram__block_t **out) {
    if (is_retry) pool->stats.num_alloc_retries++;
    pool->host.rejected = 0; /* the OOM message describes the last attempt */
    vram__as_refusal_clear();
    uint64_t reserved = (uint64_t)pool->stats.reserved_bytes[VRAM_STAT_ALL].current;
    if (size > pool->settings.allowed_bytes || reserved > pool->settings.allowed_bytes - size)
        return VRAM_ERR_OOM; /* over the fraction or limit: the caller reports it */
    /* On a host, mmap succeeds where the memory is not there (overcommit) and the OOM killer
     * ends the process later: ask the host first, so the ladder can run instead. */
    vram_status_t status = vram__host_check_room(pool, size);
    if (status != VRAM_OK) return status;
    vram__segment_t *seg = calloc(1, sizeof *seg);
    if (!seg) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for allocator bookkeeping");
    seg->size = size;
    if (pool->host.tracked && (status = vram__pages_attach(pool, &seg)) != VRAM_OK) {
        free(seg);
        return status;
    }
    uintptr_t addr = 0;
    status = pool->backend->segment_alloc(pool->ctx, size, stream, &addr);
    if (status != VRAM_OK) {
        free(seg);
        return status;
    }
    vram__block_t *block = vram__segment_add(pool, seg, addr, size, stream, is_small);
    seg->oversize = size >= pool->settings.max_split_size;
    if (seg->clean) pool->host.reclaimable_units += size / VRAM__PAGE_UNIT; /* untouched */

    vram__stat_array_increase(pool->stats.segment, is_small, 1);
    vram__stat_array_increase(pool->stats.reserved_bytes, is_small, (int64_t)size);
    if (seg->oversize) vram__stat_increase(&pool->stats.oversize_segments, 1);
    pool->stats.num_device_alloc++;
    vram__trace(pool, VRAM_TRACE_SEGMENT_ALLOC, addr, size, stream, context, 0);
    *out = block;
    return VRAM_OK;
}

/* Memory the cache does not have: a new segment, or with expandable segments new pages. When
 * the address-space limit leaves no room for a new range, the request gets a classic segment
 * (its own size) in the expandable pool: every operation dispatches on the segment's layout,
 * so the two coexist, and such segments follow the classic rules (released whole; the cache
 * limit, garbage collector and oversize release apply to them). */
static vram_status_t new_memory(vram_pool_t *pool, int is_small, vram_stream_t stream, uint64_t rounded,
                                uint64_t seg_size, uint64_t context, int is_retry, vram__block_t **out) {
    if (!pool->settings.expandable_segments) return alloc_segment(pool, is_small, stream, seg_size, context, is_retry, out);
    int use_classic = 0;
    vram_status_t status = vram__expandable_alloc(pool, is_small, stream, rounded, context, is_retry, &use_classic, out);
    if (status != VRAM_ERR_OOM || !use_classic) return status;
    return alloc_segment(pool, is_small, stream, seg_size, context, 0, out); /* the retry is counted once */
}

/* The slow path, PyTorch's order: garbage-collect old cached blocks if over the threshold,
 * ask the backend, free oversize cached blocks and ask again, then release every cached
 * segment and ask a last time. Unlike PyTorch we look in the cache again after releasing:
 * synchronizing events may have returned a block that fits (pytorch#189504). */
static vram_status_t obtain_block(vram_pool_t *pool, vram__free_index_t *index, vram_stream_t stream,
                                  uint64_t requested, uint64_t rounded, uint64_t context, vram__block_t **out) {
    uint64_t seg_size = vram__segment_size(rounded);
    int is_small = index->is_small;
    if (pool->settings.garbage_collection_threshold > 0.0) vram__garbage_collect(pool, context);
    vram_status_t status = new_memory(pool, is_small, stream, rounded, seg_size, context, 0, out);
    if (status == VRAM_ERR_OOM && vram__release_available_cached_blocks(pool, index, stream, rounded, context))
        status = new_memory(pool, is_small, stream, rounded, seg_size, context, 0, out);
    if (status == VRAM_ERR_OOM) {
        vram__release_cached_blocks(pool, context);
        *out = get_free_block(pool, index, stream, rounded);
        status = *out ? VRAM_OK : new_memory(pool, is_small, stream, rounded, seg_size, context, 1, out);
    }
    if (status == VRAM_ERR_OOM) return vram__report_oom(pool, requested, seg_size, stream, context);
    return status;
}

/* PyTorch's should_split: small-pool remainders of 512 B are worth keeping; large-pool ones
 * only above 1 MiB, and oversize blocks are never split. In expandable segments every
 * remainder of 512 B is split off: its free pages can be unmapped. */
static int should_split(const vram_pool_t *pool, const vram__block_t *block, uint64_t size) {
    uint64_t remaining = block->size - size;
    if (block->segment->is_small || block->segment->expandable) return remaining >= VRAM_MIN_BLOCK;
    return size < pool->settings.max_split_size && remaining > VRAM_SMALL_SIZE;
}

/* Hand out `block` (in the index if it came from the cache, out of it if it is a new
 * segment), splitting off the unused tail as a free block. *known_zero (host pools) tells
 * whether its memory is untouched since it was mapped. */
static vram__block_t *take_block(vram_pool_t *pool, vram__block_t *block, uint64_t rounded, uint64_t requested,
                                 uint64_t context, int *known_zero) {
    int is_small = block->segment->is_small;
    vram__free_index_t *index = vram__index_for(pool, is_small);
    int64_t split_count = 0, split_bytes = 0; /* net change of inactive_split */
    if (vram__is_whole_free(block)) vram__whole_free_count(pool, block->segment, 0);
    if (vram__is_split(block)) {
        split_count--;
        split_bytes -= (int64_t)block->size;
    }
    if (should_split(pool, block, rounded)) {
        vram__block_t *rest = vram__block_splice(pool, block, block->addr + rounded, block->size - rounded, 1);
        if (block->in_index) vram__index_replace(index, block, rest); /* before block's key changes */
        else vram__index_insert(index, rest);
        block->size = rounded;
        split_count++;
        split_bytes += (int64_t)rest->size;
    } else if (block->in_index) {
        vram__index_remove(index, block);
    }
    if (!block->segment->expandable) { /* PyTorch leaves expandable segments out of inactive_split */
        vram__stat_array_change(pool->stats.inactive_split, is_small, split_count);
        vram__stat_array_change(pool->stats.inactive_split_bytes, is_small, split_bytes);
    }

    block->allocated = 1;
    block->requested = requested;
    block->context = context;
    block->oversize = block->size >= pool->settings.max_split_size;
    *known_zero = block->segment->clean ? vram__pages_take(pool, block) : 0;
    vram__stat_array_increase(pool->stats.allocation, is_small, 1);
    vram__stat_array_increase(pool->stats.allocated_bytes, is_small, (int64_t)block->size);
    vram__stat_array_increase(pool->stats.active, is_small, 1);
    vram__stat_array_increase(pool->stats.active_bytes, is_small, (int64_t)block->size);
    vram__stat_array_increase(pool->stats.requested_bytes, is_small, (int64_t)requested);
    if (block->oversize) vram__stat_increase(&pool->stats.oversize_allocations, 1);
    vram__ptrmap_insert_reserved(&pool->live, block->addr, block); /* vram_malloc reserved the slot */
    vram__trace(pool, VRAM_TRACE_ALLOC, block->addr, block->size, block->stream, context, 0);
    return block;
}

/* *zero_lo..*zero_hi receives the part of the block known to be zero (host pools; empty
 * elsewhere): all of it when its units were untouched, or the pages an expandable segment
 * mapped for it. */
static vram_status_t malloc_impl(vram_pool_t *pool, uint64_t size, vram_stream_t stream, uint64_t context,
                                 void **out, uintptr_t *zero_lo, uintptr_t *zero_hi) {
    *out = NULL;
    *zero_lo = *zero_hi = 0;
    if (size == 0) return VRAM_OK; /* as torch's raw_alloc(0): no block, no counters */
    if (size >= VRAM_MAX_REQUEST)
        return vram__fail(VRAM_ERR_INVALID_ARG, "allocation size %llu is absurd: sizes must be below 2**62 bytes",
                          (unsigned long long)size);
    vram__lock(&pool->lock);
    /* Reserve bookkeeping first, so a host-memory failure happens before any change. */
    vram_status_t status = vram__reserve_blocks(pool, 2);
    if (status == VRAM_OK && vram__ptrmap_reserve(&pool->live, pool->live.count + 1) != 0)
        status = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for allocator bookkeeping");
    if (status != VRAM_OK) goto done;
    if (pool->num_pending) vram__process_events(pool);
    pool->fresh_lo = pool->fresh_hi = 0;

    uint64_t rounded = vram__round_size(&pool->settings, size);
    vram__free_index_t *index = vram__index_for(pool, rounded <= VRAM_SMALL_SIZE);
    vram__block_t *block = get_free_block(pool, index, stream, rounded);
    if (!block) status = obtain_block(pool, index, stream, size, rounded, context, &block);
    if (status == VRAM_OK) {
        int known_zero = 0;
        block = take_block(pool, block, rounded, size, context, &known_zero);
        *out = (void *)block->addr;
        uintptr_t lo = block->addr, hi = block->addr + block->size;
        if (!known_zero) { /* only what this malloc mapped, if anything */
            lo = lo > pool->fresh_lo ? lo : pool->fresh_lo;
            hi = hi < pool->fresh_hi ? hi : pool->fresh_hi;
        }
        if (lo < hi) *zero_lo = lo, *zero_hi = hi;
    }
    /* Events processed above may have freed whole segments (only the taken block is in use). */
    if (vram__over_cache_limit(pool)) vram__host_enforce_cache_limit(pool, context);
done:
    vram__unlock(&pool->lock);
    return status;
}

vram_status_t vram_malloc(vram_pool_t *pool, uint64_t size, vram_stream_t stream, uint64_t context, void **out) {
    uintptr_t zero_lo, zero_hi;
    return malloc_impl(pool, size, stream, context, out, &zero_lo, &zero_hi);
}

vram_status_t vram_calloc(vram_pool_t *pool, uint64_t size, vram_stream_t stream, uint64_t context, void **out) {
    *out = NULL;
    if (!pool->host.tracked) {
        char name[32];
        vram_device_format(pool->device, name, sizeof name);
        return vram__fail(VRAM_ERR_INVALID_ARG, "vram_calloc needs a host pool; %s memory cannot be written by the CPU",
                          name);
    }
    uintptr_t zero_lo, zero_hi;
    vram_status_t status = malloc_impl(pool, size, stream, context, out, &zero_lo, &zero_hi);
    if (status != VRAM_OK || !*out) return status;
    /* Outside the lock: zeroing a large block takes a while. Untouched pages are zero already,
     * and leaving them alone keeps them from costing memory before they are used. */
    uintptr_t start = (uintptr_t)*out, end = start + size;
    if (zero_lo >= zero_hi) zero_lo = zero_hi = end;
    if (zero_lo > start) memset(*out, 0, (size_t)((zero_lo < end ? zero_lo : end) - start));
    if (zero_hi < end) memset((void *)zero_hi, 0, (size_t)(end - zero_hi));
    return status;
}

/* PyTorch's free_block: merge with free neighbours and put the result in the index. */
void vram__free_block(vram_pool_t *pool, vram__block_t *block, uint64_t context) {
    int is_small = block->segment->is_small;
    uint64_t original_size = block->size, absorbed_bytes;
    vram__trace(pool, VRAM_TRACE_FREE_COMPLETED, block->addr, block->size, block->stream, context, 0);
    block->num_stream_uses = 0;
    /* Each free neighbour absorbed was a split block: inactive_split loses it. */
    int64_t split_count = -vram__merge_free(pool, block, &absorbed_bytes);
    int64_t split_bytes = -(int64_t)absorbed_bytes;
    vram__segment_t *seg = block->segment;
    if (!seg->expandable) {
        if (vram__is_split(block)) {
            split_count++;
            split_bytes += (int64_t)block->size;
        } else {
            vram__whole_free_count(pool, seg, 1);
            seg->freed_at = ++pool->free_clock;
        }
        vram__stat_array_change(pool->stats.inactive_split, is_small, split_count);
        vram__stat_array_change(pool->stats.inactive_split_bytes, is_small, split_bytes);
    }
    vram__stat_array_decrease(pool->stats.active, is_small, 1);
    vram__stat_array_decrease(pool->stats.active_bytes, is_small, (int64_t)original_size);
    vram__stat_array_decrease(pool->stats.requested_bytes, is_small, (int64_t)block->requested);
    block->requested = 0;
    block->context = 0;
    if (seg->clean) vram__pages_on_free(pool, block);
    /* Host pools give a large free block's memory back; in an expandable segment that is
     * unmapping its whole pages (the threshold is host_page_release, as for madvise). */
    else if (seg->expandable && pool->host.tracked && block->size >= pool->settings.host_page_release)
        vram__expandable_unmap(pool, block, context);
}

static vram_status_t unknown_pointer(const vram_pool_t *pool, const void *ptr) {
    char name[32];
    vram_device_format(pool->device, name, sizeof name);
    return vram__fail(VRAM_ERR_INVALID_ARG,
                      "pointer %p is not a live allocation of vramkit on %s: it was never returned by "
                      "vramkit, does not start an allocation, or was already freed", ptr, name);
}

vram_status_t vram_free(vram_pool_t *pool, void *ptr, uint64_t context) {
    if (!ptr) return VRAM_OK;
    int freed;
    vram_status_t status = vram_try_free(pool, ptr, context, &freed);
    return (status == VRAM_OK && !freed) ? unknown_pointer(pool, ptr) : status;
}

vram_status_t vram_try_free(vram_pool_t *pool, void *ptr, uint64_t context, int *freed) {
    *freed = ptr != NULL;
    if (!ptr) return VRAM_OK;
    vram__lock(&pool->lock);
    vram__block_t *block = vram__ptrmap_remove(&pool->live, (uintptr_t)ptr);
    if (!block) {
        vram__unlock(&pool->lock);
        *freed = 0;
        return VRAM_OK;
    }
    if (block->num_stream_uses) {
        vram_status_t status = vram__reserve_events(pool, block);
        if (status != VRAM_OK) { /* nothing changed: the pointer stays live */
            vram__ptrmap_insert_reserved(&pool->live, block->addr, block);
            vram__unlock(&pool->lock);
            *freed = 0;
            return status;
        }
    }
    int is_small = block->segment->is_small;
    block->allocated = 0;
    vram__stat_array_decrease(pool->stats.allocation, is_small, 1);
    vram__stat_array_decrease(pool->stats.allocated_bytes, is_small, (int64_t)block->size);
    if (block->oversize) vram__stat_decrease(&pool->stats.oversize_allocations, 1);
    block->oversize = 0;
    vram__trace(pool, VRAM_TRACE_FREE_REQUESTED, block->addr, block->size, block->stream, context, 0);
    if (block->num_stream_uses) vram__insert_events(pool, block);
    else vram__free_block(pool, block, context);
    if (!vram_caching_enabled()) vram__release_cached_blocks(pool, context); /* uncached: nothing stays cached */
    else if (vram__over_cache_limit(pool)) vram__host_enforce_cache_limit(pool, context);
    vram__unlock(&pool->lock);
    return VRAM_OK;
}

vram_status_t vram_block_query(vram_pool_t *pool, const void *ptr, vram_block_info_t *out) {
    vram__lock(&pool->lock);
    const vram__block_t *block = vram__ptrmap_get(&pool->live, (uintptr_t)ptr);
    if (!block) {
        vram__unlock(&pool->lock);
        return unknown_pointer(pool, ptr);
    }
    out->address = block->addr;
    out->size = block->size;
    out->requested_size = block->requested;
    out->stream = block->stream;
    if (block->segment->expandable) {
        uintptr_t run_addr;
        vram__expandable_run(block, &run_addr, &out->segment_size);
        out->segment_address = run_addr;
    } else {
        out->segment_address = block->segment->addr;
        out->segment_size = block->segment->size;
    }
    out->is_small_pool = block->segment->is_small;
    vram__unlock(&pool->lock);
    return VRAM_OK;
}
