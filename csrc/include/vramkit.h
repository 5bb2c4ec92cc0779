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

/* Called on every VRAM_ERR_OOM of a pool (not of trace replays), on the thread that failed,
 * with the pool's lock held and the figures and message of the failure: it must not call into
 * vramkit, and should only copy what it needs (the Python module queues it and reports it
 * later from the interpreter). NULL turns it off. */
typedef void (*vram_oom_callback_t)(const vram_oom_info_t *info, const char *message);
VRAM_API void vram_set_oom_callback(vram_oom_callback_t callback);

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
    int index;   /* 0 for cpu */
    int mempool; /* 0: the device's own pool; N > 0: private pool N on the device (vram_mempool_create) */
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
    /* Expandable segments (NULL where the backend has none). A segment is an address range
     * reserved with no memory behind it, in which memory is mapped and unmapped in whole
     * pages as the pool needs, so freed space at its end can serve a larger request and free
     * pages can be returned one by one. The pool calls them with page-aligned ranges:
     *   range_reserve  reserve `size` bytes of addresses, aligned to 2 MiB; costs no memory;
     *   range_map      back [addr, addr + size) with memory, `page` bytes per piece (the unit
     *                  range_unmap later works in); all or nothing; VRAM_ERR_OOM without a
     *                  message when the device has no room (the pool writes the OOM message);
     *   range_unmap    give the memory of [addr, addr + size) back; the addresses stay reserved;
     *   range_release  give back a reserved range that has nothing mapped. */
    vram_status_t (*range_reserve)(void *ctx, uint64_t size, uintptr_t *out);
    vram_status_t (*range_map)(void *ctx, uintptr_t addr, uint64_t size, uint64_t page);
    vram_status_t (*range_unmap)(void *ctx, uintptr_t addr, uint64_t size, uint64_t page);
    void (*range_release)(void *ctx, uintptr_t addr, uint64_t size);
    /* Backends whose ranges take this process's address space (cpu; NULL elsewhere): the soft
     * RLIMIT_AS (`ulimit -v`; UINT64_MAX when unlimited) and the bytes of address space in
     * use (VmSize). Expandable segments size each new range within what the limit leaves and
     * give a request a classic segment when no range for it fits (expandable.c). */
    void (*address_space)(void *ctx, uint64_t *limit, uint64_t *used);
} vram_backend_t;

/* The pool for a device, created on first use and kept for the life of the process (arrays
 * may be freed during interpreter teardown). Creation reads VRAMKIT_ALLOC_CONF. */
VRAM_API VRAM_NODISCARD vram_status_t vram_device_pool(vram_device_t device, vram_pool_t **out);
/* The pool that owns a live pointer, if any (VRAM_ERR_INVALID_ARG otherwise). */
VRAM_API VRAM_NODISCARD vram_status_t vram_find_pool(const void *ptr, vram_pool_t **out);

/* Private pools (torch.cuda.MemPool): pools of their own on a device, with their own cache,
 * counters, history and empty_cache, drawing on the same device (a simulated device's capacity
 * is shared). Named "<device>/mempool:N" (vram_device_format); vram_device_pool resolves the
 * name, vram_find_pool searches them too, and they live as long as the process.
 * vram_mempool_use makes one the target of this thread's allocations on its device (nested uses
 * stack; vram_mempool_unuse must end the innermost); vram_alloc_pool is where an allocation for
 * `device` by this thread goes: the innermost private pool in use on it, else the device's pool.
 * Counters, summaries and empty_cache of the device itself never switch: they name a pool. */
VRAM_API VRAM_NODISCARD vram_status_t vram_mempool_create(vram_device_t device, vram_device_t *out);
VRAM_API VRAM_NODISCARD vram_status_t vram_mempool_use(vram_device_t mempool);
VRAM_API VRAM_NODISCARD vram_status_t vram_mempool_unuse(vram_device_t mempool);
VRAM_API int vram_mempool_use_count(vram_device_t mempool); /* active uses on all threads; -1: no such pool */
VRAM_API VRAM_NODISCARD vram_status_t vram_alloc_pool(vram_device_t device, vram_pool_t **out);
/* The innermost private pool this thread uses on `device`, or NULL (no lock: for hot paths). */
VRAM_API vram_pool_t *vram_mempool_in_use(vram_device_t device);

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

/* Release every cached segment that is wholly free (after waiting on outstanding events); with
 * expandable segments, unmap every free page and release ranges left with nothing mapped.
 * *released (may be NULL) receives the bytes returned to the backend. */
VRAM_API VRAM_NODISCARD vram_status_t vram_empty_cache(vram_pool_t *pool, uint64_t *released);
/* Caching on or off for every pool of the process (torch.cuda.memory.caching_allocator_enable).
 * Off, a free that leaves a segment wholly free gives it back to the device at once, as an
 * empty_cache after every free would (expandable segments unmap their free pages): the uncached
 * behaviour, for finding use-after-free bugs or measuring what a step really needs. On by default.
 * Two process-wide switches decide it: the flag set here (the default), and a count of active
 * "caching disabled" blocks (caching_allocator_disabled). vram_caching_enabled() is 1 when the
 * flag is set and no block is active: blocks override the flag while any is active, whichever
 * threads entered and left them in whatever order, and setting the flag inside a block takes
 * effect when the last block ends. disable_exit without a matching enter is VRAM_ERR_INVALID_ARG
 * (the count never goes negative); enter fails the same way only if 2^31 - 1 are active. */
VRAM_API void vram_set_caching_enabled(int enabled);
VRAM_API int vram_caching_enabled(void);
VRAM_API VRAM_NODISCARD vram_status_t vram_caching_disable_enter(void);
VRAM_API VRAM_NODISCARD vram_status_t vram_caching_disable_exit(void);
VRAM_API int vram_caching_disabled_blocks(void); /* blocks active now, on all threads */
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
    /* expandable_segments: one growing address range per stream and pool kind, memory mapped in
     * pages on demand (PyTorch's option). Needs a backend with the range_* operations. */
    int expandable_segments;
    uint64_t expandable_page_size;    /* the large pool's page (small pool: 2 MiB); default 20 MiB as
                                       * PyTorch's on devices, 2 MiB on cpu (expandable_page_mb) */
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
    VRAM_TRACE_SEGMENT_MAP = 7,   /* expandable segments: pages mapped (reserved bytes rise) */
    VRAM_TRACE_SEGMENT_UNMAP = 8, /* expandable segments: pages unmapped (reserved bytes fall) */
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
    int is_expandable; /* a mapped run of an expandable segment, reported as PyTorch does: one
                        * segment per contiguous mapped range */
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

#ifdef __cplusplus
}
#endif
/* The rest of the public API, one header per area. */
#include "vramkit_amp.h"
#include "vramkit_checkpoint.h"
#include "vramkit_files.h"
#include "vramkit_nvml.h"
#include "vramkit_replay.h"
#include "vramkit_torch.h"

#endif /* VRAMKIT_H */
