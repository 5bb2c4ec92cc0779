/* stack_intern.h — the stacks of a snapshot's allocations, each string, frame and stack stored
 * once. A snapshot pickled by Python shares one frames list among the entries of a context
 * (the memo makes it one tree node), so a node seen before costs one lookup; lists pickled
 * separately are matched by content. */
#ifndef VRAM_VIEW_STACK_INTERN_H
#define VRAM_VIEW_STACK_INTERN_H

#include "pickle_tree.h"
#include "snapshot_history.h"
#include "u64map.h"

typedef struct vk_stacks {
    const vk_ptree_t *t;
    vk_history_t *h;
    vk_u64map_t stack_by_node, frame_by_node, str_by_node; /* tree node -> id */
    vk_u64map_t stack_by_hash, frame_by_hash, str_by_hash; /* content hash -> id */
    uint32_t *scratch;                                     /* one stack's frame ids */
    uint64_t scratch_cap;
} vk_stacks_t;

void vk_stacks_init(vk_stacks_t *st, const vk_ptree_t *t, vk_history_t *h);
/* The stack id of a frames list node (NONE32/None/empty: -1). Frames that are not dicts are
 * skipped, as the importer skips them; a filename or name that is not a string is refused. */
vram_status_t vk_stacks_of(vk_stacks_t *st, uint32_t frames, int32_t *stack);
/* Close the offset columns (their last entry). */
vram_status_t vk_stacks_finish(vk_stacks_t *st);
void vk_stacks_free(vk_stacks_t *st);

#endif
