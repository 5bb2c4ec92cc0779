/* vramkit_replay.h — an allocation trace replayed on a private simulated pool.
 * Part of vramkit's public C API; vramkit.h includes it (and it includes vramkit.h for the
 * status codes and export macros), so either can be included first. */
#ifndef VRAMKIT_REPLAY_H
#define VRAMKIT_REPLAY_H

#include "vramkit.h"

#ifdef __cplusplus
extern "C" {
#endif

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
 *   kind[i]   VRAM_REPLAY_ALLOC (0), VRAM_REPLAY_FREE (1), VRAM_REPLAY_USE (4): the live
 *             allocation id[i] is used on stream[i] (Tensor.record_stream: its FREE then
 *             waits for that stream), VRAM_REPLAY_SYNC (5): stream[i] is synchronized (id[i]
 *             -1: every stream), which completes the waits recorded on it; any other value
 *             is a marker (an iteration boundary, say) that the replay skips but that keeps
 *             its index, so event indices in results and messages match the caller's columns;
 *   id[i]     ALLOC/FREE: the allocation's id, >= 0, ideally dense from 0 (tables are sized
 *             by the largest id, 9 bytes per id); an id is allocated at most once per trace.
 *             USE: a live id. Ignored for markers;
 *   size[i]   ALLOC: requested bytes, < VRAM_MAX_REQUEST; 0 is allowed (PyTorch's empty
 *             storages): the id is live but holds no block, as vram_malloc(0) gives NULL, and
 *             its FREE changes nothing. Ignored for other events;
 *   stream[i] optional (NULL: stream 0 for every event): the stream passed to vram_malloc,
 *             so blocks are reused only on their own stream, as on the device.
 * ====================================================================================== */

/* (2 and 3 are the Python trace's phase and step markers.) */
enum { VRAM_REPLAY_ALLOC = 0, VRAM_REPLAY_FREE = 1, VRAM_REPLAY_USE = 4, VRAM_REPLAY_SYNC = 5 };

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

#ifdef __cplusplus
}
#endif

#endif /* VRAMKIT_REPLAY_H */
