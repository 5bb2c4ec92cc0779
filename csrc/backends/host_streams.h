/* host_streams.h — simulated streams and events for the host backends (cpu, sim).
 *
 * Host memory has no asynchronous work, but record_stream's deferred reuse must still be
 * exercised and tested there. So each stream is a logical queue: an event records the
 * stream's current ticket, and it completes when that stream (or every stream) is
 * synchronized, or when the event itself is synchronized.
 *
 * A host backend's ctx starts with its vram__host_streams_t: the functions below then take
 * the ctx itself, so they are the backend's own stream and event entries
 * (VRAM__HOST_STREAM_ENTRIES) and every host backend shares them instead of wrapping them. */
#ifndef VRAM_BACKENDS_HOST_STREAMS_H
#define VRAM_BACKENDS_HOST_STREAMS_H

#include <stddef.h>

#include "vramkit.h"
#include "../util/lock.h"

typedef struct vram__host_stream {
    vram_stream_t stream;
    uint64_t issued, completed;
} vram__host_stream_t;

typedef struct vram__host_streams {
    vram__mutex_t lock; /* synchronize runs without the pool lock */
    vram__host_stream_t *items;
    uint64_t count, capacity;
} vram__host_streams_t;

/* A zeroed ctx of `size` bytes whose first member, a vram__host_streams_t, is ready for use.
 * `what` completes the out-of-memory message ("out of host memory for <what>"). */
vram_status_t vram__host_ctx_new(size_t size, const char *what, void **ctx);
/* Destroy the streams and free the ctx: the backend's destroy entry. */
void vram__host_ctx_destroy(void *ctx);

/* The backend entries, on a ctx made by vram__host_ctx_new. */
vram_status_t vram__host_synchronize(void *ctx, vram_stream_t stream);
vram_status_t vram__host_event_record(void *ctx, vram_stream_t stream, void **event);
vram_status_t vram__host_event_query(void *ctx, void *event, int *done);
vram_status_t vram__host_event_synchronize(void *ctx, void *event);
void vram__host_event_destroy(void *ctx, void *event);

/* The stream and event entries of a host backend's vram_backend_t initializer. */
#define VRAM__HOST_STREAM_ENTRIES                                                                  \
    .synchronize = vram__host_synchronize, .event_record = vram__host_event_record,                \
    .event_query = vram__host_event_query, .event_synchronize = vram__host_event_synchronize,      \
    .event_destroy = vram__host_event_destroy

#endif
