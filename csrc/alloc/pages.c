/* pages.c — what the pages of a host pool's segments hold, in 2 MiB units (internal.h has
 * the four states), and giving them back to the kernel without unmapping them.
 *
 * Why track it: a cached free block on the host keeps its pages resident, so a process that
 * frees an 8 GiB array and asks for 16 GiB holds 24 GiB (the OOM killer's case). Giving the
 * pages of large free blocks back with MADV_FREE makes cached memory cost nothing under
 * pressure, and reuse before then costs nothing either. But the kernel keeps MADV_FREE pages
 * on its inactive file list, counted as available, even after they are written again (until
 * reclaim rescans them): MemAvailable then overstates what is free by the pages we reused.
 * The units tell exactly how many those are, so the host check can subtract them. Likewise
 * pages handed out but never written are not in the kernel's figures at all; the fresh units
 * say where they may be, and the backend's residency query (mincore) how many are left. */
#include "internal.h"

#include <stdatomic.h>
#include <stdlib.h>

#include "../util/error.h"

#define UNIT VRAM__PAGE_UNIT
#define CORRUPT(...) vram__fail(VRAM_ERR_CORRUPT, __VA_ARGS__)

/* Bytes reused after MADV_FREE, summed over every pool of the process. */
static _Atomic uint64_t lazy_reused_total;

uint64_t vram__pages_lazy_reused_total(void) { return atomic_load_explicit(&lazy_reused_total, memory_order_relaxed); }

static uint64_t num_units(const vram__segment_t *seg) { return seg->size / UNIT; }
static uint64_t num_words(uint64_t units) { return (units + 63) / 64; }
static int test_bit(const uint64_t *bits, uint64_t u) { return (int)((bits[u / 64] >> (u % 64)) & 1u); }
static void set_bit(uint64_t *bits, uint64_t u, int on) {
    if (on) bits[u / 64] |= (uint64_t)1 << (u % 64);
    else bits[u / 64] &= ~((uint64_t)1 << (u % 64));
}

/* The bits of units [u0, u1) that fall in word w (callers only ask for words the range
 * touches, so both shifts stay below 64). */
static uint64_t range_mask(uint64_t w, uint64_t u0, uint64_t u1) {
    uint64_t lo = w * 64, a = u0 > lo ? u0 - lo : 0, b = u1 < lo + 64 ? u1 - lo : 64;
    if (b <= a) return 0;
    uint64_t upto_b = b == 64 ? ~(uint64_t)0 : (((uint64_t)1 << b) - 1);
    return upto_b & ~(((uint64_t)1 << a) - 1);
}

static void add_lazy_reused(vram_pool_t *pool, int64_t units) {
    pool->host.lazy_reused_units = (uint64_t)((int64_t)pool->host.lazy_reused_units + units);
    if (units > 0) atomic_fetch_add_explicit(&lazy_reused_total, (uint64_t)units * UNIT, memory_order_relaxed);
    else if (units < 0) atomic_fetch_sub_explicit(&lazy_reused_total, (uint64_t)-units * UNIT, memory_order_relaxed);
}

vram_status_t vram__pages_attach(vram_pool_t *pool, vram__segment_t **segp) {
    (void)pool;
    uint64_t units = num_units(*segp), words = num_words(units);
    vram__segment_t *seg = realloc(*segp, sizeof *seg + 3 * words * sizeof(uint64_t));
    if (!seg) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for allocator bookkeeping");
    seg->clean = (uint64_t *)(seg + 1);
    seg->lazy = seg->clean + words;
    seg->fresh = seg->lazy + words;
    /* A new mapping is untouched: every unit clean, none lazy, none handed out. */
    for (uint64_t w = 0; w < words; w++) {
        seg->clean[w] = range_mask(w, 0, units);
        seg->lazy[w] = seg->fresh[w] = 0;
    }
    *segp = seg;
    return VRAM_OK;
}

int vram__pages_take_slow(vram_pool_t *pool, const vram__block_t *block) {
    vram__segment_t *seg = block->segment;
    uint64_t offset = block->addr - seg->addr;
    uint64_t u0 = offset / UNIT, u1 = (offset + block->size - 1) / UNIT + 1;
    uint64_t cleaned = 0, reused = 0, fresh = 0;
    int zero = 1;
    for (uint64_t w = u0 / 64; w <= (u1 - 1) / 64; w++) {
        uint64_t m = range_mask(w, u0, u1), c = seg->clean[w] & m, l = seg->lazy[w] & m;
        if ((c & ~l) != m) zero = 0; /* a unit that is not untouched may hold old data */
        if (!c) continue;
        cleaned += (uint64_t)__builtin_popcountll(c);
        if (c & l) reused += (uint64_t)__builtin_popcountll(c & l);
        if (c & ~l) { /* untouched: not resident until the caller writes it */
            fresh += (uint64_t)__builtin_popcountll(c & ~l);
            seg->fresh[w] |= c & ~l;
        }
        seg->clean[w] &= ~m;
    }
    pool->host.reclaimable_units -= cleaned;
    pool->host.fresh_units += fresh;
    if (reused) add_lazy_reused(pool, (int64_t)reused);
    return zero;
}

void vram__pages_release_free(vram_pool_t *pool, vram__block_t *block) {
    uint64_t threshold = pool->settings.host_page_release;
    vram__segment_t *seg = block->segment;
    uint64_t offset = block->addr - seg->addr;
    /* Only units wholly inside the free block: its neighbours' data shares the others. */
    uint64_t u0 = (offset + UNIT - 1) / UNIT, u1 = (offset + block->size) / UNIT;
    if (u1 <= u0) return;
    uint64_t holding = 0;
    for (uint64_t w = u0 / 64; w <= (u1 - 1) / 64; w++)
        holding += (uint64_t)__builtin_popcountll(~seg->clean[w] & range_mask(w, u0, u1));
    if (holding == 0 || holding * UNIT < threshold) return;
    /* One madvise per run of units that hold memory (usually one run: the freed block). */
    for (uint64_t u = u0; u < u1;) {
        if (test_bit(seg->clean, u)) {
            u++;
            continue;
        }
        uint64_t end = u + 1;
        while (end < u1 && !test_bit(seg->clean, end)) end++;
        int lazy = 0;
        if (pool->backend->release_pages(pool->ctx, seg->addr + u * UNIT, (end - u) * UNIT,
                                         pool->settings.host_lazy_free, &lazy) != VRAM_OK)
            return; /* the pages still hold memory, and the units say so */
        pool->stats.num_host_page_releases++;
        int64_t was_reused = 0;
        for (uint64_t v = u; v < end; v++) {
            was_reused += test_bit(seg->lazy, v); /* clean = 0 here, so lazy = 1 means reused */
            pool->host.fresh_units -= (uint64_t)test_bit(seg->fresh, v);
            set_bit(seg->clean, v, 1);
            set_bit(seg->lazy, v, lazy);
            set_bit(seg->fresh, v, 0);
        }
        pool->host.reclaimable_units += end - u;
        if (was_reused) add_lazy_reused(pool, -was_reused);
        u = end;
    }
}

void vram__pages_drop(vram_pool_t *pool, const vram__segment_t *seg) {
    if (!seg->clean) return;
    uint64_t units = num_units(seg), clean = 0, reused = 0, fresh = 0;
    for (uint64_t w = 0; w < num_words(units); w++) {
        uint64_t m = range_mask(w, 0, units);
        clean += (uint64_t)__builtin_popcountll(seg->clean[w] & m);
        reused += (uint64_t)__builtin_popcountll(~seg->clean[w] & seg->lazy[w] & m);
        fresh += (uint64_t)__builtin_popcountll(seg->fresh[w] & m);
    }
    pool->host.reclaimable_units -= clean;
    pool->host.fresh_units -= fresh;
    if (reused) add_lazy_reused(pool, -(int64_t)reused);
}

/* Residency of one run of units; fresh units found wholly resident are fresh no more (the
 * kernel counts them now). Returns the bytes of the run's fresh units still unfaulted. */
static uint64_t unfaulted_in_run(vram_pool_t *pool, vram__segment_t *seg, uint64_t u, uint64_t end) {
    uint64_t resident = 0;
    if (pool->backend->resident_bytes(pool->ctx, seg->addr + u * UNIT, (end - u) * UNIT, &resident) != VRAM_OK)
        return (end - u) * UNIT; /* cannot tell: count all of it */
    if (resident >= (end - u) * UNIT) {
        for (uint64_t v = u; v < end; v++) set_bit(seg->fresh, v, 0);
        pool->host.fresh_units -= end - u;
        return 0;
    }
    if (end - u == 1) return UNIT - resident;
    uint64_t left = 0; /* partly resident: unit by unit, so the written ones drop out */
    for (uint64_t v = u; v < end; v++) left += unfaulted_in_run(pool, seg, v, v + 1);
    return left;
}

uint64_t vram__pages_unfaulted(vram_pool_t *pool) {
    uint64_t unfaulted = pool->settings.expandable_segments ? vram__expandable_unfaulted(pool) : 0;
    if (!pool->host.fresh_units) return unfaulted;
    if (!pool->backend->resident_bytes) return unfaulted + pool->host.fresh_units * UNIT;
    for (vram__segment_t *seg = pool->segments; seg; seg = seg->next) {
        if (!seg->fresh) continue;
        uint64_t units = num_units(seg);
        for (uint64_t u = 0; u < units;) {
            if (!test_bit(seg->fresh, u)) {
                u++;
                continue;
            }
            uint64_t end = u + 1;
            while (end < units && test_bit(seg->fresh, end)) end++;
            unfaulted += unfaulted_in_run(pool, seg, u, end);
            u = end;
        }
    }
    return unfaulted;
}

vram_status_t vram__pages_check(const vram_pool_t *pool) {
    uint64_t clean = 0, reused = 0, fresh = 0;
    for (const vram__segment_t *seg = pool->segments; seg; seg = seg->next) {
        unsigned long long sa = (unsigned long long)seg->addr;
        if (seg->expandable) { /* unmaps free pages instead of tracking units */
            if (seg->clean) return CORRUPT("expandable segment 0x%llx has page units", sa);
            continue;
        }
        if (!seg->clean != !pool->host.tracked)
            return CORRUPT("segment 0x%llx %s page units, but its pool %s", sa, seg->clean ? "has" : "lacks",
                           pool->host.tracked ? "tracks them" : "does not track them");
        if (!seg->clean) continue;
        if (seg->size % UNIT) return CORRUPT("segment 0x%llx is not a whole number of 2 MiB page units", sa);
        uint64_t units = num_units(seg);
        for (uint64_t w = 0; w < num_words(units); w++) {
            uint64_t m = range_mask(w, 0, units);
            if ((seg->clean[w] | seg->lazy[w] | seg->fresh[w]) & ~m)
                return CORRUPT("segment 0x%llx has unit bits past its end", sa);
            if (seg->fresh[w] & seg->clean[w])
                return CORRUPT("segment 0x%llx has a unit marked both clean and handed out untouched", sa);
            clean += (uint64_t)__builtin_popcountll(seg->clean[w]);
            reused += (uint64_t)__builtin_popcountll(~seg->clean[w] & seg->lazy[w] & m);
            fresh += (uint64_t)__builtin_popcountll(seg->fresh[w]);
        }
        /* A unit that a live (or awaiting) block overlaps must be marked as holding memory. */
        for (const vram__block_t *b = seg->head; b; b = b->next) {
            if (b->in_index) continue;
            uint64_t offset = b->addr - seg->addr, u0 = offset / UNIT, u1 = (offset + b->size - 1) / UNIT + 1;
            for (uint64_t u = u0; u < u1; u++)
                if (test_bit(seg->clean, u))
                    return CORRUPT("block 0x%llx is in use but page unit %llu of its segment is marked clean",
                                   (unsigned long long)b->addr, (unsigned long long)u);
        }
    }
    if (clean != pool->host.reclaimable_units)
        return CORRUPT("%llu page units are counted reclaimable but a recount gives %llu",
                       (unsigned long long)pool->host.reclaimable_units, (unsigned long long)clean);
    if (reused != pool->host.lazy_reused_units)
        return CORRUPT("%llu page units are counted reused after MADV_FREE but a recount gives %llu",
                       (unsigned long long)pool->host.lazy_reused_units, (unsigned long long)reused);
    if (fresh != pool->host.fresh_units)
        return CORRUPT("%llu page units are counted handed out untouched but a recount gives %llu",
                       (unsigned long long)pool->host.fresh_units, (unsigned long long)fresh);
    return VRAM_OK;
}
