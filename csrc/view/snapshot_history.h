/* snapshot_history.h — one device's memory history from a snapshot pickle's tree, in columns.
 *
 * The same reading as vramkit.trace's from_torch_snapshot (python/vramkit/trace/formats/
 * snapshot_import.py documents it): an `alloc` entry starts an allocation, its `free_completed`
 * ends it, `free_requested` alone does not; addresses first seen freed, and active blocks of the
 * final segments that no entry names, are allocations alive before the first entry (in address
 * order, ahead of it); entries that contradict each other are refused with the same messages.
 * What the viewer needs besides: each entry's time, the stack of each allocation (interned:
 * strings, frames and stacks each stored once), segment changes, out-of-memory points and the
 * final segments. Nothing here is a Python object: 10 million events are ~40 bytes each. */
#ifndef VRAM_VIEW_SNAPSHOT_HISTORY_H
#define VRAM_VIEW_SNAPSHOT_HISTORY_H

#include <stddef.h>
#include <stdint.h>

#include "vramkit.h"

typedef struct vk_vec {
    void *p;
    uint64_t n, cap;
} vk_vec_t;

/* The columns, in the order of vk_history_column_names; every column of a group has the same length. */
enum {
    /* memory events, in order: an allocation's start or end */
    VK_H_EV_KIND,   /* uint8: 0 alloc, 1 free */
    VK_H_EV_ID,     /* uint32: the allocation */
    VK_H_EV_TIME,   /* int64: the entry's time_us, INT64_MIN when it has none */
    /* allocations, by id */
    VK_H_A_SIZE,    /* uint64: the entry's size (requested bytes; block bytes in vramkit's snapshots) */
    VK_H_A_ADDR,    /* uint64 */
    VK_H_A_STREAM,  /* uint64 */
    VK_H_A_STACK,   /* int32: -1 without frames */
    /* stacks: the frames of stack s are STACK_FRAMES[STACK_START[s] : STACK_START[s + 1]] */
    VK_H_STACK_START,  /* uint64, one more than there are stacks */
    VK_H_STACK_FRAMES, /* uint32: frame ids, innermost first as the snapshot lists them */
    /* frames */
    VK_H_F_FILE,    /* uint32: string id */
    VK_H_F_NAME,    /* uint32: string id */
    VK_H_F_LINE,    /* int64 */
    /* strings: string s is STR_DATA[STR_START[s] : STR_START[s + 1]] (UTF-8 as the pickle has it) */
    VK_H_STR_START, /* uint64, one more than there are strings */
    VK_H_STR_DATA,  /* uint8 */
    /* segment changes (segment_alloc/_free/_map/_unmap with an address), before memory event SE_EVENT */
    VK_H_SE_EVENT,  /* uint64 */
    VK_H_SE_ADDR,   /* uint64 */
    VK_H_SE_SIZE,   /* uint64 */
    VK_H_SE_STREAM, /* uint64 */
    VK_H_SE_SIGN,   /* int8: +1 reserved, -1 released */
    /* out-of-memory entries, before memory event OOM_EVENT */
    VK_H_OOM_EVENT, /* uint64 */
    VK_H_OOM_SIZE,  /* uint64 */
    VK_H_OOM_FREE,  /* int64: device_free, -1 when absent */
    VK_H_OOM_TIME,  /* int64: INT64_MIN when absent */
    /* the final segments of the device */
    VK_H_FS_ADDR,   /* uint64 */
    VK_H_FS_SIZE,   /* uint64 */
    VK_H_FS_STREAM, /* uint64 */
    VK_H_NCOLUMNS
};

typedef struct vk_history {
    vk_vec_t col[VK_H_NCOLUMNS];
    int device;               /* the index into device_traces read */
    int block_sizes;          /* 1 for vramkit's snapshots (a 'vramkit_device' key): sizes are block sizes */
    uint64_t entries;         /* the device's trace entries */
    uint64_t initial_allocations;
    uint64_t unfinished_frees;
} vk_history_t;

extern const char *const vk_history_column_names[VK_H_NCOLUMNS];
extern const char vk_history_column_types[VK_H_NCOLUMNS]; /* NumPy type characters: 'B','I','q','Q','i','b' */

/* Read a snapshot pickle (data[0, len), e.g. a mapped file) into *out. device: an index into
 * device_traces, or -1 to pick the only device with entries. VRAM_ERR_INVALID_ARG with what is
 * wrong (and where) for anything that is not such a snapshot; VRAM_ERR_HOST_MEMORY. */
vram_status_t vk_history_read(const void *data, size_t len, int device, vk_history_t *out);
void vk_history_free(vk_history_t *h);
/* Append one value to a column (converted to the column's type): VRAM_OK or VRAM_ERR_HOST_MEMORY.
 * These three are in history_columns.c. */
size_t vk_history_column_size(int col); /* bytes an item */
vram_status_t vk_history_put(vk_history_t *h, int col, uint64_t value);

#endif
