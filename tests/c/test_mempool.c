/* test_mempool.c — private pools (vram_mempool_*): names, routing of a thread's allocations,
 * nested uses and their order, owner lookup, and a simulated device's capacity shared with them. */
#include <pthread.h>
#include <string.h>

#include "harness.h"

static vram_device_t new_sim(uint64_t capacity) {
    vram_device_t d = {VRAM_DEVICE_SIM, -1, 0};
    if (vram_sim_create(capacity, &d) != VRAM_OK) fprintf(stderr, "vram_sim_create: %s\n", vram_last_error());
    return d;
}

static void test_names_round_trip(void) {
    vram_device_t dev = new_sim(64 * MiB), pool, parsed;
    CHECK_OK(vram_mempool_create(dev, &pool));
    CHECK(pool.kind == dev.kind && pool.index == dev.index && pool.mempool > 0);
    char name[64], expected[64];
    vram_device_format(pool, name, sizeof name);
    snprintf(expected, sizeof expected, "sim:%d/mempool:%d", dev.index, pool.mempool);
    CHECK(!strcmp(name, expected));
    CHECK_OK(vram_device_parse(name, &parsed));
    CHECK(parsed.kind == pool.kind && parsed.index == pool.index && parsed.mempool == pool.mempool);
    CHECK_STATUS(vram_device_parse("sim:0/mempool:0", &parsed), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_device_parse("sim:0/mempool:", &parsed), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_mempool_create(pool, &parsed), VRAM_ERR_INVALID_ARG); /* not on a private pool */
    char small[8]; /* truncation reports the full length, as snprintf does */
    CHECK(vram_device_format(pool, small, sizeof small) == (int)strlen(expected));
}

static void test_routing_and_capacity(void) {
    vram_device_t dev = new_sim(100 * MiB), name;
    CHECK_OK(vram_mempool_create(dev, &name));
    vram_pool_t *device_pool, *pool, *target, *owner;
    CHECK_OK(vram_device_pool(dev, &device_pool));
    CHECK_OK(vram_device_pool(name, &pool));
    CHECK(pool != device_pool && vram_mempool_use_count(name) == 0);
    CHECK_OK(vram_alloc_pool(dev, &target));
    CHECK(target == device_pool && vram_mempool_in_use(dev) == NULL);

    CHECK_OK(vram_mempool_use(name));
    CHECK(vram_mempool_use_count(name) == 1);
    CHECK_OK(vram_alloc_pool(dev, &target));
    CHECK(target == pool && vram_mempool_in_use(dev) == pool);
    void *big = NULL, *small = NULL;
    CHECK_OK(vram_malloc(target, 70 * MiB, 0, 0, &big));
    CHECK_OK(vram_mempool_unuse(name));
    CHECK(vram_mempool_use_count(name) == 0);

    /* The device pool now has 30 MiB of the 100 MiB device. */
    CHECK_STATUS(vram_malloc(device_pool, 40 * MiB, 0, 0, &small), VRAM_ERR_OOM);
    uint64_t free_bytes = 0, total = 0;
    CHECK_OK(vram_mem_get_info(device_pool, &free_bytes, &total));
    CHECK(total == 100 * MiB && free_bytes == 30 * MiB);
    CHECK_OK(vram_find_pool(big, &owner));
    CHECK(owner == pool);
    CHECK_OK(vram_free(pool, big, 0));
    uint64_t released = 0;
    CHECK_OK(vram_empty_cache(pool, &released));
    CHECK(released == 70 * MiB);
    CHECK_OK(vram_malloc(device_pool, 40 * MiB, 0, 0, &small));
    CHECK_OK(vram_free(device_pool, small, 0));
    CHECK_OK(vram_empty_cache(device_pool, &released));
    CHECK_POOL(pool);
    CHECK_POOL(device_pool);
}

static void test_nesting_rules(void) {
    vram_device_t dev = new_sim(64 * MiB), a, b;
    CHECK_OK(vram_mempool_create(dev, &a));
    CHECK_OK(vram_mempool_create(dev, &b));
    vram_pool_t *pa, *pb;
    CHECK_OK(vram_device_pool(a, &pa));
    CHECK_OK(vram_device_pool(b, &pb));
    CHECK_OK(vram_mempool_use(a));
    CHECK_OK(vram_mempool_use(b));
    CHECK(vram_mempool_in_use(dev) == pb);
    CHECK_STATUS(vram_mempool_unuse(a), VRAM_ERR_INVALID_ARG); /* not the innermost: refused, nothing changes */
    CHECK(vram_mempool_in_use(dev) == pb && vram_mempool_use_count(a) == 1);
    CHECK_OK(vram_mempool_unuse(b));
    CHECK(vram_mempool_in_use(dev) == pa);
    CHECK_OK(vram_mempool_unuse(a));
    CHECK_STATUS(vram_mempool_unuse(a), VRAM_ERR_INVALID_ARG); /* nothing in use */
    vram_device_t missing = a;
    missing.mempool = 1000000;
    CHECK_STATUS(vram_mempool_use(missing), VRAM_ERR_INVALID_ARG);
    CHECK(vram_mempool_use_count(missing) == -1);
}

static vram_device_t shared_dev;
static vram_pool_t *seen_by_thread;

static void *other_thread(void *arg) {
    (void)arg;
    if (vram_alloc_pool(shared_dev, &seen_by_thread) != VRAM_OK) seen_by_thread = NULL;
    return NULL;
}

static void test_uses_are_per_thread(void) {
    shared_dev = new_sim(64 * MiB);
    vram_device_t name;
    CHECK_OK(vram_mempool_create(shared_dev, &name));
    vram_pool_t *device_pool;
    CHECK_OK(vram_device_pool(shared_dev, &device_pool));
    CHECK_OK(vram_mempool_use(name));
    pthread_t t;
    CHECK(pthread_create(&t, NULL, other_thread, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    CHECK(seen_by_thread == device_pool);
    CHECK_OK(vram_mempool_unuse(name));
}

int main(void) {
    RUN(test_names_round_trip);
    RUN(test_routing_and_capacity);
    RUN(test_nesting_rules);
    RUN(test_uses_are_per_thread);
    return harness_finish();
}
