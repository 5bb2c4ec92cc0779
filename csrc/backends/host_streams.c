/* host_streams.c — ticket-based simulated streams; see host_streams.h. */
#include "host_streams.h"

#include <stdlib.h>

#include "../util/error.h"

typedef struct host_event {
    vram_stream_t stream;
    uint64_t ticket;
} host_event_t;

vram_status_t vram__host_ctx_new(size_t size, const char *what, void **ctx) {
    vram__host_streams_t *hs = calloc(1, size);
    if (!hs) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for %s", what);
    if (vram__mutex_init(&hs->lock) != 0) {
        free(hs);
        return vram__fail(VRAM_ERR_HOST_MEMORY, "could not create a mutex");
    }
    *ctx = hs;
    return VRAM_OK;
}

void vram__host_ctx_destroy(void *ctx) {
    vram__host_streams_t *hs = ctx;
    free(hs->items);
    vram__mutex_destroy(&hs->lock);
    free(ctx);
}

/* Lock held. NULL only when growing the table fails. */
static vram__host_stream_t *find(vram__host_streams_t *hs, vram_stream_t stream, int create) {
    for (uint64_t i = 0; i < hs->count; i++)
        if (hs->items[i].stream == stream) return &hs->items[i];
    if (!create) return NULL;
    if (hs->count == hs->capacity) {
        uint64_t cap = hs->capacity ? hs->capacity * 2 : 8;
        vram__host_stream_t *items = realloc(hs->items, cap * sizeof *items);
        if (!items) return NULL;
        hs->items = items;
        hs->capacity = cap;
    }
    hs->items[hs->count] = (vram__host_stream_t){stream, 0, 0};
    return &hs->items[hs->count++];
}

vram_status_t vram__host_synchronize(void *ctx, vram_stream_t stream) {
    vram__host_streams_t *hs = ctx;
    vram__lock(&hs->lock);
    for (uint64_t i = 0; i < hs->count; i++)
        if (stream == VRAM_ALL_STREAMS || hs->items[i].stream == stream) hs->items[i].completed = hs->items[i].issued;
    vram__unlock(&hs->lock);
    return VRAM_OK;
}

vram_status_t vram__host_event_record(void *ctx, vram_stream_t stream, void **event) {
    vram__host_streams_t *hs = ctx;
    host_event_t *e = malloc(sizeof *e);
    if (!e) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for an event");
    vram__lock(&hs->lock);
    vram__host_stream_t *s = find(hs, stream, 1);
    if (s) {
        e->stream = stream;
        e->ticket = ++s->issued;
    }
    vram__unlock(&hs->lock);
    if (!s) {
        free(e);
        return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for a stream");
    }
    *event = e;
    return VRAM_OK;
}

vram_status_t vram__host_event_query(void *ctx, void *event, int *done) {
    vram__host_streams_t *hs = ctx;
    const host_event_t *e = event;
    vram__lock(&hs->lock);
    const vram__host_stream_t *s = find(hs, e->stream, 0);
    *done = s && s->completed >= e->ticket;
    vram__unlock(&hs->lock);
    return VRAM_OK;
}

vram_status_t vram__host_event_synchronize(void *ctx, void *event) {
    vram__host_streams_t *hs = ctx;
    const host_event_t *e = event;
    vram__lock(&hs->lock);
    vram__host_stream_t *s = find(hs, e->stream, 0);
    if (s && s->completed < e->ticket) s->completed = e->ticket;
    vram__unlock(&hs->lock);
    return VRAM_OK;
}

void vram__host_event_destroy(void *ctx, void *event) {
    (void)ctx;
    free(event);
}
