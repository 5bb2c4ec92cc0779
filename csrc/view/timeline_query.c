/* timeline_query.c — see timeline_query.h. Every loop walks events in order, adding an
 * allocation's size to its group on its alloc event and taking it away on its free. */
#include "timeline_query.h"

#include <inttypes.h>
#include <string.h>

#include "../util/error.h"

/* One event into the groups' live bytes; the columns come from Python, so every index is
 * checked as it is used (a branch that never fails costs nothing next to the memory reads). */
static inline int apply(const vk_events_t *ev, uint64_t e, int64_t *live) {
    uint32_t a = ev->id[e];
    if (a >= ev->allocations) return -1;
    int32_t g = ev->group[a];
    if (g < 0 || (uint32_t)g >= ev->groups) return -1;
    int64_t size = (int64_t)ev->size[a];
    live[g] += ev->kind[e] ? -size : size;
    return 0;
}

static vram_status_t out_of_range(const vk_events_t *ev, uint64_t e) {
    return vram__fail(VRAM_ERR_INVALID_ARG, "event %" PRIu64 " names allocation %" PRIu32 " of %" PRIu64
                      " or a group outside 0..%" PRIu32, e, ev->id[e], ev->allocations, ev->groups - 1);
}

vram_status_t vk_timeline_checkpoints(const vk_events_t *ev, uint64_t every, int64_t *ckpt) {
    uint32_t g = ev->groups;
    memset(ckpt, 0, g * sizeof *ckpt);
    for (uint64_t c = 1; c <= ev->n / every; c++) {
        int64_t *live = ckpt + c * g;
        memcpy(live, live - g, g * sizeof *live);
        for (uint64_t e = (c - 1) * every; e < c * every; e++)
            if (apply(ev, e, live)) return out_of_range(ev, e);
    }
    return VRAM_OK;
}

/* live[] = each group's bytes before event `from`, from the checkpoint at or before it. */
static vram_status_t start_at(const vk_events_t *ev, const int64_t *ckpt, uint64_t every, uint64_t from,
                              int64_t *live) {
    uint64_t c = from / every;
    memcpy(live, ckpt + c * ev->groups, ev->groups * sizeof *live);
    for (uint64_t e = c * every; e < from; e++)
        if (apply(ev, e, live)) return out_of_range(ev, e);
    return VRAM_OK;
}

vram_status_t vk_timeline_groups_at(const vk_events_t *ev, const int64_t *ckpt, uint64_t every,
                                    const uint64_t *at, uint64_t count, int64_t *out) {
    if (!count) return VRAM_OK;
    uint32_t g = ev->groups;
    int64_t *live = out; /* the first row is the running state until it is final */
    vram_status_t s = start_at(ev, ckpt, every, at[0], live);
    if (s != VRAM_OK) return s;
    uint64_t e = at[0];
    for (uint64_t b = 0; b < count; b++) {
        if (b) memcpy(out + b * g, out + (b - 1) * g, g * sizeof *out);
        live = out + b * g;
        if (b && at[b] == at[b - 1]) continue;
        for (; e <= at[b]; e++)
            if (apply(ev, e, live)) return out_of_range(ev, e);
    }
    return VRAM_OK;
}

vram_status_t vk_timeline_group_peaks(const vk_events_t *ev, const int64_t *ckpt, uint64_t every,
                                      const uint64_t *edges, uint64_t buckets, uint32_t track, int64_t *peak) {
    int64_t state[VK_PEAK_MAX_GROUPS];
    if (ev->groups > VK_PEAK_MAX_GROUPS || track >= ev->groups)
        return vram__fail(VRAM_ERR_INVALID_ARG, "group_peaks tracks one of at most %d groups", VK_PEAK_MAX_GROUPS);
    vram_status_t s = start_at(ev, ckpt, every, edges[0], state);
    if (s != VRAM_OK) return s;
    uint64_t e = edges[0];
    for (uint64_t b = 0; b < buckets; b++) {
        int64_t best = INT64_MIN;
        for (; e < edges[b + 1]; e++) {
            if (apply(ev, e, state)) return out_of_range(ev, e);
            if (state[track] > best) best = state[track];
        }
        peak[b] = best == INT64_MIN ? state[track] : best;
    }
    return VRAM_OK;
}
