/* stack_intern.c — see stack_intern.h. Content keys are 64-bit hashes; a hash already taken by
 * different content moves on to the hash of the hash, so collisions cost a probe, never a
 * wrong match. */
#include "stack_intern.h"

#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

#define NONE32 UINT32_MAX

static vram_status_t no_memory(void) {
    return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory interning the snapshot's stacks");
}

void vk_stacks_init(vk_stacks_t *st, const vk_ptree_t *t, vk_history_t *h) {
    memset(st, 0, sizeof *st);
    st->t = t;
    st->h = h;
}

void vk_stacks_free(vk_stacks_t *st) {
    vk_u64map_free(&st->stack_by_node);
    vk_u64map_free(&st->frame_by_node);
    vk_u64map_free(&st->str_by_node);
    vk_u64map_free(&st->stack_by_hash);
    vk_u64map_free(&st->frame_by_hash);
    vk_u64map_free(&st->str_by_hash);
    free(st->scratch);
    memset(st, 0, sizeof *st);
}

static const uint64_t *col64(const vk_history_t *h, int c) { return h->col[c].p; }
static const uint32_t *col32(const vk_history_t *h, int c) { return h->col[c].p; }

/* Equality of candidate id `id` with the content being interned. */
typedef int (*same_fn)(const vk_stacks_t *st, uint64_t id, const void *content, uint64_t len);

static int same_str(const vk_stacks_t *st, uint64_t id, const void *content, uint64_t len) {
    const uint64_t *start = col64(st->h, VK_H_STR_START);
    return start[id + 1] - start[id] == len &&
           memcmp((const uint8_t *)st->h->col[VK_H_STR_DATA].p + start[id], content, (size_t)len) == 0;
}

static int same_frame(const vk_stacks_t *st, uint64_t id, const void *content, uint64_t len) {
    (void)len;
    const uint64_t *key = content; /* file, name, line */
    return col32(st->h, VK_H_F_FILE)[id] == key[0] && col32(st->h, VK_H_F_NAME)[id] == key[1] &&
           (uint64_t)((const int64_t *)st->h->col[VK_H_F_LINE].p)[id] == key[2];
}

static int same_stack(const vk_stacks_t *st, uint64_t id, const void *content, uint64_t len) {
    const uint64_t *start = col64(st->h, VK_H_STACK_START);
    return start[id + 1] - start[id] == len &&
           memcmp(col32(st->h, VK_H_STACK_FRAMES) + start[id], content, (size_t)len * sizeof(uint32_t)) == 0;
}

/* Find content by hash: *id when found (returns 1); else 0 with *key the free hash key to insert at. */
static int lookup(const vk_stacks_t *st, const vk_u64map_t *map, uint64_t hash, same_fn same, const void *content,
                  uint64_t len, uint64_t *id, uint64_t *key) {
    for (uint64_t k = hash;; k = vk_hash_u64(k + 1)) {
        int64_t at = vk_u64map_find(map, k);
        if (at < 0) { *key = k; return 0; }
        if (same(st, map->values[at], content, len)) { *id = map->values[at]; return 1; }
    }
}

/* Offset columns hold one entry per item plus the end: the first item writes the leading 0. */
static vram_status_t open_offsets(vk_history_t *h, int col) {
    return h->col[col].n ? VRAM_OK : vk_history_put(h, col, 0);
}

static vram_status_t intern_bytes(vk_stacks_t *st, const uint8_t *p, uint64_t n, uint32_t *out) {
    vk_history_t *h = st->h;
    uint64_t id, key, hash = vk_hash_bytes(p, (size_t)n, 1);
    vram_status_t s = open_offsets(h, VK_H_STR_START);
    if (s != VRAM_OK) return s;
    if (lookup(st, &st->str_by_hash, hash, same_str, p, n, &id, &key)) { *out = (uint32_t)id; return VRAM_OK; }
    id = h->col[VK_H_STR_START].n - 1;
    for (uint64_t i = 0; i < n; i++)
        if ((s = vk_history_put(h, VK_H_STR_DATA, p[i])) != VRAM_OK) return s;
    if ((s = vk_history_put(h, VK_H_STR_START, h->col[VK_H_STR_DATA].n)) != VRAM_OK) return s;
    if (vk_u64map_put(&st->str_by_hash, key, id)) return no_memory();
    *out = (uint32_t)id;
    return VRAM_OK;
}

static vram_status_t intern_str(vk_stacks_t *st, uint32_t node, const char *dflt, const char *key, uint32_t *out) {
    if (node == NONE32 || st->t->nodes[node].type == VK_PT_NONE)
        return intern_bytes(st, (const uint8_t *)dflt, strlen(dflt), out);
    int64_t at = vk_u64map_find(&st->str_by_node, node);
    if (at >= 0) { *out = (uint32_t)st->str_by_node.values[at]; return VRAM_OK; }
    const vk_pt_node_t *n = &st->t->nodes[node];
    if (n->type != VK_PT_STR)
        return vram__fail(VRAM_ERR_INVALID_ARG, "snapshot: a frame's '%s' is not a string", key);
    vram_status_t s = intern_bytes(st, vk_pt_bytes(st->t, n), n->n, out);
    if (s == VRAM_OK && vk_u64map_put(&st->str_by_node, node, *out)) return no_memory();
    return s;
}

static vram_status_t intern_frame(vk_stacks_t *st, uint32_t node, uint32_t *out) {
    int64_t at = vk_u64map_find(&st->frame_by_node, node);
    if (at >= 0) { *out = (uint32_t)st->frame_by_node.values[at]; return VRAM_OK; }
    const vk_ptree_t *t = st->t;
    uint32_t file, name, line_node = vk_pt_get(t, node, "line");
    vram_status_t s = intern_str(st, vk_pt_get(t, node, "filename"), "", "filename", &file);
    if (s == VRAM_OK) s = intern_str(st, vk_pt_get(t, node, "name"), "?", "name", &name);
    if (s != VRAM_OK) return s;
    int64_t line = 0;
    if (line_node != NONE32 && t->nodes[line_node].type == VK_PT_INT) line = (int64_t)t->nodes[line_node].v;
    uint64_t content[3] = {file, name, (uint64_t)line}, id, key;
    uint64_t hash = vk_hash_bytes(content, sizeof content, 2);
    if (!lookup(st, &st->frame_by_hash, hash, same_frame, content, 3, &id, &key)) {
        vk_history_t *h = st->h;
        id = h->col[VK_H_F_FILE].n;
        if ((s = vk_history_put(h, VK_H_F_FILE, file)) || (s = vk_history_put(h, VK_H_F_NAME, name)) ||
            (s = vk_history_put(h, VK_H_F_LINE, (uint64_t)line)))
            return s;
        if (vk_u64map_put(&st->frame_by_hash, key, id)) return no_memory();
    }
    if (vk_u64map_put(&st->frame_by_node, node, id)) return no_memory();
    *out = (uint32_t)id;
    return VRAM_OK;
}

vram_status_t vk_stacks_of(vk_stacks_t *st, uint32_t frames, int32_t *stack) {
    const vk_ptree_t *t = st->t;
    *stack = -1;
    if (frames == NONE32) return VRAM_OK;
    uint8_t type = t->nodes[frames].type;
    if (type == VK_PT_NONE || ((type == VK_PT_LIST || type == VK_PT_TUPLE) && t->nodes[frames].n == 0))
        return VRAM_OK;
    if (type != VK_PT_LIST && type != VK_PT_TUPLE)
        return vram__fail(VRAM_ERR_INVALID_ARG, "snapshot: an entry's 'frames' is not a list");
    int64_t at = vk_u64map_find(&st->stack_by_node, frames);
    if (at >= 0) { *stack = (int32_t)st->stack_by_node.values[at]; return VRAM_OK; }
    uint64_t n = 0;
    uint32_t f;
    vram_status_t s = VRAM_OK;
    if (t->nodes[frames].n > st->scratch_cap) {
        free(st->scratch);
        st->scratch_cap = t->nodes[frames].n;
        st->scratch = malloc((size_t)st->scratch_cap * sizeof *st->scratch);
        if (!st->scratch) { st->scratch_cap = 0; return no_memory(); }
    }
    for (vk_pt_iter_t it = vk_pt_iter(t, frames); s == VRAM_OK && vk_pt_next(&it, &f);)
        if (t->nodes[f].type == VK_PT_DICT) s = intern_frame(st, f, &st->scratch[n++]);
    if (s != VRAM_OK) return s;
    vk_history_t *h = st->h;
    uint64_t id, key, hash = vk_hash_bytes(st->scratch, (size_t)n * sizeof *st->scratch, 3);
    if ((s = open_offsets(h, VK_H_STACK_START)) != VRAM_OK) return s;
    if (!lookup(st, &st->stack_by_hash, hash, same_stack, st->scratch, n, &id, &key)) {
        id = h->col[VK_H_STACK_START].n - 1;
        if (id >= INT32_MAX) return vram__fail(VRAM_ERR_INVALID_ARG, "snapshot: more than 2 billion distinct stacks");
        for (uint64_t i = 0; i < n; i++)
            if ((s = vk_history_put(h, VK_H_STACK_FRAMES, st->scratch[i])) != VRAM_OK) return s;
        if ((s = vk_history_put(h, VK_H_STACK_START, h->col[VK_H_STACK_FRAMES].n)) != VRAM_OK) return s;
        if (vk_u64map_put(&st->stack_by_hash, key, id)) return no_memory();
    }
    if (vk_u64map_put(&st->stack_by_node, frames, id)) return no_memory();
    *stack = (int32_t)id;
    return VRAM_OK;
}

vram_status_t vk_stacks_finish(vk_stacks_t *st) {
    vram_status_t s = open_offsets(st->h, VK_H_STACK_START);
    return s != VRAM_OK ? s : open_offsets(st->h, VK_H_STR_START);
}
