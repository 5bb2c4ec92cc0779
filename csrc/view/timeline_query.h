/* timeline_query.h — what the viewer draws for a range of events, computed from the history's
 * columns in one pass over that range: how much each group (an allocation site, a category, a
 * module, or "matches the search") holds at chosen events, and a group's peak per bucket.
 *
 * The start of a range is reached from a checkpoint (each group's live bytes before every
 * K-th event, computed once per grouping), so a query costs the range plus at most K events,
 * whatever the history's length: the multi-resolution part of the viewer's summary. */
#ifndef VRAM_VIEW_TIMELINE_QUERY_H
#define VRAM_VIEW_TIMELINE_QUERY_H

#include <stdint.h>

#include "vramkit.h"

typedef struct vk_events {
    const uint8_t *kind;    /* per event: 0 alloc, 1 free */
    const uint32_t *id;     /* per event: the allocation */
    uint64_t n;             /* events */
    const uint64_t *size;   /* per allocation */
    const int32_t *group;   /* per allocation: 0..groups-1 */
    uint64_t allocations;
    uint32_t groups;
} vk_events_t;

/* Each function checks every allocation id and group it meets (the columns come from Python):
 * VRAM_ERR_INVALID_ARG naming the first out of range. */
/* ckpt[c * groups + g] = group g's live bytes before event c * every, for c in 0..n / every. */
vram_status_t vk_timeline_checkpoints(const vk_events_t *ev, uint64_t every, int64_t *ckpt);

/* For sorted event indices at[0..count) (each < n): out[b * groups + g] = group g's live bytes
 * just after event at[b]. And, when peak is not NULL, for the buckets of edges[0..buckets]
 * (edges[0] = start, increasing, edges[buckets] = end <= n): peak[b] = the most group `track`
 * held just after any event of bucket b. */
vram_status_t vk_timeline_groups_at(const vk_events_t *ev, const int64_t *ckpt, uint64_t every,
                                    const uint64_t *at, uint64_t count, int64_t *out);
#define VK_PEAK_MAX_GROUPS 256 /* group_peaks' limit: it keeps the state on the stack */
vram_status_t vk_timeline_group_peaks(const vk_events_t *ev, const int64_t *ckpt, uint64_t every,
                                      const uint64_t *edges, uint64_t buckets, uint32_t track, int64_t *peak);

#endif
