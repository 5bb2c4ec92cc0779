/* u64map.c — see u64map.h. Linear probing over a power-of-two table kept at most 3/4 full
 * (removed slots counted), with keys mixed by a 64-bit finalizer so that aligned addresses do
 * not pile into neighbouring slots. */
#include "u64map.h"

#include <stdlib.h>
#include <string.h>

uint64_t vk_hash_u64(uint64_t x) { /* the splitmix64 finalizer: every input bit reaches every output bit */
    x ^= x >> 30;
    x *= UINT64_C(0xbf58476d1ce4e5b9);
    x ^= x >> 27;
    x *= UINT64_C(0x94d049bb133111eb);
    return x ^ (x >> 31);
}

uint64_t vk_hash_bytes(const void *data, size_t len, uint64_t seed) {
    const uint8_t *p = data;
    uint64_t h = vk_hash_u64(seed ^ len);
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        h = vk_hash_u64(h ^ w);
        p += 8;
        len -= 8;
    }
    uint64_t tail = 0;
    memcpy(&tail, p, len);
    return vk_hash_u64(h ^ tail ^ ((uint64_t)len << 56));
}

void vk_u64map_free(vk_u64map_t *m) {
    free(m->keys);
    free(m->values);
    free(m->used);
    memset(m, 0, sizeof *m);
}

int64_t vk_u64map_find(const vk_u64map_t *m, uint64_t key) {
    if (!m->capacity) return -1;
    uint64_t mask = m->capacity - 1;
    for (uint64_t i = vk_hash_u64(key) & mask;; i = (i + 1) & mask) {
        if (m->used[i] == 0) return -1;
        if (m->used[i] == 1 && m->keys[i] == key) return (int64_t)i;
    }
}

static int rehash(vk_u64map_t *m, uint64_t capacity) {
    vk_u64map_t n = {0};
    n.keys = malloc(capacity * sizeof *n.keys);
    n.values = malloc(capacity * sizeof *n.values);
    n.used = calloc(capacity, 1);
    if (!n.keys || !n.values || !n.used) {
        vk_u64map_free(&n);
        return -1;
    }
    n.capacity = capacity;
    for (uint64_t i = 0; i < m->capacity; i++) {
        if (m->used[i] != 1) continue;
        uint64_t j = vk_hash_u64(m->keys[i]) & (capacity - 1);
        while (n.used[j]) j = (j + 1) & (capacity - 1);
        n.used[j] = 1;
        n.keys[j] = m->keys[i];
        n.values[j] = m->values[i];
        n.count++;
    }
    vk_u64map_free(m);
    *m = n;
    return 0;
}

int vk_u64map_put(vk_u64map_t *m, uint64_t key, uint64_t value) {
    int64_t at = vk_u64map_find(m, key);
    if (at >= 0) {
        m->values[at] = value;
        return 0;
    }
    if ((m->count + m->removed + 1) * 4 > m->capacity * 3) {
        uint64_t c = m->capacity ? m->capacity : 64;
        while ((m->count + 1) * 2 > c) c *= 2; /* after a rehash the table is at most half full */
        if (rehash(m, c)) return -1;
        m->removed = 0;
    }
    uint64_t mask = m->capacity - 1, i = vk_hash_u64(key) & mask;
    while (m->used[i] == 1) i = (i + 1) & mask;
    if (m->used[i] == 2) m->removed--;
    m->used[i] = 1;
    m->keys[i] = key;
    m->values[i] = value;
    m->count++;
    return 0;
}

int vk_u64map_remove(vk_u64map_t *m, uint64_t key, uint64_t *value) {
    int64_t at = vk_u64map_find(m, key);
    if (at < 0) return 0;
    if (value) *value = m->values[at];
    m->used[at] = 2;
    m->count--;
    m->removed++;
    return 1;
}
