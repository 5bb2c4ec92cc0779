/* ptrmap.h — a hash map from a live allocation's address to its block, for O(1) free(). */
#ifndef VRAM_UTIL_PTRMAP_H
#define VRAM_UTIL_PTRMAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct vram__ptrmap_slot {
    uintptr_t key; /* 0 marks an empty slot: no allocation lives at address 0 */
    void *value;
} vram__ptrmap_slot_t;

typedef struct vram__ptrmap {
    vram__ptrmap_slot_t *slots;
    size_t capacity; /* a power of two, or 0 before the first insert */
    size_t count;
    unsigned shift;  /* 64 - log2(capacity), for multiplicative hashing */
} vram__ptrmap_t;

void vram__ptrmap_init(vram__ptrmap_t *map);
void vram__ptrmap_destroy(vram__ptrmap_t *map);
/* Make room for `count` keys without growing again: 0, or -1 if host memory ran out. */
int vram__ptrmap_reserve(vram__ptrmap_t *map, size_t count);
/* Insert after vram__ptrmap_reserve made room: cannot fail. */
void vram__ptrmap_insert_reserved(vram__ptrmap_t *map, uintptr_t key, void *value);
void *vram__ptrmap_get(const vram__ptrmap_t *map, uintptr_t key);
/* Removes and returns the value, or NULL if the key is absent. */
void *vram__ptrmap_remove(vram__ptrmap_t *map, uintptr_t key);

#endif
