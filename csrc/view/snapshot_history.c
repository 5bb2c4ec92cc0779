/* snapshot_history.c — vk_history_read: a snapshot's tree into one device's history columns.
 * The reading mirrors from_torch_snapshot (snapshot_import.py), so that the viewer and
 * `vramkit replay` see the same allocations; tests compare the two on the same files. */
#include "snapshot_history.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"
#include "pickle_tree.h"
#include "stack_intern.h"
#include "u64map.h"

#define NONE32 UINT32_MAX
#define SIZE_LIMIT (UINT64_C(1) << 62) /* as Trace.validate: no size reaches 2**62 bytes */
#define NO_TIME INT64_MIN

enum { A_OTHER, A_ALLOC, A_FREE_REQUESTED, A_FREE, A_FREE_COMPLETED, A_SEG_PLUS, A_SEG_MINUS, A_OOM };

typedef struct rd {
    const vk_ptree_t *t;
    vk_history_t *h;
    const char *what;
    uint64_t entry; /* the trace entry being read, for messages */
    /* Pickled snapshots memoize their keys and action names: the same few string nodes recur in
     * every entry, so what a node means is remembered by node id (direct-mapped, 64 slots). */
    uint32_t seen_node[64];
    int8_t seen_meaning[64];
    vk_stacks_t stacks;
} rd_t;

static const char *describe(const vk_ptree_t *t, uint32_t node) {
    if (node == NONE32) return "missing";
    switch (t->nodes[node].type) {
    case VK_PT_NONE: return "None";
    case VK_PT_BOOL: return "a bool";
    case VK_PT_INT: case VK_PT_UINT: case VK_PT_BIGINT: return "an int";
    case VK_PT_FLOAT: return "a float";
    case VK_PT_STR: return "a str";
    case VK_PT_BYTES: return "bytes";
    case VK_PT_LIST: return "a list";
    case VK_PT_TUPLE: return "a tuple";
    case VK_PT_DICT: return "a dict";
    default: return "a set";
    }
}

/* Where a failing field is, for the message: `where`, or (NULL) the entry being read. */
static const char *where_of(rd_t *r, const char *where, char *buf, size_t cap) {
    if (where) return where;
    snprintf(buf, cap, "device_traces[%d][%" PRIu64 "]: malformed entry", r->h->device, r->entry);
    return buf;
}

/* Value node v of `key` as an integer in [0, limit) (limit 0: 2**64); `dflt` when absent
 * (NONE32) or None, required if dflt < 0. */
static vram_status_t uint_of(rd_t *r, uint32_t v, const char *key, const char *where, int64_t dflt, uint64_t limit,
                             uint64_t *out) {
    const vk_pt_node_t *n = v == NONE32 ? NULL : &r->t->nodes[v];
    char buf[96];
    if (!n || n->type == VK_PT_NONE) {
        if (dflt < 0)
            return vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s: missing '%s'", r->what,
                              where_of(r, where, buf, sizeof buf), key);
        *out = (uint64_t)dflt;
        return VRAM_OK;
    }
    int ok = (n->type == VK_PT_INT && (int64_t)n->v >= 0 && (limit == 0 || n->v < limit)) ||
             (n->type == VK_PT_UINT && limit == 0);
    if (!ok) {
        char range[48];
        if (limit) snprintf(range, sizeof range, "%" PRIu64, limit - 1);
        else snprintf(range, sizeof range, "2**64-1");
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s: '%s' is %s; expected an integer from 0 to %s", r->what,
                          where_of(r, where, buf, sizeof buf), key,
                          n->type == VK_PT_INT && (int64_t)n->v < 0 ? "negative" : describe(r->t, v), range);
    }
    *out = n->v;
    return VRAM_OK;
}

static vram_status_t get_uint(rd_t *r, uint32_t d, const char *key, const char *where, int64_t dflt,
                              uint64_t limit, uint64_t *out) {
    return uint_of(r, vk_pt_get(r->t, d, key), key, where, dflt, limit, out);
}

static vram_status_t stream_of(rd_t *r, uint32_t v, const char *where, uint64_t *out) {
    const vk_pt_node_t *n = v == NONE32 ? NULL : &r->t->nodes[v];
    if (!n || n->type == VK_PT_NONE) { *out = 0; return VRAM_OK; }
    if (n->type != VK_PT_INT && n->type != VK_PT_UINT) {
        char buf[96];
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s: 'stream' is %s; expected a 64-bit integer (a cudaStream_t)",
                          r->what, where_of(r, where, buf, sizeof buf), describe(r->t, v));
    }
    *out = n->v;
    return VRAM_OK;
}

static int64_t time_of(rd_t *r, uint32_t v) {
    if (v == NONE32 || r->t->nodes[v].type != VK_PT_INT) return NO_TIME; /* a viewer's extra: optional */
    return (int64_t)r->t->nodes[v].v;
}

/* The fields of a trace entry the reader uses, found in one walk over the entry's items (the
 * last binding of a key wins, as in a dict). Keys are compared by length first: most differ. */
enum { F_ACTION, F_ADDR, F_SIZE, F_STREAM, F_TIME, F_FRAMES, F_DEVICE_FREE, F_COUNT };
typedef struct fields { uint32_t v[F_COUNT]; } fields_t;

static int key_field(rd_t *r, uint32_t k);

static void entry_fields(rd_t *r, uint32_t d, fields_t *f) {
    const vk_ptree_t *t = r->t;
    for (int i = 0; i < F_COUNT; i++) f->v[i] = NONE32;
    uint32_t k, v;
    for (vk_pt_iter_t it = vk_pt_iter(t, d); vk_pt_next(&it, &k) && vk_pt_next(&it, &v);) {
        int field = key_field(r, k);
        if (field >= 0) f->v[field] = v;
    }
}

/* The field a key node names (-1: none the reader uses). */
static int key_field(rd_t *r, uint32_t k) {
    const vk_ptree_t *t = r->t;
    uint32_t slot = k & 63;
    /* a node remembered as an action name is no key */
    if (r->seen_node[slot] == k + 1) return r->seen_meaning[slot] < 16 ? r->seen_meaning[slot] : -1;
    static const struct { const char *name; uint32_t len; int field; } keys[] = {
        {"action", 6, F_ACTION}, {"stream", 6, F_STREAM}, {"frames", 6, F_FRAMES}, {"addr", 4, F_ADDR},
        {"size", 4, F_SIZE}, {"time_us", 7, F_TIME}, {"device_free", 11, F_DEVICE_FREE}};
    int field = -1;
    const vk_pt_node_t *n = &t->nodes[k];
    for (size_t j = 0; n->type == VK_PT_STR && j < sizeof keys / sizeof keys[0]; j++)
        if (n->n == keys[j].len && memcmp(vk_pt_bytes(t, n), keys[j].name, n->n) == 0) {
            field = keys[j].field;
            break;
        }
    r->seen_node[slot] = k + 1;
    r->seen_meaning[slot] = (int8_t)field;
    return field;
}

static int action_named(const vk_ptree_t *t, uint32_t node);

/* action_named, remembered by node id like the keys (meanings 16 + the action). */
static int action_of(rd_t *r, uint32_t node) {
    uint32_t slot = node & 63;
    if (node != NONE32 && r->seen_node[slot] == node + 1 && r->seen_meaning[slot] >= 16)
        return r->seen_meaning[slot] - 16;
    int a = action_named(r->t, node);
    if (node != NONE32) {
        r->seen_node[slot] = node + 1;
        r->seen_meaning[slot] = (int8_t)(16 + a);
    }
    return a;
}

static int action_named(const vk_ptree_t *t, uint32_t node) {
    static const struct { const char *name; int kind; } names[] = {
        {"alloc", A_ALLOC}, {"free_requested", A_FREE_REQUESTED}, {"free", A_FREE},
        {"free_completed", A_FREE_COMPLETED}, {"segment_alloc", A_SEG_PLUS}, {"segment_map", A_SEG_PLUS},
        {"segment_free", A_SEG_MINUS}, {"segment_unmap", A_SEG_MINUS}, {"oom", A_OOM}};
    if (node == NONE32 || t->nodes[node].type != VK_PT_STR) return A_OTHER;
    const vk_pt_node_t *n = &t->nodes[node];
    const uint8_t *bytes = vk_pt_bytes(t, n);
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strlen(names[i].name) == n->n && memcmp(bytes, names[i].name, n->n) == 0) return names[i].kind;
    return A_OTHER;
}

static int is_seq(const vk_ptree_t *t, uint32_t node) {
    return node != NONE32 && (t->nodes[node].type == VK_PT_LIST || t->nodes[node].type == VK_PT_TUPLE);
}

/* ---------------------------------------------------------------------------------- device */

static vram_status_t pick_device(rd_t *r, uint32_t traces, uint32_t segments, int device, uint32_t *entries) {
    uint32_t k, n = r->t->nodes[traces].n, busy = 0, first_busy = 0;
    char list[160] = "";
    if (device >= 0) {
        if ((uint32_t)device >= n)
            return vram__fail(VRAM_ERR_INVALID_ARG, "device %d is out of range for %s: it has %u device trace(s)",
                              device, r->what, n);
    }
    uint32_t i = 0;
    for (vk_pt_iter_t it = vk_pt_iter(r->t, traces); vk_pt_next(&it, &k); i++) {
        if ((int)i == device) *entries = k;
        if (r->t->nodes[k].n) {
            size_t used = strlen(list);
            if (used + 16 < sizeof list) snprintf(list + used, sizeof list - used, "%s%u", busy ? ", " : "", i);
            if (!busy++) first_busy = i;
        }
    }
    if (device >= 0) {
        r->h->device = device;
        return VRAM_OK;
    }
    if (busy > 1)
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: devices [%s] all have trace entries; pass a device (one of them)",
                          r->what, list);
    if (n == 0)
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: 'device_traces' is empty (no device); record with "
                          "torch.cuda.memory._record_memory_history() before taking the snapshot", r->what);
    uint32_t pick = first_busy;
    if (!busy) { /* no entries anywhere: the device of the segments if they name exactly one */
        uint64_t dev = 0, only = UINT64_MAX;
        int several = 0;
        for (vk_pt_iter_t it = vk_pt_iter(r->t, segments); vk_pt_next(&it, &k);) {
            vram_status_t s = get_uint(r, k, "device", "a segment", 0, UINT64_C(1) << 31, &dev);
            if (s != VRAM_OK) return s;
            if (only != UINT64_MAX && only != dev) several = 1;
            only = dev;
        }
        pick = (!several && only != UINT64_MAX && only < n) ? (uint32_t)only : 0;
    }
    i = 0;
    for (vk_pt_iter_t it = vk_pt_iter(r->t, traces); vk_pt_next(&it, &k); i++)
        if (i == pick) *entries = k;
    r->h->device = (int)pick;
    return VRAM_OK;
}

/* ---------------------------------------------------------------------------------- final blocks */

typedef struct block { uint64_t addr, size, requested, stream; uint32_t frames; } block_t;

static vram_status_t final_blocks(rd_t *r, uint32_t segments, block_t **out, uint64_t *count) {
    vk_vec_t blocks = {0};
    uint64_t visited = 0, budget = r->t->len;
    uint32_t seg, b;
    vram_status_t s = VRAM_OK;
    uint64_t si = 0;
    for (vk_pt_iter_t it = vk_pt_iter(r->t, segments); s == VRAM_OK && vk_pt_next(&it, &seg); si++) {
        uint64_t dev, total, addr, stream;
        char where[64];
        snprintf(where, sizeof where, "segment %" PRIu64, si);
        if ((s = get_uint(r, seg, "device", where, r->h->device, UINT64_C(1) << 31, &dev)) != VRAM_OK) break;
        if (dev != (uint64_t)r->h->device) continue;
        if ((s = get_uint(r, seg, "total_size", where, -1, SIZE_LIMIT, &total)) != VRAM_OK) break;
        if ((s = get_uint(r, seg, "address", where, 0, 0, &addr)) != VRAM_OK) break;
        if ((s = stream_of(r, vk_pt_get(r->t, seg, "stream"), where, &stream)) != VRAM_OK) break;
        if ((s = vk_history_put(r->h, VK_H_FS_ADDR, addr)) || (s = vk_history_put(r->h, VK_H_FS_SIZE, total)) ||
            (s = vk_history_put(r->h, VK_H_FS_STREAM, stream)))
            break;
        uint32_t list = vk_pt_get(r->t, seg, "blocks");
        if (list == NONE32 || r->t->nodes[list].type == VK_PT_NONE) continue;
        if (!is_seq(r->t, list)) {
            s = vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s: 'blocks' is %s; expected a list", r->what, where,
                           describe(r->t, list));
            break;
        }
        visited += r->t->nodes[list].n;
        if (visited > budget) {
            s = vram__fail(VRAM_ERR_INVALID_ARG, "%s: its segments list more blocks than a file of %zu bytes can hold "
                           "(the same objects referenced over and over); refusing", r->what, r->t->len);
            break;
        }
        uint64_t bi = 0;
        for (vk_pt_iter_t bt = vk_pt_iter(r->t, list); s == VRAM_OK && vk_pt_next(&bt, &b); bi++) {
            char bwhere[96];
            uint64_t size, req = 0;
            snprintf(bwhere, sizeof bwhere, "segment %" PRIu64 ", block %" PRIu64, si, bi);
            if (r->t->nodes[b].type != VK_PT_DICT) {
                s = vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s: the block is %s; expected a dict", r->what, bwhere,
                               describe(r->t, b));
                break;
            }
            if ((s = get_uint(r, b, "size", bwhere, -1, SIZE_LIMIT, &size)) != VRAM_OK) break;
            if (vk_pt_get(r->t, b, "address") != NONE32 &&
                (s = get_uint(r, b, "address", bwhere, -1, 0, &addr)) != VRAM_OK)
                break;
            uint32_t state = vk_pt_get(r->t, b, "state");
            if (state == NONE32 || r->t->nodes[state].type != VK_PT_STR) {
                s = vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s: 'state' is %s; expected a string such as "
                               "'active_allocated' or 'inactive'", r->what, bwhere, describe(r->t, state));
                break;
            }
            if (vk_pt_str_is(r->t, state, "active_allocated") || vk_pt_str_is(r->t, state, "active_pending_free") ||
                vk_pt_str_is(r->t, state, "active_awaiting_free")) {
                if ((s = get_uint(r, b, "requested_size", bwhere, 0, SIZE_LIMIT, &req)) != VRAM_OK) break;
                if (blocks.n == blocks.cap) {
                    uint64_t cap = blocks.cap ? blocks.cap * 2 : 64;
                    void *p = realloc(blocks.p, (size_t)cap * sizeof(block_t));
                    if (!p) { s = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory reading segments"); break; }
                    blocks.p = p;
                    blocks.cap = cap;
                }
                ((block_t *)blocks.p)[blocks.n++] =
                    (block_t){addr, size, req, stream, vk_pt_get(r->t, b, "frames")};
            }
            addr += size;
        }
    }
    if (s != VRAM_OK) { free(blocks.p); return s; }
    *out = blocks.p;
    *count = blocks.n;
    return VRAM_OK;
}

/* ---------------------------------------------------------------------------------- entries */

typedef struct initial { uint64_t addr, size, stream; int32_t stack; } initial_t;

static int by_addr(const void *a, const void *b) {
    uint64_t x = ((const initial_t *)a)->addr, y = ((const initial_t *)b)->addr;
    return (x > y) - (x < y);
}

static vram_status_t add_alloc(rd_t *r, vk_u64map_t *live, uint64_t addr, uint64_t size, uint64_t stream,
                               int32_t stack, int64_t time) {
    vk_history_t *h = r->h;
    uint64_t id = h->col[VK_H_A_SIZE].n;
    if (id >= UINT32_MAX) return vram__fail(VRAM_ERR_INVALID_ARG, "%s: more than 4 billion allocations", r->what);
    vram_status_t s;
    if ((s = vk_history_put(h, VK_H_A_SIZE, size)) || (s = vk_history_put(h, VK_H_A_ADDR, addr)) ||
        (s = vk_history_put(h, VK_H_A_STREAM, stream)) ||
        (s = vk_history_put(h, VK_H_A_STACK, (uint64_t)(int64_t)stack)) || (s = vk_history_put(h, VK_H_EV_KIND, 0)) ||
        (s = vk_history_put(h, VK_H_EV_ID, id)) || (s = vk_history_put(h, VK_H_EV_TIME, (uint64_t)time)))
        return s;
    if (vk_u64map_put(live, addr, id)) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory");
    return VRAM_OK;
}

static vram_status_t contradiction(rd_t *r, uint64_t dev, uint64_t i, const char *action, uint64_t addr,
                                   const char *why) {
    return vram__fail(VRAM_ERR_INVALID_ARG, "%s: device_traces[%" PRIu64 "][%" PRIu64 "]: %s at address 0x%" PRIx64
                      ", %s; entries contradict each other", r->what, dev, i, action, addr, why);
}

static vram_status_t read_entries(rd_t *r, uint32_t entries, uint32_t segments) {
    vk_history_t *h = r->h;
    const vk_ptree_t *t = r->t;
    uint64_t dev = (uint64_t)h->device, n = t->nodes[entries].n;
    uint32_t *list = malloc((size_t)(n ? n : 1) * sizeof *list);
    block_t *blocks = NULL;
    uint64_t n_blocks = 0, n_initial = 0, i = 0;
    initial_t *initial = NULL;
    vk_u64map_t first = {0}, live = {0}, pending = {0}, active_end = {0};
    vram_status_t s = list ? VRAM_OK : vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory");
    if (s == VRAM_OK) {
        uint32_t e;
        for (vk_pt_iter_t it = vk_pt_iter(t, entries); vk_pt_next(&it, &e);) list[i++] = e;
        s = final_blocks(r, segments, &blocks, &n_blocks);
    }
    for (uint64_t b = 0; s == VRAM_OK && b < n_blocks; b++)
        if (vk_u64map_put(&active_end, blocks[b].addr, b)) s = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory");

    /* Pass 1: every entry's shape, and the first entry naming each address. */
    fields_t f;
    for (i = 0; s == VRAM_OK && i < n; i++) {
        char where[96];
        uint32_t e = list[i];
        r->entry = i;
        if (t->nodes[e].type != VK_PT_DICT) {
            s = vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s (%s); entries are dicts with 'action', and 'addr', 'size', "
                           "'stream' for alloc, free and segment actions", r->what,
                           where_of(r, NULL, where, sizeof where), describe(t, e));
            break;
        }
        entry_fields(r, e, &f);
        uint32_t act = f.v[F_ACTION];
        if (act == NONE32 || t->nodes[act].type != VK_PT_STR) {
            s = vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s ('action' is %s); alloc and free entries need 'action', "
                           "'addr' and 'size'", r->what, where_of(r, NULL, where, sizeof where), describe(t, act));
            break;
        }
        int a = action_of(r, act);
        uint64_t v;
        if (a >= A_ALLOC && a <= A_FREE_COMPLETED) {
            if ((s = uint_of(r, f.v[F_SIZE], "size", NULL, -1, SIZE_LIMIT, &v)) ||
                (s = stream_of(r, f.v[F_STREAM], NULL, &v)) || (s = uint_of(r, f.v[F_ADDR], "addr", NULL, -1, 0, &v)))
                break;
            if (vk_u64map_find(&first, v) < 0 && vk_u64map_put(&first, v, i))
                s = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory");
        } else if (a == A_SEG_PLUS || a == A_SEG_MINUS || a == A_OOM) {
            s = uint_of(r, f.v[F_SIZE], "size", NULL, -1, SIZE_LIMIT, &v);
            if (s == VRAM_OK && a == A_OOM) s = uint_of(r, f.v[F_DEVICE_FREE], "device_free", NULL, 0, 0, &v);
            if (s == VRAM_OK && a != A_OOM && f.v[F_ADDR] != NONE32)
                s = uint_of(r, f.v[F_ADDR], "addr", NULL, 0, 0, &v);
            if (s == VRAM_OK && a != A_OOM) s = stream_of(r, f.v[F_STREAM], NULL, &v);
        }
    }

    /* Allocations alive before the trace, in address order. */
    if (s == VRAM_OK) {
        initial = malloc((size_t)(first.count + n_blocks + 1) * sizeof *initial);
        if (!initial) s = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory");
    }
    for (uint64_t slot = 0; s == VRAM_OK && slot < first.capacity; slot++) {
        if (first.used[slot] != 1) continue;
        uint32_t e = list[first.values[slot]];
        entry_fields(r, e, &f);
        if (action_of(r, f.v[F_ACTION]) == A_ALLOC) continue;
        uint64_t size, stream; /* checked in pass 1 */
        if ((s = uint_of(r, f.v[F_SIZE], "size", NULL, -1, SIZE_LIMIT, &size)) ||
            (s = stream_of(r, f.v[F_STREAM], NULL, &stream)))
            break;
        initial[n_initial++] = (initial_t){first.keys[slot], size, stream, -1};
    }
    for (uint64_t b = 0; s == VRAM_OK && b < n_blocks; b++) {
        const block_t *k = &blocks[b];
        if (vk_u64map_find(&first, k->addr) >= 0) continue;
        int32_t stack = -1;
        s = vk_stacks_of(&r->stacks, k->frames, &stack);
        uint64_t size = (h->block_sizes || k->requested == 0) ? k->size : k->requested;
        initial[n_initial++] = (initial_t){k->addr, size, k->stream, stack};
    }
    if (s == VRAM_OK) qsort(initial, (size_t)n_initial, sizeof *initial, by_addr);
    for (uint64_t k = 0; s == VRAM_OK && k < n_initial; k++)
        s = add_alloc(r, &live, initial[k].addr, initial[k].size, initial[k].stream, initial[k].stack, NO_TIME);
    h->initial_allocations = n_initial;

    /* Pass 2: the events (every field used here was checked in pass 1). */
    for (i = 0; s == VRAM_OK && i < n; i++) {
        uint32_t e = list[i];
        entry_fields(r, e, &f);
        int a = action_of(r, f.v[F_ACTION]);
        uint64_t addr = 0, size = 0, stream = 0, id = 0, mem_events = h->col[VK_H_EV_KIND].n;
        int64_t time = time_of(r, f.v[F_TIME]);
        r->entry = i;
        if (a != A_OTHER && a != A_OOM &&
            ((s = uint_of(r, f.v[F_ADDR], "addr", NULL, 0, 0, &addr)) ||
             (s = uint_of(r, f.v[F_SIZE], "size", NULL, -1, SIZE_LIMIT, &size)) ||
             (s = stream_of(r, f.v[F_STREAM], NULL, &stream))))
            break;
        if (a == A_ALLOC) {
            if (vk_u64map_find(&live, addr) >= 0) {
                s = contradiction(r, dev, i, "alloc", addr, "which holds a block not yet freed (no free_completed "
                                  "for it)");
                break;
            }
            int32_t stack = -1;
            if ((s = vk_stacks_of(&r->stacks, f.v[F_FRAMES], &stack)) != VRAM_OK) break;
            s = add_alloc(r, &live, addr, size, stream, stack, time);
        } else if (a == A_FREE_COMPLETED) {
            if (!vk_u64map_remove(&live, addr, &id)) {
                s = contradiction(r, dev, i, "free_completed", addr, "where no block is allocated at that point");
                break;
            }
            vk_u64map_remove(&pending, addr, NULL);
            if ((s = vk_history_put(h, VK_H_EV_KIND, 1)) || (s = vk_history_put(h, VK_H_EV_ID, id)) ||
                (s = vk_history_put(h, VK_H_EV_TIME, (uint64_t)time)))
                break;
        } else if (a == A_FREE_REQUESTED || a == A_FREE) {
            if (vk_u64map_find(&live, addr) < 0) {
                s = contradiction(r, dev, i, a == A_FREE ? "free" : "free_requested", addr,
                                  "where no block is allocated at that point");
                break;
            }
            if (vk_u64map_put(&pending, addr, i)) s = vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory");
        } else if ((a == A_SEG_PLUS || a == A_SEG_MINUS) && f.v[F_ADDR] != NONE32) {
            if ((s = vk_history_put(h, VK_H_SE_EVENT, mem_events)) || (s = vk_history_put(h, VK_H_SE_ADDR, addr)) ||
                (s = vk_history_put(h, VK_H_SE_SIZE, size)) || (s = vk_history_put(h, VK_H_SE_STREAM, stream)) ||
                (s = vk_history_put(h, VK_H_SE_SIGN, a == A_SEG_PLUS ? 1 : (uint64_t)(int64_t)-1)))
                break;
        } else if (a == A_OOM) {
            uint64_t free_bytes = 0;
            int has_free = f.v[F_DEVICE_FREE] != NONE32 && t->nodes[f.v[F_DEVICE_FREE]].type != VK_PT_NONE;
            if ((s = uint_of(r, f.v[F_SIZE], "size", NULL, -1, SIZE_LIMIT, &size)) ||
                (s = uint_of(r, f.v[F_DEVICE_FREE], "device_free", NULL, 0, 0, &free_bytes)))
                break;
            if ((s = vk_history_put(h, VK_H_OOM_EVENT, mem_events)) || (s = vk_history_put(h, VK_H_OOM_SIZE, size)) ||
                (s = vk_history_put(h, VK_H_OOM_FREE, has_free ? free_bytes : (uint64_t)(int64_t)-1)) ||
                (s = vk_history_put(h, VK_H_OOM_TIME, (uint64_t)time)))
                break;
        }
    }
    h->unfinished_frees = pending.count;
    h->entries = n;
    free(list);
    free(blocks);
    free(initial);
    vk_u64map_free(&first);
    vk_u64map_free(&live);
    vk_u64map_free(&pending);
    vk_u64map_free(&active_end);
    return s;
}

vram_status_t vk_history_read(const void *data, size_t len, int device, vk_history_t *out) {
    memset(out, 0, sizeof *out);
    vk_ptree_t tree;
    vram_status_t s = vk_ptree_build(&tree, data, len);
    if (s != VRAM_OK) return s;
    rd_t r = {.t = &tree, .h = out, .what = "snapshot"};
    vk_stacks_init(&r.stacks, &tree, out);
    uint32_t root = tree.root, segments = vk_pt_get(&tree, root, "segments"), traces = vk_pt_get(&tree, root,
                                                                                                    "device_traces");
    if (tree.nodes[root].type != VK_PT_DICT)
        s = vram__fail(VRAM_ERR_INVALID_ARG, "snapshot: holds %s, expected a dict from torch.cuda.memory._snapshot() "
                       "or vramkit.memory_snapshot() with keys 'segments' and 'device_traces'", describe(&tree, root));
    else if (segments == NONE32 || traces == NONE32)
        s = vram__fail(VRAM_ERR_INVALID_ARG, "snapshot: missing %s; expected a dict from torch.cuda.memory._snapshot() "
                       "or vramkit.memory_snapshot() with keys 'segments' and 'device_traces'",
                       segments == NONE32 && traces == NONE32 ? "'segments' and 'device_traces'"
                       : segments == NONE32 ? "'segments'" : "'device_traces'");
    if (s == VRAM_OK) {
        uint32_t k;
        int ok = is_seq(&tree, traces);
        for (vk_pt_iter_t it = vk_pt_iter(&tree, traces); ok && vk_pt_next(&it, &k);) ok = is_seq(&tree, k);
        if (!ok)
            s = vram__fail(VRAM_ERR_INVALID_ARG, "snapshot: 'device_traces' must be a list with one list of trace "
                           "entries per device");
        ok = is_seq(&tree, segments);
        for (vk_pt_iter_t it = vk_pt_iter(&tree, segments); ok && vk_pt_next(&it, &k);)
            ok = tree.nodes[k].type == VK_PT_DICT;
        if (s == VRAM_OK && !ok)
            s = vram__fail(VRAM_ERR_INVALID_ARG, "snapshot: 'segments' must be a list of segment dicts");
    }
    if (s == VRAM_OK) {
        uint32_t entries = NONE32;
        out->block_sizes = vk_pt_get(&tree, root, "vramkit_device") != NONE32;
        s = pick_device(&r, traces, segments, device, &entries);
        if (s == VRAM_OK) s = read_entries(&r, entries, segments);
    }
    if (s == VRAM_OK) s = vk_stacks_finish(&r.stacks);
    vk_stacks_free(&r.stacks);
    vk_ptree_free(&tree);
    if (s != VRAM_OK) vk_history_free(out);
    return s;
}
