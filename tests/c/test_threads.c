/* test_threads.c — 4 threads × 50,000 alloc/free pairs on one cpu pool. Each thread keeps a
 * few blocks live, stamps them with its id and checks the stamp before freeing, so two threads
 * ever given overlapping memory would see each other's bytes. At the end the counters must be
 * exact: 200,000 allocations, all freed, and the pool's invariants intact. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "harness.h"

#define THREADS 4
#define PAIRS 50000
#define KEEP 8

typedef struct worker {
    vram_pool_t *pool;
    int id;
    long errors;
} worker_t;

static void *work(void *arg) {
    worker_t *w = arg;
    uint64_t rng = 0x9E3779B97F4A7C15ull * (uint64_t)(w->id + 1);
    void *held[KEEP] = {0};
    uint64_t sizes[KEEP] = {0};
    for (int i = 0; i < PAIRS + KEEP; i++) {
        int slot = i % KEEP;
        if (held[slot]) {
            const unsigned char *p = held[slot];
            if (p[0] != w->id || p[sizes[slot] - 1] != w->id) w->errors++;
            if (vram_free(w->pool, held[slot], 0) != VRAM_OK) w->errors++;
            held[slot] = NULL;
        }
        if (i >= PAIRS) continue;
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        uint64_t size = 1 + rng % (rng & 1 ? 4096 : 3 * MiB); /* small and large pools */
        /* Streams differ per thread half the time, so per-stream reuse is exercised too. */
        if (vram_malloc(w->pool, size, (rng >> 8) & 1 ? (vram_stream_t)w->id : 0, 0, &held[slot]) != VRAM_OK) {
            w->errors++;
            continue;
        }
        sizes[slot] = size;
        unsigned char *p = held[slot];
        p[0] = p[size - 1] = (unsigned char)w->id;
    }
    return NULL;
}

static void test_four_threads_one_pool(void) {
    void *ctx;
    vram_pool_t *pool = NULL;
    CHECK_OK(vram_backend_cpu_ctx(&ctx));
    CHECK_OK(vram_pool_create(vram_backend_cpu(), ctx, (vram_device_t){VRAM_DEVICE_CPU, 0, 0}, NULL, &pool));
    pthread_t threads[THREADS];
    worker_t workers[THREADS];
    for (int t = 0; t < THREADS; t++) {
        workers[t] = (worker_t){pool, t + 1, 0};
        CHECK(pthread_create(&threads[t], NULL, work, &workers[t]) == 0);
    }
    for (int t = 0; t < THREADS; t++) {
        pthread_join(threads[t], NULL);
        CHECK(workers[t].errors == 0);
    }
    vram_stats_t s = get_stats(pool);
    CHECK(s.allocation[VRAM_STAT_ALL].allocated == THREADS * PAIRS);
    CHECK(s.allocation[VRAM_STAT_ALL].freed == THREADS * PAIRS);
    CHECK(s.allocation[VRAM_STAT_ALL].current == 0);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].current == 0 && s.requested_bytes[VRAM_STAT_ALL].current == 0);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].allocated == s.allocated_bytes[VRAM_STAT_ALL].freed);
    CHECK(s.active[VRAM_STAT_ALL].current == 0 && s.inactive_split[VRAM_STAT_ALL].current == 0);
    CHECK(s.allocation[VRAM_STAT_SMALL_POOL].allocated + s.allocation[VRAM_STAT_LARGE_POOL].allocated ==
          THREADS * PAIRS);
    CHECK_POOL(pool);
    uint64_t released = 0;
    CHECK_OK(vram_empty_cache(pool, &released));
    CHECK(released == (uint64_t)s.reserved_bytes[VRAM_STAT_ALL].current);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

int main(void) {
    RUN(test_four_threads_one_pool);
    return harness_finish();
}
