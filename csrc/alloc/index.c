/* index.c — the free-block index: a treap keyed by (stream, size, address).
 *
 * Why a treap: it gives PyTorch's exact best-fit order (std::set by stream, size, pointer)
 * in expected O(log n) with about a hundred lines, intrusive links (no node allocation on
 * the hot path) and no rebalancing cases to get wrong. Priorities come from a per-index
 * xorshift generator, so the shape is deterministic for a given operation sequence. */
#include "internal.h"

#include "../util/error.h"

/* key(block) < (stream, size, addr) */
static int key_less(const vram__block_t *b, vram_stream_t stream, uint64_t size, uintptr_t addr) {
    if (b->stream != stream) return b->stream < stream;
    if (b->size != size) return b->size < size;
    return b->addr < addr;
}

static int block_less(const vram__block_t *a, const vram__block_t *b) {
    return key_less(a, b->stream, b->size, b->addr);
}

static uint32_t next_priority(vram__free_index_t *index) {
    uint32_t x = index->rng ? index->rng : 0x9E3779B9u;
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    index->rng = x;
    return x;
}

/* Split `t` into keys < pivot (*lo) and keys >= pivot (*hi). */
static void split(vram__block_t *t, const vram__block_t *pivot, vram__block_t **lo, vram__block_t **hi) {
    while (t) {
        if (block_less(t, pivot)) {
            *lo = t;
            lo = &t->right;
            t = t->right;
        } else {
            *hi = t;
            hi = &t->left;
            t = t->left;
        }
    }
    *lo = NULL;
    *hi = NULL;
}

/* Join two treaps where every key of `a` is below every key of `b`. */
static vram__block_t *merge(vram__block_t *a, vram__block_t *b) {
    vram__block_t *root = NULL, **link = &root;
    while (a && b) {
        if (a->priority > b->priority) {
            *link = a;
            link = &a->right;
            a = a->right;
        } else {
            *link = b;
            link = &b->left;
            b = b->left;
        }
    }
    *link = a ? a : b;
    return root;
}

void vram__index_insert(vram__free_index_t *index, vram__block_t *block) {
    block->priority = next_priority(index);
    vram__block_t **link = &index->root;
    while (*link && (*link)->priority >= block->priority)
        link = block_less(block, *link) ? &(*link)->left : &(*link)->right;
    split(*link, block, &block->left, &block->right);
    *link = block;
    block->in_index = 1;
    block->gc_count_base = index->lookups;
    index->count++;
}

void vram__index_remove(vram__free_index_t *index, vram__block_t *block) {
    vram__block_t **link = &index->root;
    while (*link != block) link = block_less(block, *link) ? &(*link)->left : &(*link)->right;
    *link = merge(block->left, block->right);
    block->left = block->right = NULL;
    block->in_index = 0;
    index->count--;
}

/* Where `block` hangs (the pointer to it) and its in-order neighbours (NULL at the ends). */
static vram__block_t **locate(vram__free_index_t *index, const vram__block_t *block, vram__block_t **pred,
                              vram__block_t **succ) {
    vram__block_t **link = &index->root;
    *pred = *succ = NULL;
    while (*link != block) {
        if (block_less(block, *link)) {
            *succ = *link;
            link = &(*link)->left;
        } else {
            *pred = *link;
            link = &(*link)->right;
        }
    }
    if (block->left)
        for (*pred = block->left; (*pred)->right;) *pred = (*pred)->right;
    if (block->right)
        for (*succ = block->right; (*succ)->left;) *succ = (*succ)->left;
    return link;
}

void vram__index_replace(vram__free_index_t *index, vram__block_t *old, vram__block_t *fresh) {
    vram__block_t *pred, *succ;
    vram__block_t **link = locate(index, old, &pred, &succ);
    if ((!pred || block_less(pred, fresh)) && (!succ || block_less(fresh, succ))) {
        /* Same place in key order: take over the node, links and priority included. */
        fresh->left = old->left;
        fresh->right = old->right;
        fresh->priority = old->priority;
        fresh->in_index = 1;
        fresh->gc_count_base = index->lookups;
        *link = fresh;
    } else {
        *link = merge(old->left, old->right);
        index->count--;
        vram__index_insert(index, fresh);
    }
    old->left = old->right = NULL;
    old->in_index = 0;
}

vram__block_t *vram__index_lower_bound(const vram__free_index_t *index, vram_stream_t stream, uint64_t size) {
    vram__block_t *best = NULL;
    for (vram__block_t *t = index->root; t;) {
        if (key_less(t, stream, size, 0)) {
            t = t->right;
        } else {
            best = t;
            t = t->left;
        }
    }
    return best;
}

vram__block_t *vram__index_before(const vram__free_index_t *index, vram_stream_t stream, uint64_t size,
                                  uintptr_t addr) {
    vram__block_t *best = NULL;
    for (vram__block_t *t = index->root; t;) {
        if (key_less(t, stream, size, addr)) {
            best = t;
            t = t->right;
        } else {
            t = t->left;
        }
    }
    return best;
}

vram__block_t *vram__index_after(const vram__free_index_t *index, const vram__block_t *block) {
    vram__block_t *best = NULL;
    for (vram__block_t *t = index->root; t;) {
        if (block_less(block, t)) {
            best = t;
            t = t->left;
        } else {
            t = t->right;
        }
    }
    return best;
}

/* Recursive walk with key bounds; depth is O(log n) expected, and this is the checker. */
static vram_status_t check_subtree(const vram__block_t *t, const vram__block_t *lo, const vram__block_t *hi,
                                   uint64_t *count, int is_small) {
    if (!t) return VRAM_OK;
    if (!t->in_index || t->allocated || t->event_count != 0)
        return vram__fail(VRAM_ERR_CORRUPT, "free index holds block 0x%llx that is not free",
                          (unsigned long long)t->addr);
    if (!t->segment || t->segment->is_small != is_small)
        return vram__fail(VRAM_ERR_CORRUPT, "block 0x%llx is in the %s pool's index but its segment is not",
                          (unsigned long long)t->addr, is_small ? "small" : "large");
    if ((lo && !block_less(lo, t)) || (hi && !block_less(t, hi)))
        return vram__fail(VRAM_ERR_CORRUPT, "free index out of order at block 0x%llx",
                          (unsigned long long)t->addr);
    if ((t->left && t->left->priority > t->priority) || (t->right && t->right->priority > t->priority))
        return vram__fail(VRAM_ERR_CORRUPT, "free index heap order broken at block 0x%llx",
                          (unsigned long long)t->addr);
    (*count)++;
    vram_status_t status = check_subtree(t->left, lo, t, count, is_small);
    if (status != VRAM_OK) return status;
    return check_subtree(t->right, t, hi, count, is_small);
}

vram_status_t vram__index_check(const vram__free_index_t *index, uint64_t *count) {
    *count = 0;
    vram_status_t status = check_subtree(index->root, NULL, NULL, count, index->is_small);
    if (status != VRAM_OK) return status;
    if (*count != index->count)
        return vram__fail(VRAM_ERR_CORRUPT, "free index counts %llu blocks but holds %llu",
                          (unsigned long long)index->count, (unsigned long long)*count);
    return VRAM_OK;
}
