/* host_streams.h — simulated streams and events for the host backends (cpu, sim).
 *
 * Host memory has no asynchronous work, but record_stream's deferred reuse must still be
 * exercised and tested there. So each stream is a logical queue: an event records the
 * stream's current ticket, and it completes when that stream (or every stream) is
 * synchronized, or when the event itself is synchronized. */
#ifndef VRAM_BACKENDS_HOST_STREAMS_H
#define VRAM_BACKENDS_HOST_STREAMS_H

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

vram_status_t vram__host_streams_init(vram__host_streams_t *hs);
void vram__host_streams_destroy(vram__host_streams_t *hs);
vram_status_t vram__host_streams_synchronize(vram__host_streams_t *hs, vram_stream_t stream);
vram_status_t vram__host_event_record(vram__host_streams_t *hs, vram_stream_t stream, void **event);
vram_status_t vram__host_event_query(vram__host_streams_t *hs, void *event, int *done);
vram_status_t vram__host_event_synchronize(vram__host_streams_t *hs, void *event);
void vram__host_event_destroy(void *event);

#endif
