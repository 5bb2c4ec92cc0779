/* pickle_tree.h — a plain-data pickle read into a compact tree, without Python objects.
 *
 * Why: a snapshot of 10 million events unpickled by Python is ~100 million objects (tens of
 * GB and minutes). This reader keeps 16 bytes a value, points strings into the caller's buffer
 * instead of copying them, and shares what the pickle's memo shares (a frames list memoized
 * once is one node however many events name it). The pickle is first checked with
 * vram_plain_pickle_check (no object named, called or built; every length inside the data), so
 * the tree only ever holds dicts, lists, tuples, sets, strings, bytes, numbers, None, booleans. */
#ifndef VRAM_VIEW_PICKLE_TREE_H
#define VRAM_VIEW_PICKLE_TREE_H

#include <stddef.h>
#include <stdint.h>

#include "vramkit.h"

enum {
    VK_PT_NONE, VK_PT_BOOL, VK_PT_INT, VK_PT_UINT, VK_PT_BIGINT, VK_PT_FLOAT,
    VK_PT_STR, VK_PT_BYTES, VK_PT_LIST, VK_PT_TUPLE, VK_PT_DICT, VK_PT_SET
};

#define VK_PT_NO_SEG UINT32_MAX
#define VK_PT_HEAP 0x1 /* flags: a string's bytes are in tree->heap (decoded text), not in data */

typedef struct vk_pt_node {
    uint8_t type;
    uint8_t flags;
    uint16_t unused;
    /* STR/BYTES: length; containers: number of children (a dict counts keys and values) */
    uint32_t n;
    /* INT: int64; UINT: values from 2**63 to 2**64-1; BOOL: 0/1; FLOAT: the double's bits;
     * STR/BYTES: byte offset into data (or heap); containers: first segment | last << 32 */
    uint64_t v;
} vk_pt_node_t;

/* A container's children arrive in batches (APPENDS, SETITEMS); each batch is a run of kids. */
typedef struct vk_pt_seg {
    uint64_t start; /* into kids */
    uint32_t count;
    uint32_t next;  /* VK_PT_NO_SEG at the last */
} vk_pt_seg_t;

typedef struct vk_ptree {
    const uint8_t *data;
    size_t len;
    vk_pt_node_t *nodes;
    uint64_t n_nodes, cap_nodes;
    vk_pt_seg_t *segs;
    uint64_t n_segs, cap_segs;
    uint32_t *kids;
    uint64_t n_kids, cap_kids;
    uint8_t *heap; /* protocol-0 strings, decoded */
    uint64_t heap_len, heap_cap;
    uint32_t root;
} vk_ptree_t;

/* Read the pickle in data[0, len) (kept by the caller while the tree lives). VRAM_ERR_INVALID_ARG
 * with the reason (the opcode and its byte offset) for anything but plain data, or structure the
 * unpickler would refuse (APPEND to a dict, a stack emptied too early); VRAM_ERR_HOST_MEMORY. */
vram_status_t vk_ptree_build(vk_ptree_t *tree, const void *data, size_t len);
void vk_ptree_free(vk_ptree_t *tree);

/* The bytes of a STR/BYTES node. */
static inline const uint8_t *vk_pt_bytes(const vk_ptree_t *t, const vk_pt_node_t *n) {
    return (n->flags & VK_PT_HEAP) ? t->heap + n->v : t->data + n->v;
}

/* Walks a container's children in order: for (vk_pt_iter_t it = vk_pt_iter(t, id); vk_pt_next(&it, &kid);) */
typedef struct vk_pt_iter {
    const vk_ptree_t *t;
    uint32_t seg;
    uint32_t at;
} vk_pt_iter_t;

vk_pt_iter_t vk_pt_iter(const vk_ptree_t *t, uint32_t container);
int vk_pt_next(vk_pt_iter_t *it, uint32_t *kid);

/* The value of key `key` (a STR key) in dict node `dict`, or UINT32_MAX. The last binding wins,
 * as in a dict built by SETITEM after SETITEM. */
uint32_t vk_pt_get(const vk_ptree_t *t, uint32_t dict, const char *key);
/* A string node equal to `s`. */
int vk_pt_str_is(const vk_ptree_t *t, uint32_t node, const char *s);

#endif
