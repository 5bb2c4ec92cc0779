/* replay.c — vram_trace_replay: an allocation trace (kind, id, size, stream columns) replayed
 * on a private simulated pool in one C loop (allocations on their streams, record_stream uses
 * and stream synchronizations as the caching allocator sees them), with the peaks, the event indices where they were
 * reached and, on request, per-event reserved/allocated bytes and addresses.
 *
 * Two passes over the columns check the whole trace before a pool exists, so bad input
 * changes nothing and the message names the first bad event. The replay then calls vram_malloc
 * and vram_free (the same code a device runs) and reads the counters straight from the pool
 * after each event, instead of copying the stats struct. */
#include "internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

/* What the check pass knows of each id. */
enum { ID_UNUSED = 0, ID_LIVE = 1, ID_FREED = 2 };

/* The device named in the replay pool's OOM message: no simulated device has index -1. */
#define REPLAY_DEVICE ((vram_device_t){VRAM_DEVICE_SIM, -1, 0})

/* Pass 1: the rules that need no state (id >= 0, size below the limit) and the largest id
 * before the first event breaking them (*bad, n if none). */
static int has_id(uint8_t k) { return k == VRAM_REPLAY_ALLOC || k == VRAM_REPLAY_FREE || k == VRAM_REPLAY_USE; }

static int64_t scan_events(const uint8_t *kind, const int64_t *id, const uint64_t *size, size_t n, size_t *bad) {
    int64_t max_id = -1;
    for (size_t i = 0; i < n; i++) {
        uint8_t k = kind[i];
        if (!has_id(k)) continue; /* a marker, or a synchronization */
        int64_t x = id[i];
        if (x < 0 || (k == VRAM_REPLAY_ALLOC && size[i] >= VRAM_MAX_REQUEST)) {
            *bad = i;
            return max_id;
        }
        if (x > max_id) max_id = x;
    }
    *bad = n;
    return max_id;
}

static vram_status_t stateless_error(const uint8_t *kind, const int64_t *id, const uint64_t *size, size_t i) {
    const char *what = kind[i] == VRAM_REPLAY_ALLOC ? "alloc" : kind[i] == VRAM_REPLAY_FREE ? "free" : "use";
    if (id[i] < 0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "trace event %zu: %s of id %lld: ids must be >= 0", i, what,
                          (long long)id[i]);
    return vram__fail(VRAM_ERR_INVALID_ARG,
                      "trace event %zu: alloc of id %lld, size %llu: sizes must be below 2**62 bytes", i,
                      (long long)id[i], (unsigned long long)size[i]);
}

/* Pass 2, over events [0, end): every FREE and USE finds its id live, every ALLOC finds its id unused.
 * `state` (zeroed) and `at` (the event of each id's last change, for the message) have an
 * entry per id. */
static vram_status_t check_states(const uint8_t *kind, const int64_t *id, size_t end, uint8_t *state, uint64_t *at) {
    for (size_t i = 0; i < end; i++) {
        uint8_t k = kind[i];
        if (!has_id(k)) continue;
        int64_t x = id[i];
        uint8_t s = state[x];
        if (k == VRAM_REPLAY_USE) {
            if (s != ID_LIVE)
                return vram__fail(VRAM_ERR_INVALID_ARG, "trace event %zu: use of id %lld on a stream, which is not "
                                  "allocated%s", i, (long long)x, s == ID_FREED ? " (it was freed)" : "");
            continue;
        }
        if (k == VRAM_REPLAY_ALLOC) {
            if (s == ID_LIVE)
                return vram__fail(VRAM_ERR_INVALID_ARG,
                                  "trace event %zu: alloc of id %lld, which is already allocated (at event %llu): "
                                  "an id is allocated at most once", i, (long long)x, (unsigned long long)at[x]);
            if (s == ID_FREED)
                return vram__fail(VRAM_ERR_INVALID_ARG,
                                  "trace event %zu: alloc of id %lld, which was already used (allocated, then freed "
                                  "at event %llu): an id is allocated at most once", i, (long long)x,
                                  (unsigned long long)at[x]);
            state[x] = ID_LIVE;
        } else {
            if (s == ID_UNUSED)
                return vram__fail(VRAM_ERR_INVALID_ARG, "trace event %zu: free of id %lld, which is not allocated", i,
                                  (long long)x);
            if (s == ID_FREED)
                return vram__fail(VRAM_ERR_INVALID_ARG,
                                  "trace event %zu: free of id %lld, which is not allocated (it was freed at event %llu)",
                                  i, (long long)x, (unsigned long long)at[x]);
            state[x] = ID_FREED;
        }
        at[x] = i;
    }
    return VRAM_OK;
}

/* Every stream synchronized: every queued event completes (the pool is private to the replay,
 * so nothing else holds its lock). */
static vram_status_t synchronize_all(vram_pool_t *pool) {
    vram__lock(&pool->lock);
    if (pool->num_pending) vram__synchronize_and_free_events(pool);
    vram__unlock(&pool->lock);
    return VRAM_OK;
}

vram_status_t vram_trace_replay(const uint8_t *kind, const int64_t *id, const uint64_t *size, const uint64_t *stream,
                                size_t n, uint64_t capacity, const char *conf, uint64_t *reserved_out,
                                uint64_t *allocated_out, uint64_t *addr_out, vram_replay_result_t *result) {
    if (!result) return vram__fail(VRAM_ERR_INVALID_ARG, "vram_trace_replay needs a result struct; got NULL");
    if (capacity == 0 || capacity >= VRAM_MAX_REQUEST)
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "trace replay needs a capacity between 1 byte and 2**62 - 1 bytes; got %llu",
                          (unsigned long long)capacity);
    if (n > 0 && (!kind || !id || !size))
        return vram__fail(VRAM_ERR_INVALID_ARG, "trace replay of %zu events needs the kind, id and size columns; "
                          "%s is NULL", n, !kind ? "kind" : !id ? "id" : "size");
    /* The conf first, with a message that names this call rather than the environment. */
    vram_settings_t settings;
    vram__settings_default(&settings, 0);
    vram_status_t status = vram__settings_parse(conf, "trace replay conf", &settings, 0, 0);
    if (status != VRAM_OK) return status;

    /* Check the whole trace. The table of addresses doubles as the check's "event of the last
     * change" per id, then the entries used are zeroed for the replay: both tables come from
     * calloc and only the pages of ids in the trace are ever touched, so sparse ids cost address
     * space, not memory. */
    size_t bad;
    int64_t max_id = scan_events(kind, id, size, n, &bad);
    uint64_t num_ids = (uint64_t)max_id + 1; /* 0 when max_id is -1; 2^63 at most */
    if (num_ids > (uint64_t)(SIZE_MAX / (sizeof(uint64_t) + 1)))
        return vram__fail(VRAM_ERR_HOST_MEMORY,
                          "trace replay: ids up to %lld need more host memory than can be addressed; ids should be "
                          "dense from 0", (long long)max_id);
    size_t table_len = num_ids ? (size_t)num_ids : 1;
    uint64_t *addrs = calloc(table_len, sizeof *addrs);
    uint8_t *state = calloc(table_len, 1);
    if (!addrs || !state) {
        free(addrs);
        free(state);
        return vram__fail(VRAM_ERR_HOST_MEMORY,
                          "trace replay: out of host memory for the id tables (ids up to %lld, %llu bytes); ids "
                          "should be dense from 0", (long long)max_id,
                          (unsigned long long)(table_len * (sizeof *addrs + 1)));
    }
    status = check_states(kind, id, bad, state, addrs);
    free(state);
    if (status == VRAM_OK && bad < n) status = stateless_error(kind, id, size, bad);
    if (status != VRAM_OK) {
        free(addrs);
        return status;
    }
    for (size_t i = 0; i < n; i++)
        if (has_id(kind[i])) addrs[id[i]] = 0;

    void *ctx = NULL;
    vram_pool_t *pool = NULL;
    status = vram__backend_sim_ctx_private(capacity, &ctx);
    if (status == VRAM_OK) status = vram_pool_create(vram_backend_sim(), ctx, REPLAY_DEVICE, conf, &pool);
    if (status != VRAM_OK) { /* pool_create destroyed ctx */
        free(addrs);
        return status;
    }
    pool->quiet_oom = 1; /* a predicted OOM is the answer, not an event for the OOM callback */

    const vram_stats_t *stats = &pool->stats;
    const int64_t *allocated = &stats->allocated_bytes[VRAM_STAT_ALL].current;
    const int64_t *reserved = &stats->reserved_bytes[VRAM_STAT_ALL].current;
    const int64_t *requested = &stats->requested_bytes[VRAM_STAT_ALL].current;
    vram_replay_result_t r;
    memset(&r, 0, sizeof r);
    r.peak_allocated_event = r.peak_reserved_event = r.oom_event = -1;
    size_t i = 0;
    for (; i < n; i++) {
        uint8_t k = kind[i];
        uint64_t addr = 0;
        if (k == VRAM_REPLAY_ALLOC) {
            void *ptr = NULL;
            status = vram_malloc(pool, size[i], stream ? stream[i] : 0, 0, &ptr);
            if (status != VRAM_OK) {
                if (status != VRAM_ERR_OOM) break; /* host memory, or the backend: reported below */
                r.oom_event = (int64_t)i;
            }
            addr = (uint64_t)(uintptr_t)ptr;
            addrs[id[i]] = addr;
        } else if (k == VRAM_REPLAY_FREE) {
            /* The pointer is live (checked above); NULL (a size-0 alloc) is a no-op. Fails only
             * for want of host memory to queue the stream uses' events. */
            status = vram_free(pool, (void *)(uintptr_t)addrs[id[i]], 0);
            if (status != VRAM_OK) break;
        } else if (k == VRAM_REPLAY_USE) {
            if (addrs[id[i]]) status = vram_record_stream(pool, (void *)(uintptr_t)addrs[id[i]], stream ? stream[i] : 0);
            if (status != VRAM_OK) break;
        } else if (k == VRAM_REPLAY_SYNC) {
            /* The simulated device's streams are logical queues: synchronizing one completes the
             * events recorded on it, and frees waiting only on them return to the pool. */
            status = id[i] < 0 ? synchronize_all(pool) : vram_pool_synchronize(pool, stream ? stream[i] : 0);
            if (status != VRAM_OK) break;
        }
        uint64_t a = (uint64_t)*allocated, res = (uint64_t)*reserved, req = (uint64_t)*requested;
        if (a > r.peak_allocated) {
            r.peak_allocated = a;
            r.peak_allocated_event = (int64_t)i;
            r.reserved_at_peak_allocated = res;
        }
        /* The pool's peak, not the value after the event: with expandable segments one malloc
         * can map pages, fail to map more, unmap free pages and map again, so reserved memory
         * can peak inside an event (the classic policy releases before it draws). */
        uint64_t res_peak = (uint64_t)stats->reserved_bytes[VRAM_STAT_ALL].peak;
        if (res_peak > r.peak_reserved) {
            r.peak_reserved = res_peak;
            r.peak_reserved_event = (int64_t)i;
            r.allocated_at_peak_reserved = a;
            r.segments_at_peak_reserved = (uint64_t)stats->segment[VRAM_STAT_ALL].current;
        }
        if (req > r.peak_requested) r.peak_requested = req;
        if (reserved_out) reserved_out[i] = res;
        if (allocated_out) allocated_out[i] = a;
        if (addr_out) addr_out[i] = addr;
        if (r.oom_event >= 0) break;
    }
    if (status == VRAM_OK || status == VRAM_ERR_OOM) {
        r.events = r.oom_event >= 0 ? i + 1 : n;
        r.final_allocated = (uint64_t)*allocated;
        r.final_reserved = (uint64_t)*reserved;
        r.num_alloc_retries = (uint64_t)stats->num_alloc_retries;
        r.num_ooms = (uint64_t)stats->num_ooms;
        r.num_device_alloc = (uint64_t)stats->num_device_alloc;
        r.num_device_free = (uint64_t)stats->num_device_free;
        /* Allocated memory only changes once per event, so sampling after each event sees the
         * pool's own peak (and reserved is read from the pool's peak above). Say so if not. */
        if (r.peak_allocated != (uint64_t)stats->allocated_bytes[VRAM_STAT_ALL].peak ||
            r.peak_reserved != (uint64_t)stats->reserved_bytes[VRAM_STAT_ALL].peak)
            status = vram__fail(VRAM_ERR_CORRUPT,
                                "trace replay: sampled peaks (allocated %llu, reserved %llu) differ from the pool's "
                                "(%lld, %lld)", (unsigned long long)r.peak_allocated,
                                (unsigned long long)r.peak_reserved,
                                (long long)stats->allocated_bytes[VRAM_STAT_ALL].peak,
                                (long long)stats->reserved_bytes[VRAM_STAT_ALL].peak);
    }
    /* Keep the OOM message across the teardown for the caller. */
    char message[2048];
    if (status == VRAM_ERR_OOM) snprintf(message, sizeof message, "%s", vram_last_error());
    vram_pool_destroy(pool);
    free(addrs);
    if (status == VRAM_ERR_OOM) {
        (void)vram__fail(VRAM_ERR_OOM, "%s", message);
        status = VRAM_OK;
    }
    if (status == VRAM_OK) *result = r;
    return status;
}
