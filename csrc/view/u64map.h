/* u64map.h — an open-addressing hash map from 64-bit keys to 64-bit values, for the snapshot
 * reader's tables (address -> allocation, tree node -> stack, content hash -> interned id).
 * Unlike util/ptrmap.h every key is allowed (address 0 included: a snapshot is anyone's data). */
#ifndef VRAM_VIEW_U64MAP_H
#define VRAM_VIEW_U64MAP_H

#include <stddef.h>
#include <stdint.h>

typedef struct vk_u64map {
    uint64_t *keys;
    uint64_t *values;
    uint8_t *used;    /* 0 empty, 1 holds a key, 2 removed (probing continues past it) */
    uint64_t capacity; /* a power of two, or 0 */
    uint64_t count, removed;
} vk_u64map_t;

void vk_u64map_free(vk_u64map_t *m);
/* The slot of `key`, or -1. */
int64_t vk_u64map_find(const vk_u64map_t *m, uint64_t key);
/* Set key -> value (replacing): 0, or -1 when host memory ran out (the map is unchanged). */
int vk_u64map_put(vk_u64map_t *m, uint64_t key, uint64_t value);
/* Remove key: 1 if it was there (its value in *value, which may be NULL), else 0. */
int vk_u64map_remove(vk_u64map_t *m, uint64_t key, uint64_t *value);
/* A well-mixed 64-bit hash of bytes, and of a 64-bit value, for content keys. */
uint64_t vk_hash_bytes(const void *data, size_t len, uint64_t seed);
uint64_t vk_hash_u64(uint64_t x);

#endif
