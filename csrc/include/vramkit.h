/*
 * vramkit.h — the one public C header of vramkit.
 *
 * Usable from C without Python: a caching allocator for CUDA memory, host memory and
 * simulated devices, with PyTorch-compatible counters, an allocation history and an
 * invariant checker.
 *
 * Conventions: public symbols start with `vram_`, macros with `VRAM_`. Every function that
 * can fail returns a vram_status_t (VRAM_OK == 0) and leaves a message for the calling
 * thread in vram_last_error(). The library never prints.
 */
#ifndef VRAMKIT_H
#define VRAMKIT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define VRAM_API __attribute__((visibility("default")))
#define VRAM_NODISCARD __attribute__((warn_unused_result))
#else
#define VRAM_API
#define VRAM_NODISCARD
#endif

/* ======================================================================================
 * Version
 * ====================================================================================== */

/* Bump together with pyproject.toml and python/vramkit/__init__.py. */
#define VRAM_VERSION_MAJOR 0
#define VRAM_VERSION_MINOR 1
#define VRAM_VERSION_PATCH 0
#define VRAM_VERSION_STRING "0.1.0"

/* ======================================================================================
 * Status
 * ====================================================================================== */

typedef enum vram_status {
    VRAM_OK = 0,
    VRAM_ERR_INVALID_ARG = 1, /* a bad value from the caller: size, pointer, option, device */
    VRAM_ERR_OOM = 2,         /* the device, or its configured limit, has no room */
    VRAM_ERR_BACKEND = 3,     /* the backend failed for another reason (a CUDA error) */
    VRAM_ERR_UNAVAILABLE = 4, /* the device does not exist here (no driver, no such index) */
    VRAM_ERR_CORRUPT = 5,     /* vram_pool_check found a broken invariant */
    VRAM_ERR_HOST_MEMORY = 6, /* host malloc for vramkit's own bookkeeping failed */
    VRAM_ERR_INFEASIBLE = 7,  /* no schedule fits the memory budget (the message names the least that does) */
} vram_status_t;

/* The message of the last failure on this thread ("" if none). Valid until the next call. */
VRAM_API const char *vram_last_error(void);
/* A stable name for a status code, e.g. "VRAM_ERR_OOM". */
VRAM_API const char *vram_status_name(vram_status_t status);

/* The figures behind this thread's last VRAM_ERR_OOM, for structured exceptions. */
typedef struct vram_oom_info {
    int device_kind, device_index; /* vram_device_kind_t and index */
    uint64_t requested;    /* the caller's size */
    uint64_t segment_size; /* the backend allocation that failed */
    uint64_t device_free, device_total;
    uint64_t allocated, reserved;
    uint64_t allowed;      /* the cap on reserved bytes, UINT64_MAX when none */
} vram_oom_info_t;
VRAM_API void vram_last_oom(vram_oom_info_t *out);

/* ======================================================================================
 * Devices
 * ====================================================================================== */

typedef enum vram_device_kind {
    VRAM_DEVICE_CPU = 0,  /* host memory, mmap'd page-aligned segments */
    VRAM_DEVICE_CUDA = 1, /* cudaMalloc'd device memory */
    VRAM_DEVICE_SIM = 2,  /* a simulated device: addresses only, no memory behind them */
} vram_device_kind_t;

typedef struct vram_device {
    vram_device_kind_t kind;
    int index; /* 0 for cpu */
} vram_device_t;

/* Largest accepted request: sizes at or above 2^62 are rejected as absurd. */
#define VRAM_MAX_REQUEST ((uint64_t)1 << 62)
/* Streams are opaque 64-bit handles: a cudaStream_t on CUDA, a logical queue id elsewhere. */
typedef uint64_t vram_stream_t;
#define VRAM_ALL_STREAMS UINT64_MAX

/* Parse "cpu", "cuda", "cuda:N", "sim:N". Does not check that the device exists. */
VRAM_API vram_status_t vram_device_parse(const char *text, vram_device_t *out);
/* Write the canonical name ("cpu", "cuda:0", "sim:1"); returns what snprintf returns. */
VRAM_API int vram_device_format(vram_device_t device, char *buf, size_t len);
/* Number of CUDA devices usable now; 0 without a driver or without CUDA support. */
VRAM_API int vram_cuda_device_count(void);
/* 1 if vramkit was compiled with CUDA support (whether or not a GPU is present). */
VRAM_API int vram_cuda_compiled(void);
/* Create a simulated device of the given capacity; its name is "sim:<out->index>". */
VRAM_API VRAM_NODISCARD vram_status_t vram_sim_create(uint64_t total_bytes, vram_device_t *out);
/* Number of simulated devices created so far. */
VRAM_API int vram_sim_count(void);

/* ======================================================================================
 * Pools
 * ====================================================================================== */

typedef struct vram_pool vram_pool_t;

/* Host memory as the kernel and this process's cgroup see it: what the cpu pool checks before
 * it maps a new segment. On Linux mmap almost never fails (overcommit), so a host caching
 * allocator that waited for a failure would be stopped by the OOM killer instead. */
typedef struct vram_host_memory {
    uint64_t total;              /* what this process may use: min(MemTotal, cgroup limit) */
    uint64_t available;          /* what it can still map and touch: min(MemAvailable + SwapFree, the
                                  * cgroup's limit - (usage - inactive file pages) + its free swap) */
    uint64_t ram_total;          /* MemTotal */
    uint64_t mem_available;      /* MemAvailable (page cache and lazily freed pages count as free) */
    uint64_t swap_free;          /* SwapFree */
    uint64_t cgroup_limit;       /* the tightest memory limit on the way to the root; UINT64_MAX if none */
    uint64_t cgroup_usage;       /* that cgroup's usage (memory.current / memory.usage_in_bytes) */
    uint64_t cgroup_reclaimable; /* of which inactive file pages, which the kernel reclaims first */
    int cgroup_version;          /* 1 or 2 for the memory controller found, 0 if none */
    char cgroup_path[244];       /* directory of the cgroup whose limit binds ("" if none) */
} vram_host_memory_t;
/* Read the host's memory now (about 10 us, more with a cgroup limit). Never fails on Linux; on
 * other systems the cgroup fields stay empty. */
VRAM_API VRAM_NODISCARD vram_status_t vram_host_memory(vram_host_memory_t *out);

/* The backend a pool draws segments from. Host backends (cpu, sim) simulate streams: work
 * queued on a stream counts as finished once vram_pool_synchronize() is called for it. */
typedef struct vram_backend {
    const char *name;
    vram_status_t (*segment_alloc)(void *ctx, uint64_t size, vram_stream_t stream, uintptr_t *out);
    void (*segment_free)(void *ctx, uintptr_t addr, uint64_t size);
    vram_status_t (*mem_info)(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes);
    /* Block until work on `stream` (or every stream for VRAM_ALL_STREAMS) has finished. */
    vram_status_t (*synchronize)(void *ctx, vram_stream_t stream);
    /* Events mark a point in a stream; query returns 1 when reached, 0 if not yet. */
    vram_status_t (*event_record)(void *ctx, vram_stream_t stream, void **event);
    vram_status_t (*event_query)(void *ctx, void *event, int *done);
    vram_status_t (*event_synchronize)(void *ctx, void *event);
    void (*event_destroy)(void *ctx, void *event);
    void (*destroy)(void *ctx);
    /* Host backends only (NULL elsewhere). Give the pages of [addr, addr + size) back to the
     * kernel but keep the range mapped: lazily when allow_lazy (MADV_FREE: the kernel takes
     * them only under pressure, and reuse before that costs nothing), else at once
     * (MADV_DONTNEED). *lazy tells which was done. The pool ignores a failure (the pages
     * then simply stay), so this need not write an error message. */
    vram_status_t (*release_pages)(void *ctx, uintptr_t addr, uint64_t size, int allow_lazy, int *lazy);
    /* Host backends only (NULL elsewhere): the host's memory now. A pool whose backend has it
     * checks each new segment against it (host_memory_check). */
    vram_status_t (*host_memory)(void *ctx, vram_host_memory_t *out);
    /* Host backends only (NULL elsewhere): how many bytes of [addr, addr + size) are resident
     * (mincore). Memory handed out but not yet touched is not in the kernel's figures; the
     * host check counts it as if it will be. A failure here is ignored by the pool. */
    vram_status_t (*resident_bytes)(void *ctx, uintptr_t addr, uint64_t size, uint64_t *bytes);
} vram_backend_t;

/* The pool for a device, created on first use and kept for the life of the process (arrays
 * may be freed during interpreter teardown). Creation reads VRAMKIT_ALLOC_CONF. */
VRAM_API VRAM_NODISCARD vram_status_t vram_device_pool(vram_device_t device, vram_pool_t **out);
/* The pool that owns a live pointer, if any (VRAM_ERR_INVALID_ARG otherwise). */
VRAM_API VRAM_NODISCARD vram_status_t vram_find_pool(const void *ptr, vram_pool_t **out);

/* Stand-alone pools, for C users and tests. The pool takes ownership of `backend_ctx` and
 * calls backend->destroy on it. `conf` uses VRAMKIT_ALLOC_CONF syntax; NULL means defaults. */
VRAM_API VRAM_NODISCARD vram_status_t vram_pool_create(const vram_backend_t *backend, void *backend_ctx,
                                                       vram_device_t device, const char *conf,
                                                       vram_pool_t **out);
VRAM_API void vram_pool_destroy(vram_pool_t *pool);
VRAM_API vram_device_t vram_pool_device(const vram_pool_t *pool);

/* Backend constructors: the returned ctx goes to vram_pool_create with the vtable. */
VRAM_API const vram_backend_t *vram_backend_cpu(void);
VRAM_API const vram_backend_t *vram_backend_sim(void);
VRAM_API const vram_backend_t *vram_backend_cuda(void);
VRAM_API VRAM_NODISCARD vram_status_t vram_backend_cpu_ctx(void **ctx);
VRAM_API VRAM_NODISCARD vram_status_t vram_backend_sim_ctx(uint64_t total_bytes, void **ctx);
VRAM_API VRAM_NODISCARD vram_status_t vram_backend_cuda_ctx(int device_index, void **ctx);

/* Allocate `size` bytes for use on `stream`. size 0 gives *out = NULL and changes nothing.
 * `context` is an opaque id recorded in the history and snapshot (0 for none); the Python
 * layer passes an interned stack id. */
VRAM_API VRAM_NODISCARD vram_status_t vram_malloc(vram_pool_t *pool, uint64_t size, vram_stream_t stream,
                                                  uint64_t context, void **out);
/* vram_malloc, zero-filled: host pools only (VRAM_ERR_INVALID_ARG elsewhere). Pages that were
 * never handed out since they were mapped are known to be zero and are not written, so a
 * large calloc from a fresh segment costs no memory until it is used, as with glibc. */
VRAM_API VRAM_NODISCARD vram_status_t vram_calloc(vram_pool_t *pool, uint64_t size, vram_stream_t stream,
                                                  uint64_t context, void **out);
/* 1 if the pool's backend is host memory (cpu): the host_* options and counters apply. */
VRAM_API int vram_pool_is_host(const vram_pool_t *pool);
/* Return a pointer from vram_malloc. NULL is a no-op. An unknown or already freed pointer is
 * VRAM_ERR_INVALID_ARG and changes nothing. */
VRAM_API VRAM_NODISCARD vram_status_t vram_free(vram_pool_t *pool, void *ptr, uint64_t context);
/* Free `ptr` if this pool owns it: *freed = 1, or *freed = 0 and nothing changes (no error
 * message is formatted, so probing the likely pool first is cheap). */
VRAM_API VRAM_NODISCARD vram_status_t vram_try_free(vram_pool_t *pool, void *ptr, uint64_t context, int *freed);
/* Mark a live block as used on another stream: it is not reused until the work queued on
 * that stream at free time has finished (PyTorch's Tensor.record_stream). */
VRAM_API VRAM_NODISCARD vram_status_t vram_record_stream(vram_pool_t *pool, void *ptr, vram_stream_t stream);
/* Wait for `stream` (or VRAM_ALL_STREAMS), then return blocks whose events completed. */
VRAM_API VRAM_NODISCARD vram_status_t vram_pool_synchronize(vram_pool_t *pool, vram_stream_t stream);

typedef struct vram_block_info {
    uint64_t address, size, requested_size;
    vram_stream_t stream;
    uint64_t segment_address, segment_size;
    int is_small_pool;
} vram_block_info_t;
/* Describe the live allocation that starts at `ptr`. */
VRAM_API VRAM_NODISCARD vram_status_t vram_block_query(vram_pool_t *pool, const void *ptr,
                                                       vram_block_info_t *out);

/* Release every cached segment that is wholly free (after waiting on outstanding events).
 * *released (may be NULL) receives the bytes returned to the backend. */
VRAM_API VRAM_NODISCARD vram_status_t vram_empty_cache(vram_pool_t *pool, uint64_t *released);
VRAM_API VRAM_NODISCARD vram_status_t vram_mem_get_info(vram_pool_t *pool, uint64_t *free_bytes,
                                                        uint64_t *total_bytes);
/* Cap reserved memory at fraction × total capacity (0 <= fraction <= 1; 1 removes the cap). */
VRAM_API VRAM_NODISCARD vram_status_t vram_set_memory_fraction(vram_pool_t *pool, double fraction);
/* Cap reserved memory at an absolute number of bytes (VRAM_NO_LIMIT removes the cap). */
#define VRAM_NO_LIMIT UINT64_MAX
VRAM_API VRAM_NODISCARD vram_status_t vram_set_memory_limit(vram_pool_t *pool, uint64_t limit_bytes);
/* Apply options in VRAMKIT_ALLOC_CONF syntax ("max_split_size_mb:128,..."). All or nothing:
 * on error the pool keeps its previous settings. */
VRAM_API VRAM_NODISCARD vram_status_t vram_configure(vram_pool_t *pool, const char *conf);

typedef struct vram_settings {
    uint64_t max_split_size;          /* UINT64_MAX when unlimited */
    uint64_t max_non_split_rounding;  /* bytes an oversize block may exceed a request by */
    uint32_t roundup_power2_divisions[16]; /* per 1 MiB..64 GiB power-of-two interval */
    double garbage_collection_threshold;   /* 0 when off */
    double memory_fraction;           /* 1 when no fraction cap */
    uint64_t memory_limit;            /* VRAM_NO_LIMIT when no absolute cap */
    uint64_t allowed_bytes;           /* the effective cap on reserved bytes now */
    /* Host pools (cpu) only; the host_* options of VRAMKIT_ALLOC_CONF. */
    int host_memory_check;            /* 1: refuse a new segment the host cannot give (then the OOM ladder) */
    int host_lazy_free;               /* 1: give pages back with MADV_FREE, 0: MADV_DONTNEED */
    uint64_t host_reserve;            /* bytes the check leaves to the rest of the process and host */
    uint64_t host_page_release;       /* give a free block's pages back once this many bytes of them hold
                                       * memory; VRAM_NO_LIMIT: never */
    uint64_t host_cache_limit_bytes;  /* configured cap on cached bytes; VRAM_NO_LIMIT: none */
    double host_cache_limit_fraction; /* configured cap as a fraction of total capacity; < 0: none */
    uint64_t host_cache_limit;        /* the effective cap on bytes in wholly free cached segments (what
                                       * empty_cache would release); UINT64_MAX: none */
} vram_settings_t;
VRAM_API VRAM_NODISCARD vram_status_t vram_get_settings(vram_pool_t *pool, vram_settings_t *out);

/* Walk every segment, block, index and counter and verify the allocator's invariants.
 * VRAM_OK, or VRAM_ERR_CORRUPT with the first violation in vram_last_error(). */
VRAM_API VRAM_NODISCARD vram_status_t vram_pool_check(vram_pool_t *pool);

/* ======================================================================================
 * Stats
 * ====================================================================================== */

/* The nine stat arrays in memory_summary() row order: X(key, summary label, is_bytes).
 * Each array has all / small_pool / large_pool × current / peak / allocated / freed. */
#define VRAM_STAT_ARRAYS(X)                                    \
    X(allocated_bytes, "Allocated memory", 1)                  \
    X(active_bytes, "Active memory", 1)                        \
    X(requested_bytes, "Requested memory", 1)                  \
    X(reserved_bytes, "GPU reserved memory", 1)                \
    X(inactive_split_bytes, "Non-releasable memory", 1)        \
    X(allocation, "Allocations", 0)                            \
    X(active, "Active allocs", 0)                              \
    X(segment, "GPU reserved segments", 0)                     \
    X(inactive_split, "Non-releasable allocs", 0)

/* Single stats without a pool split: X(key, summary label). */
#define VRAM_STAT_SINGLES(X)                               \
    X(oversize_allocations, "Oversize allocations")        \
    X(oversize_segments, "Oversize GPU segments")

/* Event counters, zeroed by reset_accumulated: X(key). */
#define VRAM_STAT_COUNTERS(X) \
    X(num_alloc_retries)      \
    X(num_ooms)               \
    X(num_sync_all_streams)   \
    X(num_device_alloc)       \
    X(num_device_free)

/* Host pools' event counters (reported for cpu only), zeroed by reset_accumulated: X(key).
 *   num_host_page_releases         madvise calls that gave a free block's pages back
 *   num_host_cache_limit_releases  segments unmapped because the cache exceeded its limit
 *   num_host_memory_rejections     new segments refused because the host could not give them */
#define VRAM_HOST_COUNTERS(X)         \
    X(num_host_page_releases)         \
    X(num_host_cache_limit_releases)  \
    X(num_host_memory_rejections)

/* The pool-type index order is PyTorch's StatType: aggregate, small, large. */
enum { VRAM_STAT_ALL = 0, VRAM_STAT_SMALL_POOL = 1, VRAM_STAT_LARGE_POOL = 2, VRAM_STAT_TYPES = 3 };

typedef struct vram_stat {
    int64_t current, peak, allocated, freed;
} vram_stat_t;

#define VRAM_STATS_VERSION 2
typedef struct vram_stats {
    uint64_t size;    /* sizeof(vram_stats_t) as the caller knows it */
    uint32_t version; /* VRAM_STATS_VERSION */
#define VRAM__STAT_ARRAY_FIELD(key, label, is_bytes) vram_stat_t key[VRAM_STAT_TYPES];
    VRAM_STAT_ARRAYS(VRAM__STAT_ARRAY_FIELD)
#undef VRAM__STAT_ARRAY_FIELD
#define VRAM__STAT_SINGLE_FIELD(key, label) vram_stat_t key;
    VRAM_STAT_SINGLES(VRAM__STAT_SINGLE_FIELD)
#undef VRAM__STAT_SINGLE_FIELD
#define VRAM__STAT_COUNTER_FIELD(key) int64_t key;
    VRAM_STAT_COUNTERS(VRAM__STAT_COUNTER_FIELD)
#undef VRAM__STAT_COUNTER_FIELD
    int64_t max_split_size; /* -1 when unlimited, as PyTorch reports it */
    /* Host pools (cpu) only, 0 elsewhere. */
    int64_t host_cache_limit;       /* the cap on bytes in wholly free cached segments; -1 when none */
    int64_t host_reclaimable_bytes; /* cached bytes whose pages hold nothing the kernel cannot take back
                                     * (given back with madvise, or never touched) */
    int64_t host_lazy_reused_bytes; /* bytes handed out again after MADV_FREE: the kernel still counts
                                     * them as free, so the host check subtracts them */
    int64_t host_untouched_bytes;   /* bytes handed out from never-touched pages that the last host
                                     * check (or vram_mem_get_info) had not yet seen resident, in
                                     * whole 2 MiB units; the check counts their unfaulted pages as
                                     * used. Between checks it only grows. */
#define VRAM__HOST_COUNTER_FIELD(key) int64_t key;
    VRAM_HOST_COUNTERS(VRAM__HOST_COUNTER_FIELD)
#undef VRAM__HOST_COUNTER_FIELD
    int64_t reserved_for_growth[1];
} vram_stats_t;

/* Copy the counters. Set out->size = sizeof(vram_stats_t) first. */
VRAM_API VRAM_NODISCARD vram_status_t vram_get_stats(vram_pool_t *pool, vram_stats_t *out);
/* peak = current for every stat (torch.cuda.reset_peak_memory_stats). */
VRAM_API void vram_reset_peak(vram_pool_t *pool);
/* allocated = freed = 0 and event counters = 0 (torch.cuda.reset_accumulated_memory_stats). */
VRAM_API void vram_reset_accumulated(vram_pool_t *pool);
/* PyTorch's 75-column memory_summary table, NUL-terminated, malloc'd: free() it. */
VRAM_API VRAM_NODISCARD vram_status_t vram_memory_summary(vram_pool_t *pool, int abbreviated, char **out);
/* c10's format_size for messages: "512 bytes", "20.00 MiB". Returns snprintf's value. */
VRAM_API int vram_format_size(uint64_t bytes, char *buf, size_t len);

/* ======================================================================================
 * History
 * ====================================================================================== */

typedef enum vram_trace_action {
    VRAM_TRACE_ALLOC = 0,
    VRAM_TRACE_FREE_REQUESTED = 1,
    VRAM_TRACE_FREE_COMPLETED = 2,
    VRAM_TRACE_SEGMENT_ALLOC = 3,
    VRAM_TRACE_SEGMENT_FREE = 4,
    VRAM_TRACE_OOM = 5,
    VRAM_TRACE_SNAPSHOT = 6, /* PyTorch's action, not recorded by vramkit yet */
} vram_trace_action_t;

typedef struct vram_trace_entry {
    uint32_t action;      /* vram_trace_action_t */
    uint64_t addr;        /* 0 for oom */
    uint64_t size;        /* block, segment or (for oom) requested size */
    vram_stream_t stream;
    uint64_t time_ns;     /* CLOCK_MONOTONIC */
    uint64_t device_free; /* oom only: what the backend reported free */
    uint64_t context;     /* the caller's context id, 0 for none */
} vram_trace_entry_t;

/* Start recording into a ring buffer of max_entries (0 stops recording and drops it). */
VRAM_API VRAM_NODISCARD vram_status_t vram_history_enable(vram_pool_t *pool, uint64_t max_entries);
VRAM_API int vram_history_enabled(const vram_pool_t *pool);

/* ======================================================================================
 * Snapshot
 * ====================================================================================== */

typedef struct vram_snapshot_block {
    uint64_t address, size, requested_size;
    uint32_t state; /* 0 inactive, 1 active_allocated, 2 active_pending_free */
    uint64_t context;
} vram_snapshot_block_t;

typedef struct vram_snapshot_segment {
    uint64_t address, total_size, allocated_size, active_size, requested_size;
    vram_stream_t stream;
    int is_small;
    uint64_t first_block, num_blocks; /* a range in vram_snapshot_t.blocks, address order */
} vram_snapshot_segment_t;

typedef struct vram_snapshot {
    vram_device_t device;
    vram_snapshot_segment_t *segments;
    uint64_t num_segments;
    vram_snapshot_block_t *blocks;
    uint64_t num_blocks;
    vram_trace_entry_t *trace; /* oldest first */
    uint64_t num_trace;
} vram_snapshot_t;

/* Copy segments, blocks and history under one lock, so they describe the same moment. */
VRAM_API VRAM_NODISCARD vram_status_t vram_pool_snapshot(vram_pool_t *pool, vram_snapshot_t **out);
VRAM_API void vram_snapshot_free(vram_snapshot_t *snapshot);

/* ======================================================================================
 * Trace replay
 *
 * Answering "what would this allocation trace need on an N GiB GPU, with these settings?"
 * means replaying it on a simulated pool, often thousands of times (capacity bisection,
 * settings sweeps). From Python that costs a call or two per event; here the loop runs in C
 * over columns (NumPy arrays in the bindings), on a private pool created and destroyed by the
 * call, so replays never disturb the process's devices and can run on many threads at once.
 *
 * A trace is three parallel columns of n events:
 *   kind[i]   VRAM_REPLAY_ALLOC (0), VRAM_REPLAY_FREE (1); any other value is a marker
 *             (an iteration boundary, say) that the replay skips but that keeps its index,
 *             so event indices in results and messages match the caller's columns;
 *   id[i]     ALLOC/FREE: the allocation's id, >= 0, ideally dense from 0 (tables are sized
 *             by the largest id, 9 bytes per id); an id is allocated at most once per trace.
 *             Ignored for markers;
 *   size[i]   ALLOC: requested bytes, < VRAM_MAX_REQUEST; 0 is allowed (PyTorch's empty
 *             storages): the id is live but holds no block, as vram_malloc(0) gives NULL, and
 *             its FREE changes nothing. Ignored for other events;
 *   stream[i] optional (NULL: stream 0 for every event): the stream passed to vram_malloc,
 *             so blocks are reused only on their own stream, as on the device.
 * ====================================================================================== */

enum { VRAM_REPLAY_ALLOC = 0, VRAM_REPLAY_FREE = 1 };

typedef struct vram_replay_result {
    uint64_t events;                     /* events processed: n, or the OOM event's index + 1 */
    uint64_t peak_allocated;             /* max of allocated_bytes (all pools): 512-rounded block bytes,
                                          * as memory_allocated counts them */
    int64_t peak_allocated_event;        /* first event index at which that peak was reached, -1 if
                                          * nothing was ever allocated */
    uint64_t reserved_at_peak_allocated; /* reserved bytes after that event */
    uint64_t peak_reserved;              /* max of reserved_bytes: segments held from the device */
    int64_t peak_reserved_event;         /* first event index reaching it, -1 if none */
    uint64_t allocated_at_peak_reserved; /* allocated bytes after that event */
    uint64_t peak_requested;             /* max of requested_bytes (the sum of live requested sizes) */
    int64_t oom_event;                   /* index of the ALLOC that raised OOM, -1 if none */
    uint64_t final_allocated, final_reserved; /* after the last event processed */
    uint64_t num_alloc_retries, num_ooms, num_device_alloc, num_device_free; /* the pool's counters at the end */
    uint64_t segments_at_peak_reserved;  /* segments held after the peak_reserved event */
} vram_replay_result_t;

/* Replay a trace on a fresh private simulated pool of `capacity` bytes (1 .. 2^62 - 1) with
 * `conf` (VRAMKIT_ALLOC_CONF syntax, e.g. "max_split_size_mb:128"; NULL = defaults: the
 * environment variable is not read, so results depend on the arguments only). Peaks are
 * sampled after every event; within one event reserved memory only falls before it rises
 * (the OOM ladder releases, then maps), so these are the pool's true peaks.
 *
 * The pool's addresses come from a range private to the call (from 2^48, the same for every
 * replay: addr_out is reproducible), so any number of replays can run in one process without
 * using up the simulated devices' address range. Its device is named "sim:-1" (no such device
 * exists) in the OOM message.
 *
 * Stops at the first OOM: result->oom_event is set, VRAM_OK is returned, and the OOM message
 * and figures stay available through vram_last_error() / vram_last_oom() until this thread's
 * next vramkit call that fails: copy them first if you need them later.
 *
 * Per-event outputs (each NULL, or n entries):
 *   reserved_out[i], allocated_out[i]: the pool's reserved / allocated bytes after event i
 *     (the OOM event included; entries after it are left untouched);
 *   addr_out[i]: for an ALLOC the address handed out (0 for size 0 or the OOM event), 0 for
 *     every other event.
 *
 * Bad input returns VRAM_ERR_INVALID_ARG and changes nothing, not even the outputs: the
 * columns are checked in full before the pool is created, and the message names the first bad
 * event, its id and the rule, e.g. "trace event 17: free of id 5, which is not allocated".
 * Rules: FREE of an id that is not live (never allocated, or already freed); ALLOC of an id
 * that is live or was already used; id < 0; size >= VRAM_MAX_REQUEST; capacity 0 or >= 2^62;
 * n > 0 with a NULL kind, id or size; result NULL; a bad conf. VRAM_ERR_HOST_MEMORY when the id
 * tables (9 bytes per id up to the largest) or the pool's bookkeeping cannot be allocated; that
 * and any other failure during the loop leave the outputs partly written and *result unset. */
VRAM_API VRAM_NODISCARD vram_status_t vram_trace_replay(const uint8_t *kind, const int64_t *id, const uint64_t *size,
                                                        const uint64_t *stream, size_t n, uint64_t capacity,
                                                        const char *conf, uint64_t *reserved_out,
                                                        uint64_t *allocated_out, uint64_t *addr_out,
                                                        vram_replay_result_t *result);

/* ======================================================================================
 * Kernels: fused loss scaling for mixed-precision training
 *
 * Gradients of a loss multiplied by `scale` are multiplied back by inv_scale = 1/scale in
 * one pass that also detects inf/NaN (and optionally sums squares for gradient clipping).
 * Arithmetic follows PyTorch's _amp_foreach_non_finite_check_and_unscale_: each element is
 * widened to float32 (float64 tensors stay float64), multiplied, and rounded to nearest-even
 * back into its storage type.
 * ====================================================================================== */

typedef enum vram_dtype {
    VRAM_FLOAT32 = 0,
    VRAM_FLOAT16 = 1,  /* IEEE binary16 */
    VRAM_BFLOAT16 = 2, /* the upper half of a float32 */
    VRAM_FLOAT64 = 3,
} vram_dtype_t;

/* One dense tensor: `numel` elements of `dtype` from `data`, which must be aligned to the
 * element size (any other alignment is fine: misaligned starts take unaligned loads). */
typedef struct vram_tensor {
    void *data;
    int64_t numel;
    vram_dtype_t dtype;
} vram_tensor_t;

/* Bytes per element of a dtype (0 for an unknown value). */
VRAM_API size_t vram_dtype_size(vram_dtype_t dtype);

/* CPU, in place, over every tensor of the list (any mix of dtypes) in one pass:
 *   x = round_to_storage((float)x * inv_scale)   -- skipped (nothing written) if inv_scale == 1
 * *found_inf is set to 1.0f if any input or result is inf/NaN (so a finite gradient that
 * overflows when unscaled by a large inv_scale counts), and left alone otherwise: the caller
 * zeroes it, as with PyTorch. With sumsq != NULL, *sumsq receives the sum of squares of the
 * results (float32 within tiles of 1024 elements, float64 across tiles, in list order, so it
 * does not depend on the thread count). The list is split across vram_get_num_threads()
 * threads when it is large. Inf/NaN tests work on the raw exponent bits. A NaN stays NaN,
 * but which NaN (its payload bits) is unspecified when inv_scale itself is NaN, as in PyTorch. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_unscale_check(const vram_tensor_t *tensors, size_t count,
                                                            float inv_scale, float *found_inf, double *sumsq);
/* CPU, in place: x = round_to_storage((float)x * factor); nothing is written if factor == 1.
 * Used for the clip multiply of gradient clipping. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_scale_inplace(const vram_tensor_t *tensors, size_t count,
                                                            float factor);

/* The dynamic loss-scale rule. With hysteresis == 1, min_scale == 0 and max_scale == +inf it
 * is exactly torch._amp_update_scale_: on found_inf != 0 the scale is multiplied by
 * backoff_factor (in double, stored as float) and the growth tracker reset; otherwise the
 * tracker counts clean steps and at growth_interval the scale is multiplied by growth_factor
 * unless that would be inf, and the tracker reset. (PyTorch tests `tracker + 1 == interval`,
 * so a tracker restored above a since-lowered interval never grows again; here `>=`.)
 * Extensions: backoff stops at min_scale and growth
 * at max_scale (a scale already beyond a bound, set by hand or loaded from a checkpoint, is
 * not moved further out by the rule, nor pulled back); with hysteresis N > 1 only the N-th
 * consecutive overflow backs off (NVIDIA Apex's update_scale_hysteresis: the hysteresis
 * tracker refills on every clean step). */
typedef struct vram_scale_policy {
    double growth_factor;    /* finite, > 0 */
    double backoff_factor;   /* finite, > 0 */
    int32_t growth_interval; /* >= 1 */
    int32_t hysteresis;      /* >= 1; 1 backs off on every overflow (PyTorch) */
    float min_scale;         /* >= 0; 0 = no floor */
    float max_scale;         /* > 0, may be +inf (no ceiling); >= min_scale */
} vram_scale_policy_t;

/* Fill a policy with PyTorch's defaults (2.0, 0.5, 2000, no hysteresis, no bounds). */
VRAM_API void vram_scale_policy_default(vram_scale_policy_t *policy);
/* VRAM_OK, or VRAM_ERR_INVALID_ARG naming the first bad field. */
VRAM_API VRAM_NODISCARD vram_status_t vram_scale_policy_check(const vram_scale_policy_t *policy);
/* Host version. hysteresis_tracker may be NULL only when policy->hysteresis == 1. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_update_scale(float *scale, int32_t *growth_tracker,
                                                           int32_t *hysteresis_tracker, float found_inf,
                                                           const vram_scale_policy_t *policy);

/* CUDA versions (VRAM_ERR_UNAVAILABLE when built without CUDA). Tensor data and every scalar
 * pointer are device memory on CUDA device `device`, which is made current for the launch
 * (and the previous device restored); the work is queued on `stream` and nothing waits for it, so a training step needs no host synchronisation. Up to 110 tensors
 * and 320 chunks of 65536 elements per launch, 16-byte vector loads where aligned.
 *   inv_scale, found_inf: float32 scalars; found_inf is set to 1.0f on inf/NaN, as above.
 *   sumsq: a float64 scalar the call ADDS the sum of squares into (zero it first), or NULL. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_unscale_check_cuda(const vram_tensor_t *tensors, size_t count,
                                                                 const float *inv_scale, float *found_inf,
                                                                 double *sumsq, vram_stream_t stream, int device);
/* x *= *factor on the device (a device float32 scalar; nothing written where it equals 1). */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_scale_inplace_cuda(const vram_tensor_t *tensors, size_t count,
                                                                 const float *factor, vram_stream_t stream,
                                                                 int device);
/* One thread: *coef = min(1, max_norm / (sqrt(*sumsq) + 1e-6)) and *norm = sqrt(*sumsq), as
 * torch.nn.utils.clip_grad_norm_ computes them, so clipping needs no host synchronisation;
 * an inf/NaN norm gives *coef = 1 (the step is skipped anyway, so the gradients are left as
 * they are rather than turned into NaN). norm may be NULL. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_clip_coef_cuda(const double *sumsq, double max_norm, float *coef,
                                                             float *norm, vram_stream_t stream, int device);
/* One thread, same rule as vram_amp_update_scale; found_inf is a device float32. */
VRAM_API VRAM_NODISCARD vram_status_t vram_amp_update_scale_cuda(float *scale, int32_t *growth_tracker,
                                                                int32_t *hysteresis_tracker, const float *found_inf,
                                                                const vram_scale_policy_t *policy,
                                                                vram_stream_t stream, int device);

/* CPU threading and instruction set. The thread count starts at VRAMKIT_NUM_THREADS, else
 * the number of CPUs this process may run on. The SIMD path starts at VRAMKIT_SIMD
 * ("avx512", "avx2", "portable"), else the best the CPU supports. */
VRAM_API int vram_get_num_threads(void);
VRAM_API VRAM_NODISCARD vram_status_t vram_set_num_threads(int threads); /* 1..1024 */
/* The SIMD path in use: "avx512", "avx2" (AVX2 + F16C) or "portable". */
VRAM_API const char *vram_simd_path(void);
/* 1 if this CPU can run the named path. */
VRAM_API int vram_simd_supported(const char *path);
/* Select a path ("auto" = the best supported). VRAM_ERR_INVALID_ARG for an unknown name,
 * VRAM_ERR_UNAVAILABLE when this CPU lacks it; nothing changes then. */
VRAM_API VRAM_NODISCARD vram_status_t vram_set_simd_path(const char *path);

/* ======================================================================================
 * Checkpoint: activation-checkpoint schedules for a chain of stages under a memory budget
 *
 * The execution model (docs/checkpoint_model.md): stage i reads x_i (input_bytes) and
 * writes x_{i+1}; its backward needs saved_bytes (its input plus what autograd saves). The
 * loss is stage L: it reads x_L (its input_bytes) and keeps its own saved tensors until its
 * backward, which follows its forward at once. A schedule is a sequence of
 *   FWD_NOSAVE(i)  forward under no_grad, x_i dropped afterwards (unless kept below);
 *   FWD_CHECK(i)   forward under no_grad, x_i kept as a checkpoint until BWD(i);
 *   FWD_ALL(i)     forward with autograd, keeping what BWD(i) needs;
 *   LOSS           the loss and its gradient (its forward and backward, back to back);
 *   BWD(i)         backward of stage i (requires a FWD_ALL(i) since the last BWD(i+1)).
 * The simulator replays a schedule and returns its time and exact peak bytes; every planner's
 * output is replayed by it, so predicted figures never come from the planner's own estimate.
 * ====================================================================================== */

typedef struct vram_ckpt_stage {
    double fwd_time, bwd_time; /* any unit; >= 0 */
    uint64_t input_bytes;      /* x_i */
    uint64_t saved_bytes;      /* what the backward needs, input included: >= input_bytes */
    uint64_t fwd_tmp, bwd_tmp; /* transient memory during a forward that saves nothing / the backward */
    uint64_t fwd_all_tmp;      /* transient memory during a saving forward (FWD_ALL), beyond what it
                                * saves: what a no-grad forward frees as it goes is often kept then */
} vram_ckpt_stage_t;

typedef enum vram_ckpt_op_kind {
    VRAM_CKPT_FWD_NOSAVE = 0,
    VRAM_CKPT_FWD_CHECK = 1,
    VRAM_CKPT_FWD_ALL = 2,
    VRAM_CKPT_LOSS = 3,
    VRAM_CKPT_BWD = 4,
} vram_ckpt_op_kind_t;

typedef struct vram_ckpt_op {
    uint32_t kind;  /* vram_ckpt_op_kind_t */
    uint32_t stage; /* L for LOSS */
} vram_ckpt_op_t;

typedef enum vram_ckpt_algorithm {
    VRAM_CKPT_OPTIMAL = 0,  /* the persistent dynamic program: least time within the budget */
    VRAM_CKPT_REVOLVE = 1,  /* binomial checkpointing with as many snapshots as fit (homogeneous) */
    VRAM_CKPT_SQRT = 2,     /* round(sqrt(L)) equal segments (Chen et al.) */
    VRAM_CKPT_SEGMENTS = 3, /* `segments` equal segments, the last one stored: checkpoint_sequential */
    VRAM_CKPT_NONE = 4,     /* store everything */
} vram_ckpt_algorithm_t;

typedef struct vram_ckpt_schedule {
    vram_ckpt_op_t *ops;
    size_t num_ops;
    double predicted_time;   /* sum of the op times */
    uint64_t predicted_peak; /* exact peak bytes, x_0 included */
} vram_ckpt_schedule_t;

/* Plan a schedule for `count` stages (count >= 1) followed by a loss. `loss` is the loss as
 * one more stage: input_bytes is the size of the chain's output (the loss input, and its
 * gradient), saved_bytes what the loss keeps for its backward (input included), fwd_tmp and
 * bwd_tmp its transients, and its times; its output is a scalar (size 0), and its forward and
 * backward run back to back (the LOSS op). NULL: a loss that costs nothing and reads an output
 * the size of the last stage's input.
 * budget: bytes (x_0 included); 0 means no limit for the fixed algorithms (SQRT, SEGMENTS,
 * NONE, and REVOLVE with as many snapshots as stages). slots: the memory discretisation of
 * OPTIMAL (sizes are rounded up to budget/slots, so a plan never exceeds the budget);
 * 0 = 500. segments: for SEGMENTS (1..count). VRAM_ERR_INFEASIBLE when no schedule of the
 * algorithm fits; the message and *min_budget (if not NULL) give the least budget that works
 * for it. */
VRAM_API VRAM_NODISCARD vram_status_t vram_ckpt_plan(const vram_ckpt_stage_t *stages, size_t count,
                                                    const vram_ckpt_stage_t *loss, uint64_t budget,
                                                    vram_ckpt_algorithm_t algorithm, int segments, int slots,
                                                    vram_ckpt_schedule_t **out, uint64_t *min_budget);
VRAM_API void vram_ckpt_schedule_free(vram_ckpt_schedule_t *schedule);
/* Replay a schedule: VRAM_ERR_INVALID_ARG (naming the op) if it breaks a rule. */
VRAM_API VRAM_NODISCARD vram_status_t vram_ckpt_simulate(const vram_ckpt_stage_t *stages, size_t count,
                                                        const vram_ckpt_stage_t *loss, const vram_ckpt_op_t *ops,
                                                        size_t num_ops, double *time, uint64_t *peak);
/* The least budget any (persistent) schedule needs, exact in bytes. */
VRAM_API VRAM_NODISCARD vram_status_t vram_ckpt_min_budget(const vram_ckpt_stage_t *stages, size_t count,
                                                          const vram_ckpt_stage_t *loss, uint64_t *out);

/* ======================================================================================
 * NVML: the machine's NVIDIA GPUs and the processes holding their memory
 *
 * Read from the driver's management library, loaded at run time with dlopen (never linked):
 * the file named by VRAMKIT_NVML_LIBRARY, else "libnvidia-ml.so.1". Without it every call
 * returns VRAM_ERR_UNAVAILABLE with the loader's reason, and nothing else in vramkit changes.
 * The library is loaded and initialised once, by the first call, and kept until
 * vram_nvml_close(); the calls are serialised by one mutex (NVML queries take micro- to
 * milliseconds, this is not a hot path). Indexes are NVML's (PCI bus order), which may differ
 * from CUDA's device order unless CUDA_DEVICE_ORDER=PCI_BUS_ID.
 * ====================================================================================== */

#define VRAM_NVML_NOT_AVAILABLE UINT64_MAX /* a figure NVML cannot give (Windows WDDM, some vGPUs) */
#define VRAM_NVML_NO_ID UINT32_MAX         /* a MIG instance id when MIG is off (or unknown) */

typedef struct vram_gpu_info {
    uint32_t index;                      /* NVML index */
    char name[96];                       /* "NVIDIA H100 80GB HBM3" */
    char uuid[96];                       /* "GPU-..." */
    uint64_t memory_total, memory_used, memory_free; /* bytes, as nvmlDeviceGetMemoryInfo (v1): used
                                          * includes what the driver reserves */
    int utilization_gpu;                 /* % of the last sample period a kernel ran; -1: not supported */
    int utilization_memory;              /* % of it the memory controller was busy (not capacity); -1 */
} vram_gpu_info_t;

typedef enum vram_gpu_process_kind {
    VRAM_GPU_PROCESS_COMPUTE = 1,  /* a CUDA (or OpenCL) context */
    VRAM_GPU_PROCESS_GRAPHICS = 2, /* a graphics context (OpenGL, Vulkan, a display server) */
} vram_gpu_process_kind_t;

typedef struct vram_gpu_process {
    uint32_t pid;                  /* as the driver sees it: the host's PID namespace */
    uint32_t kind;                 /* vram_gpu_process_kind_t */
    uint64_t used_memory;          /* bytes; VRAM_NVML_NOT_AVAILABLE when NVML cannot tell */
    uint32_t gpu_instance_id;      /* MIG instance ids; VRAM_NVML_NO_ID without MIG */
    uint32_t compute_instance_id;
} vram_gpu_process_t;

/* Load and initialise NVML if that has not been tried yet. VRAM_OK, or VRAM_ERR_UNAVAILABLE
 * with the reason: "<library> could not be loaded (<dlerror>)", a missing symbol, or
 * nvmlInit's error. The outcome is kept: later calls return it again until vram_nvml_close(). */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_open(void);
/* Shut NVML down and unload it (if loaded); the next call loads it again, reading
 * VRAMKIT_NVML_LIBRARY anew. For tests and long-running tools that want to retry. */
VRAM_API void vram_nvml_close(void);
/* The number of GPUs NVML sees. */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_device_count(uint32_t *count);
/* Name, UUID, memory and utilisation of GPU `index` (VRAM_ERR_UNAVAILABLE for an index past
 * the count; VRAM_ERR_BACKEND when NVML fails, with its error string). */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_device_info(uint32_t index, vram_gpu_info_t *out);
/* The processes with a context on GPU `index`: compute ones first, then graphics ones (a
 * process with both appears twice, once per kind). *count receives how many there are; at
 * most `cap` are written to `out` (which may be NULL when cap is 0), so a caller whose array
 * was too small calls again with *count entries (the list may have changed meanwhile). */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_processes(uint32_t index, vram_gpu_process_t *out, size_t cap,
                                                         size_t *count);

#ifdef __cplusplus
}
#endif
#endif /* VRAMKIT_H */
