/* test_threads.c — 4 threads × 50,000 alloc/free pairs on one cpu pool. Each thread keeps a
 * few blocks live, stamps them with its id and checks the stamp before freeing, so two threads
 * ever given overlapping memory would see each other's bytes. At the end the counters must be
 * exact: 200,000 allocations, all freed, and the pool's invariants intact. Then 8 threads
 * entering and leaving caching-disabled blocks at once (the process-wide count). */
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

/* caching_allocator_disabled() from many threads at once: 8 threads enter and leave blocks
 * (some nested) 20,000 times, allocating inside them on a shared sim pool. While a thread is
 * inside a block caching must be off, whatever the others do; a free inside a block leaves
 * nothing of its segment cached; after the last exit the count is 0 and caching on again.
 * Under ThreadSanitizer this is also the check that the count and flag are race-free. */
#define SWITCH_THREADS 8
#define SWITCH_ROUNDS 20000

typedef struct switcher {
    vram_pool_t *pool;
    int id;
    long errors;
} switcher_t;

static void *toggle(void *arg) {
    switcher_t *w = arg;
    for (int i = 0; i < SWITCH_ROUNDS; i++) {
        int depth = 1 + (i + w->id) % 2;
        for (int d = 0; d < depth; d++) w->errors += vram_caching_disable_enter() != VRAM_OK;
        w->errors += vram_caching_enabled() != 0 || vram_caching_disabled_blocks() < depth;
        if (i % 64 == 0) {
            void *p = NULL;
            w->errors += vram_malloc(w->pool, 4 * MiB, (vram_stream_t)w->id, 0, &p) != VRAM_OK;
            w->errors += vram_free(w->pool, p, 0) != VRAM_OK;
        }
        for (int d = 0; d < depth; d++) w->errors += vram_caching_disable_exit() != VRAM_OK;
    }
    return NULL;
}

static void test_caching_disabled_blocks_from_eight_threads(void) {
    vram_pool_t *pool = make_sim_pool(GiB, NULL);
    pthread_t threads[SWITCH_THREADS];
    switcher_t workers[SWITCH_THREADS];
    CHECK(vram_caching_enabled() == 1 && vram_caching_disabled_blocks() == 0);
    for (int t = 0; t < SWITCH_THREADS; t++) {
        workers[t] = (switcher_t){pool, t + 1, 0};
        CHECK(pthread_create(&threads[t], NULL, toggle, &workers[t]) == 0);
    }
    for (int t = 0; t < SWITCH_THREADS; t++) {
        pthread_join(threads[t], NULL);
        CHECK(workers[t].errors == 0);
    }
    CHECK(vram_caching_disabled_blocks() == 0 && vram_caching_enabled() == 1);
    /* An exit with no block active is an error and leaves the count at 0. */
    CHECK_STATUS(vram_caching_disable_exit(), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "no caching-disabled block is active");
    CHECK(vram_caching_disabled_blocks() == 0 && vram_caching_enabled() == 1);
    /* The flag is the default the blocks override: off stays off after a block, and on set
     * inside a block applies once the block ends. */
    vram_set_caching_enabled(0);
    CHECK_OK(vram_caching_disable_enter());
    vram_set_caching_enabled(1);
    CHECK(vram_caching_enabled() == 0);
    CHECK_OK(vram_caching_disable_exit());
    CHECK(vram_caching_enabled() == 1);
    /* Every free happened inside a block: nothing may have stayed cached. */
    vram_stats_t s = get_stats(pool);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == 0 && s.num_device_alloc == s.num_device_free);
    CHECK(s.allocation[VRAM_STAT_ALL].allocated == SWITCH_THREADS * ((SWITCH_ROUNDS + 63) / 64));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

int main(void) {
    RUN(test_four_threads_one_pool);
    RUN(test_caching_disabled_blocks_from_eight_threads);
    return harness_finish();
}
