/* ptrmap.c — open addressing with linear probing and backward-shift deletion.
 *
 * Why not chaining: the map sits on the malloc/free fast path, and one flat array of
 * (key, value) pairs costs one cache miss per lookup. Backward-shift deletion keeps probe
 * sequences short without tombstones, so a long alloc/free loop never degrades. */
#include "ptrmap.h"

#include <stdlib.h>

#define MIN_CAPACITY 64

static size_t slot_of(const vram__ptrmap_t *map, uintptr_t key) {
    /* Addresses are 512-byte aligned, so drop the low bits before the Fibonacci multiply. */
    return (size_t)(((uint64_t)(key >> 9) * 0x9E3779B97F4A7C15ull) >> map->shift);
}

void vram__ptrmap_init(vram__ptrmap_t *map) {
    map->slots = NULL;
    map->capacity = 0;
    map->count = 0;
    map->shift = 64;
}

void vram__ptrmap_destroy(vram__ptrmap_t *map) {
    free(map->slots);
    vram__ptrmap_init(map);
}

static void place(vram__ptrmap_t *map, uintptr_t key, void *value) {
    size_t mask = map->capacity - 1;
    size_t i = slot_of(map, key);
    while (map->slots[i].key != 0) i = (i + 1) & mask;
    map->slots[i].key = key;
    map->slots[i].value = value;
}

static int grow(vram__ptrmap_t *map) {
    size_t capacity = map->capacity ? map->capacity * 2 : MIN_CAPACITY;
    vram__ptrmap_slot_t *slots = calloc(capacity, sizeof *slots);
    if (!slots) return -1;
    vram__ptrmap_slot_t *old = map->slots;
    size_t old_capacity = map->capacity;
    unsigned shift = 64;
    for (size_t c = capacity; c > 1; c >>= 1) shift--;
    map->slots = slots;
    map->capacity = capacity;
    map->shift = shift;
    for (size_t i = 0; i < old_capacity; i++)
        if (old[i].key != 0) place(map, old[i].key, old[i].value);
    free(old);
    return 0;
}

int vram__ptrmap_reserve(vram__ptrmap_t *map, size_t count) {
    /* Keep the load factor at or below 1/2: probe lengths stay near 1.5. */
    while (count * 2 > map->capacity)
        if (grow(map) != 0) return -1;
    return 0;
}

void vram__ptrmap_insert_reserved(vram__ptrmap_t *map, uintptr_t key, void *value) {
    place(map, key, value);
    map->count++;
}

void *vram__ptrmap_get(const vram__ptrmap_t *map, uintptr_t key) {
    if (map->capacity == 0 || key == 0) return NULL;
    size_t mask = map->capacity - 1;
    for (size_t i = slot_of(map, key);; i = (i + 1) & mask) {
        if (map->slots[i].key == key) return map->slots[i].value;
        if (map->slots[i].key == 0) return NULL;
    }
}

void *vram__ptrmap_remove(vram__ptrmap_t *map, uintptr_t key) {
    if (map->capacity == 0 || key == 0) return NULL;
    size_t mask = map->capacity - 1;
    size_t i = slot_of(map, key);
    while (map->slots[i].key != key) {
        if (map->slots[i].key == 0) return NULL;
        i = (i + 1) & mask;
    }
    void *value = map->slots[i].value;
    /* Shift later members of the probe run back over the hole, unless their home slot
     * lies cyclically in (hole, j]: moving those would put them before their home. */
    size_t hole = i;
    for (size_t j = (i + 1) & mask; map->slots[j].key != 0; j = (j + 1) & mask) {
        size_t home = slot_of(map, map->slots[j].key);
        int stays = (hole <= j) ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            map->slots[hole] = map->slots[j];
            hole = j;
        }
    }
    map->slots[hole].key = 0;
    map->slots[hole].value = NULL;
    map->count--;
    return value;
}
