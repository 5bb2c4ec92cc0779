/* expandable.c — PyTorch's expandable segments (expandable_segments:True).
 *
 * Why: under the classic policy a segment is one backend allocation, and a free block can
 * serve only requests that fit inside it. A workload whose tensors grow (a KV cache
 * reallocated larger every few tokens) leaves free blocks too small for the next request
 * while reserving them: "6 GiB reserved by PyTorch but unallocated". Here each (stream, pool
 * kind) has one large reserved address range with memory mapped in pages as needed, so a
 * request that does not fit the free block at the end of the mapped space extends it by
 * mapping the pages after it, and empty_cache can give back each free page, not only whole
 * segments.
 *
 * Layout: blocks tile the whole reserved range as usual; blocks with no memory behind them
 * are `unmapped` (page-aligned, never two adjacent, on a per-segment list). A free mapped
 * block and an unmapped block may be neighbours; they never merge. Reserved bytes count
 * mapped pages only; the `segment` counter and inactive_split leave expandable segments
 * out, as PyTorch's do (a free page of an expandable segment can always be released). */
#include "internal.h"

#include <stdlib.h>

#include "../util/address_space.h"
#include "../util/error.h"

/* vram_malloc reserves the block structs its split needs before the slow path runs; the
 * structs taken here come on top of those, so every reservation here keeps them spare. */
#define CALLER_SPARES 2

static uint64_t round_up(uint64_t value, uint64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

static void unmapped_link(vram__segment_t *seg, vram__block_t *b) {
    b->unmapped = 1;
    b->left = NULL;
    b->right = seg->unmapped;
    if (seg->unmapped) seg->unmapped->left = b;
    seg->unmapped = b;
}

static void unmapped_unlink(vram__segment_t *seg, vram__block_t *b) {
    if (b->left) b->left->right = b->right;
    else seg->unmapped = b->right;
    if (b->right) b->right->left = b->left;
    b->left = b->right = NULL;
    b->unmapped = 0;
}

/* The size of a new range: 1 1/8 of the device, as PyTorch does, so pages can still be mapped
 * past holes that live blocks pin; larger if one request needs it. Where ranges take this
 * process's address space (cpu) and RLIMIT_AS (`ulimit -v`, common on shared clusters) caps
 * it, 1 1/8 of the host's memory would pass the limit and every request, even of one byte,
 * would fail. A large-pool range then takes at most half of what the limit leaves, the rest
 * staying for the rest of the process (its own mallocs, thread stacks, libraries loaded
 * later) and for other ranges and segments; a small-pool range at most an eighth (its
 * requests are 1 MiB or less, and a full range is followed by another). 0 when even a range
 * for this request does not fit in that share. */
static uint64_t range_size(vram_pool_t *pool, int is_small, uint64_t page, uint64_t rounded) {
    uint64_t total = pool->total_capacity, need = round_up(rounded, page);
    uint64_t size = round_up(total + total / 8, page);
    if (size < need) size = need;
    if (!pool->backend->address_space) return size;
    uint64_t limit, used;
    pool->backend->address_space(pool->ctx, &limit, &used);
    if (limit == UINT64_MAX) return size;
    uint64_t share = (limit > used ? limit - used : 0) / (is_small ? 8 : 2) / page * page;
    if (size > share) size = share;
    return size >= need ? size : 0;
}

/* Reserve a new range for (stream, pool kind). *use_classic is set when no range for the
 * request can be had within the process's address-space limit (the size above is 0, or the
 * backend refused the reservation as out of memory): a classic segment takes only the
 * request's own size, so the caller gives it one (pool.c, new_memory). */
static vram_status_t reserve_segment(vram_pool_t *pool, int is_small, vram_stream_t stream, uint64_t rounded,
                                     int *use_classic, vram__block_t **out) {
    if (!pool->backend->range_reserve)
        return vram__fail(VRAM_ERR_INVALID_ARG, "expandable_segments is not supported by the %s backend",
                          pool->backend->name);
    uint64_t page = is_small ? VRAM_SMALL_BUFFER : pool->settings.expandable_page_size;
    uint64_t size = range_size(pool, is_small, page, rounded);
    if (size == 0) {
        *use_classic = 1;
        return VRAM_ERR_OOM;
    }
    vram_status_t status = vram__reserve_blocks(pool, 1 + CALLER_SPARES);
    if (status != VRAM_OK) return status;
    vram__segment_t *seg = calloc(1, sizeof *seg);
    if (!seg) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for allocator bookkeeping");
    uintptr_t addr = 0;
    status = pool->backend->range_reserve(pool->ctx, size, &addr);
    if (status != VRAM_OK) {
        /* Only where the limit is known to apply: elsewhere (CUDA's address space) the layouts
         * are kept apart as before. */
        if (status == VRAM_ERR_OOM && pool->backend->address_space) *use_classic = 1;
        free(seg);
        return status;
    }
    vram__block_t *b = vram__segment_add(pool, seg, addr, size, stream, is_small);
    seg->expandable = 1;
    seg->page = page;
    unmapped_link(seg, b);
    *out = b;
    return VRAM_OK;
}

/* Map the first `size` bytes (rounded up to pages) of an unmapped block and merge them with
 * the free blocks around them; *out is the resulting free block, in the index. */
static vram_status_t map_block(vram_pool_t *pool, vram__block_t *b, uint64_t size, uint64_t context,
                               vram__block_t **out) {
    vram__segment_t *seg = b->segment;
    uint64_t len = round_up(size, seg->page);
    if (len > b->size) len = b->size;
    uint64_t reserved = (uint64_t)pool->stats.reserved_bytes[VRAM_STAT_ALL].current;
    if (len > pool->settings.allowed_bytes || reserved > pool->settings.allowed_bytes - len)
        return VRAM_ERR_OOM; /* over the fraction or limit: the caller reports it */
    vram_status_t status = vram__host_check_room(pool, len);
    if (status == VRAM_OK) status = vram__reserve_blocks(pool, 1 + CALLER_SPARES);
    if (status == VRAM_OK) status = pool->backend->range_map(pool->ctx, b->addr, len, seg->page);
    if (status != VRAM_OK) return status;
    uintptr_t mapped_at = b->addr;
    unmapped_unlink(seg, b);
    if (len < b->size) {
        unmapped_link(seg, vram__block_splice(pool, b, b->addr + len, b->size - len, 1));
        b->size = len;
    }
    vram__merge_free(pool, b, NULL);
    seg->mapped += len;
    vram__stat_array_increase(pool->stats.reserved_bytes, seg->is_small, (int64_t)len);
    pool->stats.num_device_alloc++;
    vram__trace(pool, VRAM_TRACE_SEGMENT_MAP, mapped_at, len, seg->stream, context, 0);
    *out = b;
    return VRAM_OK;
}

static int allocatable(const vram__block_t *b) { return b && (b->in_index || b->unmapped); }

static int has_room(const vram__block_t *b, uint64_t size) {
    uint64_t bytes = 0;
    for (; bytes < size && allocatable(b); b = b->next) bytes += b->size;
    return bytes >= size;
}

/* PyTorch's find_expandable_block: the lowest address, on this stream and pool kind, where
 * an unmapped block (with the free block before it, if any) and what follows it hold
 * `rounded` bytes of free or unmapped space. */
static vram__block_t *find_candidate(vram_pool_t *pool, int is_small, vram_stream_t stream, uint64_t rounded) {
    vram__block_t *best = NULL;
    for (vram__segment_t *seg = pool->segments; seg; seg = seg->next) {
        if (!seg->expandable || seg->is_small != is_small || seg->stream != stream) continue;
        for (vram__block_t *u = seg->unmapped; u; u = u->right) {
            vram__block_t *c = u->prev && u->prev->in_index ? u->prev : u;
            if ((!best || c->addr < best->addr) && has_room(c, rounded)) best = c;
        }
    }
    return best;
}

/* Map part of an unmapped block, and widen [fresh_lo, fresh_hi) — the pages this malloc mapped
 * (zero on the host: vram_calloc need not write them) — when they continue it. */
static vram_status_t map_more(vram_pool_t *pool, vram__block_t *b, uint64_t size, uint64_t context,
                              vram__block_t **out) {
    uintptr_t at = b->addr;
    uint64_t mapped_before = b->segment->mapped;
    vram_status_t status = map_block(pool, b, size, context, out);
    if (status != VRAM_OK) return status;
    uint64_t len = (*out)->segment->mapped - mapped_before;
    if (pool->fresh_hi == pool->fresh_lo) pool->fresh_lo = pool->fresh_hi = at;
    if (at == pool->fresh_hi) pool->fresh_hi = at + len;
    return VRAM_OK;
}

vram_status_t vram__expandable_alloc(vram_pool_t *pool, int is_small, vram_stream_t stream, uint64_t rounded,
                                     uint64_t context, int is_retry, int *use_classic, vram__block_t **out) {
    *out = NULL;
    *use_classic = 0;
    if (is_retry) pool->stats.num_alloc_retries++;
    pool->host.rejected = 0; /* the OOM message describes the last attempt */
    vram__as_refusal_clear();
    /* A request that no amount of releasing can serve is an OOM before any address space is
     * reserved for it (a range sized to it could exhaust the addresses instead). */
    uint64_t pages = round_up(rounded, is_small ? VRAM_SMALL_BUFFER : pool->settings.expandable_page_size);
    if (pages > pool->settings.allowed_bytes || pages > pool->total_capacity) return VRAM_ERR_OOM;
    vram__block_t *c = find_candidate(pool, is_small, stream, rounded);
    vram_status_t status = VRAM_OK;
    if (!c) status = reserve_segment(pool, is_small, stream, rounded, use_classic, &c);
    if (status == VRAM_OK && c->unmapped) status = map_more(pool, c, c->size < rounded ? c->size : rounded, context, &c);
    /* Now c is free and mapped; while it is short, the block after it is unmapped (free
     * neighbours are always merged) and mapping part of it extends c. A failure leaves the
     * pages mapped so far as free blocks, as PyTorch does. */
    while (status == VRAM_OK && c->size < rounded) {
        vram__block_t *next = c->next;
        uint64_t remaining = rounded - c->size;
        status = map_more(pool, next, remaining < next->size ? remaining : next->size, context, &c);
    }
    *out = status == VRAM_OK ? c : NULL;
    return status;
}

/* The next run of mapped blocks from *b on, as [*start, *end), with *b moved past it; 0 when
 * no mapped block is left. */
static int next_mapped_run(const vram__segment_t *seg, vram__block_t **b, uintptr_t *start, uintptr_t *end) {
    while (*b && (*b)->unmapped) *b = (*b)->next;
    if (!*b) return 0;
    *start = (*b)->addr;
    while (*b && !(*b)->unmapped) *b = (*b)->next;
    *end = *b ? (*b)->addr : seg->addr + seg->size;
    return 1;
}

uint64_t vram__expandable_unfaulted(vram_pool_t *pool) {
    uint64_t unfaulted = 0;
    for (vram__segment_t *seg = pool->segments; seg; seg = seg->next) {
        if (!seg->expandable) continue;
        uintptr_t start, end;
        for (vram__block_t *b = seg->head; next_mapped_run(seg, &b, &start, &end);) {
            uint64_t len = end - start, resident = 0;
            if (!pool->backend->resident_bytes || pool->backend->resident_bytes(pool->ctx, start, len, &resident) != VRAM_OK)
                resident = 0; /* cannot tell: count all of it */
            unfaulted += resident < len ? len - resident : 0;
        }
    }
    return unfaulted;
}

void vram__expandable_unmap(vram_pool_t *pool, vram__block_t *b, uint64_t context) {
    vram__segment_t *seg = b->segment;
    uintptr_t begin = seg->addr + round_up(b->addr - seg->addr, seg->page);
    uintptr_t end = seg->addr + (b->addr + b->size - seg->addr) / seg->page * seg->page;
    if (begin >= end) return;
    /* Failing here (no host memory for two block structs, or the backend refusing) leaves the
     * pages mapped and the pool consistent: releasing memory is best effort. */
    if (vram__reserve_blocks(pool, 2 + CALLER_SPARES) != VRAM_OK) return;
    if (pool->backend->range_unmap(pool->ctx, begin, end - begin, seg->page) != VRAM_OK) return;
    vram__free_index_t *index = vram__index_for(pool, seg->is_small);
    vram__index_remove(index, b);
    uintptr_t b_end = b->addr + b->size;
    if (begin > b->addr) vram__index_insert(index, vram__block_splice(pool, b, b->addr, begin - b->addr, 0));
    if (end < b_end) vram__index_insert(index, vram__block_splice(pool, b, end, b_end - end, 1));
    b->addr = begin;
    b->size = end - begin;
    /* Unmapped blocks are never adjacent: absorb the unmapped neighbours, as freeing absorbs
     * free ones. */
    vram__block_t *sides[2] = {b->prev, b->next};
    for (int i = 0; i < 2; i++) {
        if (!sides[i] || !sides[i]->unmapped) continue;
        unmapped_unlink(seg, sides[i]);
        vram__block_absorb(b, sides[i]);
        vram__block_delete(pool, sides[i]);
    }
    unmapped_link(seg, b);
    seg->mapped -= end - begin;
    vram__stat_array_decrease(pool->stats.reserved_bytes, seg->is_small, (int64_t)(end - begin));
    pool->stats.num_device_free++;
    vram__trace(pool, VRAM_TRACE_SEGMENT_UNMAP, begin, end - begin, seg->stream, context, 0);
}

static void release_segment(vram_pool_t *pool, vram__segment_t *seg) {
    pool->backend->range_release(pool->ctx, seg->addr, seg->size);
    vram__segment_remove(pool, seg);
}

void vram__expandable_release_all(vram_pool_t *pool, uint64_t context) {
    for (vram__segment_t *seg = pool->segments, *next; seg; seg = next) {
        next = seg->next;
        if (!seg->expandable) continue;
        /* An unmap leaves b as the unmapped block (it absorbs unmapped neighbours only), so
         * b->next is still the right place to go on. */
        for (vram__block_t *b = seg->head; b; b = b->next)
            if (b->in_index) vram__expandable_unmap(pool, b, context);
        if (seg->head->unmapped && !seg->head->next) release_segment(pool, seg);
    }
}

void vram__expandable_destroy(vram_pool_t *pool, vram__segment_t *seg) {
    uintptr_t start, end;
    for (vram__block_t *b = seg->head; next_mapped_run(seg, &b, &start, &end);)
        (void)pool->backend->range_unmap(pool->ctx, start, end - start, seg->page);
    pool->backend->range_release(pool->ctx, seg->addr, seg->size);
}

vram__block_t *vram__expandable_best(vram__free_index_t *index, vram__block_t *block) {
#define EXPANDABLE_SIZE(b) ((b)->size + ((b)->next && (b)->next->unmapped ? (b)->next->size : 0))
    /* A free block followed by unmapped space can grow: for best fit it counts as the size it
     * can grow to, so a request goes to a tighter block and leaves the growing one alone. */
    for (vram__block_t *next = vram__index_after(index, block);
         block->segment->expandable && next && next->stream == block->stream &&
         EXPANDABLE_SIZE(next) < EXPANDABLE_SIZE(block);
         next = vram__index_after(index, next))
        block = next;
    return block;
#undef EXPANDABLE_SIZE
}

void vram__expandable_run(const vram__block_t *block, uintptr_t *addr, uint64_t *size) {
    const vram__block_t *first = block, *last = block;
    while (first->prev && !first->prev->unmapped) first = first->prev;
    while (last->next && !last->next->unmapped) last = last->next;
    *addr = first->addr;
    *size = last->addr + last->size - first->addr;
}

vram_status_t vram__expandable_check(const vram__segment_t *seg) {
    unsigned long long sa = (unsigned long long)seg->addr;
    uint64_t mapped = 0, unmapped = 0;
    if (!seg->page || seg->page % VRAM__PAGE_UNIT || seg->size % seg->page)
        return vram__fail(VRAM_ERR_CORRUPT, "expandable segment 0x%llx: page %llu does not divide its size %llu", sa,
                          (unsigned long long)seg->page, (unsigned long long)seg->size);
    for (const vram__block_t *b = seg->head; b; b = b->next) {
        if (!b->unmapped) {
            mapped += b->size;
            continue;
        }
        unmapped++;
        if ((b->addr - seg->addr) % seg->page || b->size % seg->page)
            return vram__fail(VRAM_ERR_CORRUPT, "unmapped block 0x%llx of segment 0x%llx is not whole pages",
                              (unsigned long long)b->addr, sa);
        if (b->next && b->next->unmapped)
            return vram__fail(VRAM_ERR_CORRUPT, "unmapped blocks 0x%llx and 0x%llx are adjacent but not merged",
                              (unsigned long long)b->addr, (unsigned long long)b->next->addr);
    }
    if (mapped != seg->mapped)
        return vram__fail(VRAM_ERR_CORRUPT, "expandable segment 0x%llx counts %llu mapped bytes but its blocks map %llu",
                          sa, (unsigned long long)seg->mapped, (unsigned long long)mapped);
    uint64_t listed = 0;
    for (const vram__block_t *u = seg->unmapped; u && listed <= unmapped; u = u->right, listed++) {
        if (!u->unmapped || u->segment != seg || (u->right && u->right->left != u))
            return vram__fail(VRAM_ERR_CORRUPT, "the unmapped list of segment 0x%llx is broken at 0x%llx", sa,
                              (unsigned long long)u->addr);
    }
    if (listed != unmapped)
        return vram__fail(VRAM_ERR_CORRUPT, "segment 0x%llx lists %llu unmapped blocks but has %llu", sa,
                          (unsigned long long)listed, (unsigned long long)unmapped);
    return VRAM_OK;
}
