/* internal.h — the allocator's private data structures, shared by the files in csrc/alloc.
 *
 * Vocabulary (PyTorch's): a *segment* is one backend allocation (cudaMalloc, mmap, or a
 * simulated range); it is tiled by *blocks*. A block is in exactly one state:
 *   allocated  — handed to a caller and not yet freed;
 *   awaiting   — freed by the caller, but other streams may still use it (event_count > 0);
 *   free       — in the pool's free index, ready for reuse on the segment's stream.
 * Requests <= 1 MiB use the small pool (2 MiB segments), larger ones the large pool. */
#ifndef VRAM_ALLOC_INTERNAL_H
#define VRAM_ALLOC_INTERNAL_H

#include "vramkit.h"
#include "../util/lock.h"
#include "../util/ptrmap.h"

#define VRAM_MIN_BLOCK ((uint64_t)512)              /* kMinBlockSize */
#define VRAM_SMALL_SIZE ((uint64_t)1 << 20)         /* kSmallSize: largest small request */
#define VRAM_SMALL_BUFFER ((uint64_t)2 << 20)       /* kSmallBuffer: small segment size */
#define VRAM_LARGE_BUFFER ((uint64_t)20 << 20)      /* kLargeBuffer: segment for 1–10 MiB */
#define VRAM_MIN_LARGE_ALLOC ((uint64_t)10 << 20)   /* kMinLargeAlloc */
#define VRAM_ROUND_LARGE ((uint64_t)2 << 20)        /* kRoundLarge */
#define VRAM_UNLIMITED UINT64_MAX

typedef struct vram__segment vram__segment_t;
typedef struct vram__block vram__block_t;

struct vram__block {
    uintptr_t addr;
    uint64_t size;
    uint64_t requested;          /* the caller's size, while allocated or awaiting */
    vram_stream_t stream;        /* the segment's stream, copied here for the index key */
    vram__block_t *prev, *next;  /* physical neighbours within the segment */
    vram__segment_t *segment;
    vram__block_t *left, *right; /* free-index links while in_index; the segment's unmapped list
                                  * (left = previous, right = next) while unmapped */
    uint32_t priority;           /* treap heap priority */
    uint8_t allocated;
    uint8_t in_index;
    uint8_t unmapped;            /* expandable segments: addresses with no memory behind them */
    uint8_t oversize;            /* counted in oversize_allocations while allocated */
    int32_t event_count;         /* > 0 while awaiting other streams */
    vram_stream_t *stream_uses;  /* streams added by record_stream (malloc'd, rare) */
    uint32_t num_stream_uses, cap_stream_uses;
    uint64_t gc_count_base;      /* free-index lookups counted when the block became free */
    uint64_t context;            /* caller's context id of the allocation */
};

/* Host pools track their segments' memory in 2 MiB units (one huge page; segment sizes are
 * multiples of it). Two bits per unit, in two bitmaps after the segment struct:
 *   clean  lazy
 *     1     0    untouched: not handed out since mapped or since MADV_DONTNEED (reads as zero)
 *     1     1    given back with MADV_FREE, not handed out since (the kernel may take it)
 *     0     1    handed out again after MADV_FREE: holds data, yet the kernel still counts
 *                it as free until it rescans it, so the host check must subtract it
 *     0     0    resident: handed out, holds data
 * A unit is marked dirty when any block overlapping it is handed out, and cleaned only when
 * it lies wholly inside a free block whose pages are given back. A third bitmap, fresh,
 * marks dirty units that were untouched when handed out and have not yet been seen resident:
 * the kernel does not count their pages until they are written, so the host check does. */
#define VRAM__PAGE_UNIT ((uint64_t)2 << 20)

struct vram__segment {
    uintptr_t addr;
    uint64_t size;
    vram_stream_t stream;
    uint8_t is_small;
    uint8_t oversize;            /* counted in oversize_segments */
    vram__block_t *head;         /* the lowest-addressed block */
    vram__segment_t *prev, *next;
    uint64_t freed_at;           /* pool->free_clock when it last became wholly free (LRU for the cache limit) */
    uint64_t *clean, *lazy, *fresh; /* host pools: the unit bitmaps (NULL elsewhere and on expandable
                                     * segments, which unmap free pages instead) */
    /* Expandable segments: `size` is the reserved address range, tiled by blocks as usual plus
     * unmapped blocks (page-aligned, never two adjacent); reserved bytes count only `mapped`. */
    uint8_t expandable;
    uint64_t page;               /* mapping granularity */
    uint64_t mapped;             /* bytes mapped */
    vram__block_t *unmapped;     /* the unmapped blocks, unordered (linked through left/right) */
};

/* The free blocks of one pool kind, ordered by (stream, size, address) as PyTorch's
 * std::set is, so lower_bound gives the best fit on the right stream. */
typedef struct vram__free_index {
    vram__block_t *root;
    uint64_t count;
    uint64_t lookups; /* get_free_block calls: the clock behind garbage-collection ages */
    uint32_t rng;     /* xorshift state for treap priorities */
    uint8_t is_small;
} vram__free_index_t;

typedef struct vram__pending {
    void *event;
    vram__block_t *block;
} vram__pending_t;

/* Events recorded on one stream, oldest first: polling stops at the first unfinished event of
 * each stream, so a slow stream never holds back another's blocks (pytorch#71616). */
typedef struct vram__stream_queue {
    vram_stream_t stream;
    vram__pending_t *items; /* ring buffer */
    uint64_t head, count, capacity;
} vram__stream_queue_t;

typedef struct vram__history {
    vram_trace_entry_t *entries; /* ring of `capacity` */
    uint64_t capacity;
    uint64_t written;            /* total ever written; the oldest kept is written - count */
} vram__history_t;

/* What a host pool knows about the host and about its pages. */
typedef struct vram__host_state {
    int tracked;                 /* the backend can release pages: segments carry unit bitmaps */
    uint64_t reclaimable_units;  /* units with clean = 1 */
    uint64_t lazy_reused_units;  /* units with clean = 0, lazy = 1 */
    uint64_t fresh_units;        /* units with fresh = 1 */
    /* The last host reading (the check reuses it for small segments for up to 100 ms). */
    vram_host_memory_t reading;
    uint64_t lazy_reused, unfaulted; /* subtracted from it: reused after MADV_FREE, handed out untouched */
    uint64_t room;               /* reading.available minus those two */
    uint64_t read_ns, mapped_since;
    int reading_valid;
    int rejected;                /* the current slow path was refused by the host check */
    uint64_t refused_size;       /* the size that check refused (a segment, or pages to map) */
} vram__host_state_t;

struct vram_pool {
    vram__mutex_t lock;
    const vram_backend_t *backend;
    void *ctx;
    vram_device_t device;
    uint64_t total_capacity;     /* backend total at creation, the base of memory_fraction */
    vram_settings_t settings;

    vram__free_index_t small, large;
    vram__segment_t *segments;   /* every segment, newest first */
    vram__ptrmap_t live;         /* address -> allocated block */
    vram_stats_t stats;

    vram__stream_queue_t *queues;
    uint64_t num_queues, cap_queues, num_pending;

    vram__history_t history;
    int history_on;              /* read without the lock by vram_history_enabled */

    uint64_t whole_free_segments; /* segments that are one free block (releasable) */
    uint64_t whole_free_bytes;   /* their bytes: what empty_cache would release */
    uint64_t free_clock;         /* ticks each time a segment becomes wholly free */
    vram__host_state_t host;     /* host pools only (backend->host_memory / release_pages) */

    vram__block_t *spare_blocks; /* recycled block structs, linked through ->next */
    uint64_t num_spare;
    uintptr_t fresh_lo, fresh_hi; /* expandable: pages the current malloc mapped (empty if none) */
    int quiet_oom;               /* 1: an OOM here is expected (a trace replay): no OOM callback */
    void **block_chunks;         /* slabs to free at destroy */
    uint64_t num_chunks, cap_chunks;
};

/* blocks.c: block structs come from per-pool slabs, so malloc stays off the hot path. */
vram_status_t vram__reserve_blocks(vram_pool_t *pool, uint64_t needed);
vram__block_t *vram__block_new(vram_pool_t *pool); /* only after a successful reserve */
void vram__block_delete(vram_pool_t *pool, vram__block_t *block);
void vram__free_all_blocks(vram_pool_t *pool);

/* segments.c (pool lock held): what classic and expandable segments share. */
/* Fill in `seg` as [addr, addr + size) on (stream, pool kind), tiled by one new block (not in
 * the index; needs a reserved block struct), and put it first in the pool's list. Returns the
 * block. The caller sets what is particular to the segment's layout. */
vram__block_t *vram__segment_add(vram_pool_t *pool, vram__segment_t *seg, uintptr_t addr, uint64_t size,
                                 vram_stream_t stream, int is_small);
/* Take `seg` out of the pool's list and free it with its one remaining block (its backend
 * memory is the caller's to give back). */
void vram__segment_remove(vram_pool_t *pool, vram__segment_t *seg);
/* A new block of [addr, addr + size) linked into block's chain right after it (after = 1) or
 * right before it; needs a reserved block struct. The caller sets its state. */
vram__block_t *vram__block_splice(vram_pool_t *pool, vram__block_t *block, uintptr_t addr, uint64_t size, int after);
/* `block` takes over the range of its neighbour `gone` (block->prev or block->next), which
 * leaves the chain; the caller takes gone out of the index or list that holds it, then
 * deletes it. */
void vram__block_absorb(vram__block_t *block, vram__block_t *gone);
/* Merge a block that has just become free (in no index) with its free neighbours and put the
 * result in the index: how both layouts free a block, and how an expandable segment adds
 * newly mapped pages to the free space around them. Returns how many neighbours it absorbed,
 * and their bytes through *absorbed_bytes (unless NULL). */
int vram__merge_free(vram_pool_t *pool, vram__block_t *block, uint64_t *absorbed_bytes);

/* index.c */
void vram__index_insert(vram__free_index_t *index, vram__block_t *block);
void vram__index_remove(vram__free_index_t *index, vram__block_t *block);
/* Put `fresh` (not in the index) where `old` (in it) was, and take `old` out. When fresh's key
 * falls between old's neighbours, fresh simply takes over old's node: one descent instead of a
 * remove and an insert. Splits and merges nearly always qualify. */
void vram__index_replace(vram__free_index_t *index, vram__block_t *old, vram__block_t *fresh);
/* Smallest block whose (stream, size, addr) key is >= (stream, size, 0); any stream. */
vram__block_t *vram__index_lower_bound(const vram__free_index_t *index, vram_stream_t stream, uint64_t size);
/* Largest block whose key is < (stream, size, addr). */
vram__block_t *vram__index_before(const vram__free_index_t *index, vram_stream_t stream, uint64_t size,
                                  uintptr_t addr);
/* The next block in key order after `block` (in the index), or NULL. */
vram__block_t *vram__index_after(const vram__free_index_t *index, const vram__block_t *block);
/* Verify order and heap shape; returns the node count through *count, or a status. */
vram_status_t vram__index_check(const vram__free_index_t *index, uint64_t *count);

/* PyTorch's Stat semantics, inline because malloc and free update about ten stats each:
 * increase raises current, peak and allocated; decrease lowers current and raises freed. */
static inline void vram__stat_increase(vram_stat_t *stat, int64_t amount) {
    stat->current += amount;
    if (stat->current > stat->peak) stat->peak = stat->current;
    stat->allocated += amount;
}
static inline void vram__stat_decrease(vram_stat_t *stat, int64_t amount) {
    stat->current -= amount;
    stat->freed += amount;
}
/* Apply to the aggregate entry and to the block's pool entry. */
static inline void vram__stat_array_increase(vram_stat_t *array, int is_small, int64_t amount) {
    vram__stat_increase(&array[VRAM_STAT_ALL], amount);
    vram__stat_increase(&array[is_small ? VRAM_STAT_SMALL_POOL : VRAM_STAT_LARGE_POOL], amount);
}
static inline void vram__stat_array_decrease(vram_stat_t *array, int is_small, int64_t amount) {
    vram__stat_decrease(&array[VRAM_STAT_ALL], amount);
    vram__stat_decrease(&array[is_small ? VRAM_STAT_SMALL_POOL : VRAM_STAT_LARGE_POOL], amount);
}
/* A net change applied as one increase or one decrease, as PyTorch does for inactive_split,
 * so that "Tot Alloc" and "Tot Freed" match its figures. */
static inline void vram__stat_array_change(vram_stat_t *array, int is_small, int64_t delta) {
    if (delta > 0) vram__stat_array_increase(array, is_small, delta);
    else if (delta < 0) vram__stat_array_decrease(array, is_small, -delta);
}

/* config.c */
/* Defaults; `host` gives the host_* options their host-pool defaults (else they are off). */
void vram__settings_default(vram_settings_t *settings, int host);
/* Parse options into settings (all or nothing). host_* options apply to host pools; elsewhere
 * they are an error when `strict` (vram_configure) and ignored otherwise (VRAMKIT_ALLOC_CONF,
 * which every pool reads). */
vram_status_t vram__settings_parse(const char *conf, const char *origin, vram_settings_t *settings, int host,
                                   int strict);
void vram__settings_update_allowed(vram_settings_t *settings, uint64_t total_capacity);
uint64_t vram__round_size(const vram_settings_t *settings, uint64_t size);
uint64_t vram__segment_size(uint64_t rounded);

/* history.c (call with the pool lock held) */
void vram__trace_record(vram_pool_t *pool, vram_trace_action_t action, uint64_t addr, uint64_t size,
                        vram_stream_t stream, uint64_t context, uint64_t device_free);

/* events.c (pool lock held) */
/* Make room to queue one event per recorded stream use, before anything changes. */
vram_status_t vram__reserve_events(vram_pool_t *pool, const vram__block_t *block);
/* Queue the events of a freed block (cannot fail after vram__reserve_events). */
void vram__insert_events(vram_pool_t *pool, vram__block_t *block);
void vram__process_events(vram_pool_t *pool);
void vram__synchronize_and_free_events(vram_pool_t *pool);
void vram__free_queues(vram_pool_t *pool);

/* Most pools never record history: test that inline before paying for a call. */
static inline void vram__trace(vram_pool_t *pool, vram_trace_action_t action, uint64_t addr, uint64_t size,
                               vram_stream_t stream, uint64_t context, uint64_t device_free) {
    if (pool->history.capacity) vram__trace_record(pool, action, addr, size, stream, context, device_free);
}

/* pool.c (pool lock held) */
void vram__free_block(vram_pool_t *pool, vram__block_t *block, uint64_t context);
static inline vram__free_index_t *vram__index_for(vram_pool_t *pool, int is_small) {
    return is_small ? &pool->small : &pool->large;
}
static inline int vram__is_split(const vram__block_t *block) { return block->prev || block->next; }
/* A segment that is one free block: the classic policy releases such segments whole.
 * Expandable segments release page by page instead (expandable.c). */
static inline int vram__is_whole_free(const vram__block_t *block) {
    return block->in_index && !block->prev && !block->next && !block->segment->expandable;
}

/* release.c (pool lock held) */
void vram__release_block(vram_pool_t *pool, vram__block_t *block, uint64_t context);
void vram__release_cached_blocks(vram_pool_t *pool, uint64_t context);
int vram__release_available_cached_blocks(vram_pool_t *pool, vram__free_index_t *index, vram_stream_t stream,
                                          uint64_t rounded, uint64_t context);
void vram__garbage_collect(vram_pool_t *pool, uint64_t context);

/* pages.c (pool lock held): the unit bitmaps of host pools. */
vram_status_t vram__pages_attach(vram_pool_t *pool, vram__segment_t **seg); /* realloc seg with bitmaps */
/* A block is handed out: dirty its units. Returns 1 if every unit it overlaps was untouched,
 * so its memory is known to be zero. */
int vram__pages_take_slow(vram_pool_t *pool, const vram__block_t *block);
/* A block became free (after merging): give its whole units back if enough hold memory. */
void vram__pages_release_free(vram_pool_t *pool, vram__block_t *block);

/* The hot paths inline: a cached block whose units all hold memory already (the steady state
 * of a loop that reuses its blocks) needs one word read, and a free block smaller than the
 * release threshold needs nothing. */
static inline int vram__pages_take(vram_pool_t *pool, const vram__block_t *block) {
    const vram__segment_t *seg = block->segment;
    uint64_t first = (block->addr - seg->addr) / VRAM__PAGE_UNIT;
    uint64_t last = (block->addr + block->size - 1 - seg->addr) / VRAM__PAGE_UNIT;
    if (first / 64 == last / 64) {
        uint64_t span = last - first + 1;
        uint64_t mask = (span == 64 ? ~(uint64_t)0 : (((uint64_t)1 << span) - 1)) << (first % 64);
        if (!(seg->clean[first / 64] & mask)) return 0;
    }
    return vram__pages_take_slow(pool, block);
}
static inline void vram__pages_on_free(vram_pool_t *pool, vram__block_t *block) {
    uint64_t threshold = pool->settings.host_page_release;
    if (threshold != VRAM_NO_LIMIT && block->size >= threshold && block->size >= VRAM__PAGE_UNIT)
        vram__pages_release_free(pool, block);
}
/* A segment is about to be unmapped: drop its units from the counters. */
void vram__pages_drop(vram_pool_t *pool, const vram__segment_t *seg);
/* Every pool's lazily reused bytes (what MemAvailable overstates), process-wide. */
uint64_t vram__pages_lazy_reused_total(void);
/* Bytes this pool handed out from untouched pages that are still not resident (mincore over
 * the fresh units; units found wholly resident stop being fresh). */
uint64_t vram__pages_unfaulted(vram_pool_t *pool);
/* Recount the units and verify that no block in use lies on a unit marked clean. */
vram_status_t vram__pages_check(const vram_pool_t *pool);

/* host.c (pool lock held) */
/* Before mapping `size` more bytes: VRAM_OK, or VRAM_ERR_OOM if the host cannot give them. */
vram_status_t vram__host_check_room(vram_pool_t *pool, uint64_t size);
/* Release the least recently freed whole segments while the cache is over its limit. */
void vram__host_enforce_cache_limit(vram_pool_t *pool, uint64_t context);
/* The limit counts what it can act on: memory in wholly free segments. Free pieces of
 * segments in use, and blocks waiting for other streams, cannot be unmapped; counting them
 * would unmap every segment freed while they alone exceed the limit. */
static inline int vram__over_cache_limit(const vram_pool_t *pool) {
    return pool->whole_free_bytes > pool->settings.host_cache_limit;
}
/* A segment became wholly free (added = 1), or stopped being so (added = 0). */
static inline void vram__whole_free_count(vram_pool_t *pool, const vram__segment_t *seg, int added) {
    if (added) {
        pool->whole_free_segments++;
        pool->whole_free_bytes += seg->size;
    } else {
        pool->whole_free_segments--;
        pool->whole_free_bytes -= seg->size;
    }
}

/* expandable.c (pool lock held): PyTorch's expandable segments. */
/* Map pages for a free block of at least `rounded` bytes on (stream, pool kind): extend a free
 * block with the unmapped space after it, map a hole, or reserve a new range. *out is in the
 * free index. VRAM_ERR_OOM (no message) when the device, the limit or the host has no room;
 * with *use_classic set when it is the process's address-space limit that leaves no room for
 * a new range, so the caller maps a classic segment for the request instead. */
vram_status_t vram__expandable_alloc(vram_pool_t *pool, int is_small, vram_stream_t stream, uint64_t rounded,
                                     uint64_t context, int is_retry, int *use_classic, vram__block_t **out);
/* Bytes of mapped pages that are not resident (host pools): the kernel has not counted them
 * yet, so the host check must (all mapped pages, free ones too: a conservative figure). */
uint64_t vram__expandable_unfaulted(vram_pool_t *pool);
/* Unmap the whole pages inside a free block (it stays free around them). */
void vram__expandable_unmap(vram_pool_t *pool, vram__block_t *block, uint64_t context);
/* empty_cache for expandable segments: unmap every free page, release ranges left empty. */
void vram__expandable_release_all(vram_pool_t *pool, uint64_t context);
/* pool destruction: unmap what is mapped and release the range. */
void vram__expandable_destroy(vram_pool_t *pool, vram__segment_t *seg);
/* get_free_block's tie-break for an expandable block: PyTorch's walk to the next candidate
 * whose size plus the unmapped space after it is smaller. */
vram__block_t *vram__expandable_best(vram__free_index_t *index, vram__block_t *block);
/* The mapped run around a block (for snapshots and block queries). */
void vram__expandable_run(const vram__block_t *block, uintptr_t *addr, uint64_t *size);
/* Verify a segment's unmapped blocks and mapped byte count. */
vram_status_t vram__expandable_check(const vram__segment_t *seg);

/* backends/sim.c: a simulated backend ctx (for vram_backend_sim()) whose addresses come from a
 * range of its own, starting at 2^48 like the shared one, instead of the process-wide range that
 * every simulated device draws from. For stand-alone pools that nothing finds by address and
 * that a process may create by the thousand (vram_trace_replay): the shared range (8 PiB,
 * never reused) would run out. Its addresses may equal other simulated devices'. */
vram_status_t vram__backend_sim_ctx_private(uint64_t total_bytes, void **ctx);
/* A ctx for a private pool on a simulated device: its own streams and addresses from the shared
 * range, drawing on the device's capacity (device_ctx is the device pool's ctx). */
vram_status_t vram__backend_sim_ctx_sharing(void *device_ctx, void **ctx);
/* mempool.c, for the registry: the private pool a name ("<device>/mempool:N") refers to, and
 * the private pool owning a live pointer (1 if found). Lock order: registry, mempools, pool. */
vram_status_t vram__mempool_get(vram_device_t name, vram_pool_t **out);
int vram__mempool_owner(const void *ptr, vram_pool_t **out);
/* Whether this thread is inside any vram_mempool_use (then allocations may go elsewhere). */
int vram__mempools_in_use(void);
/* The device's own pool if it has been made, else NULL; takes no lock (pools are never
 * destroyed), for the hot path of torch's hooks. */
vram_pool_t *vram__known_pool(int kind, int index);

/* oom.c (pool lock held) */
vram_status_t vram__report_oom(vram_pool_t *pool, uint64_t requested, uint64_t segment_size,
                               vram_stream_t stream, uint64_t context);

#endif
