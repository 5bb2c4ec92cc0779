/* test_expandable.c — expandable segments in C, on simulated pools: the layout rules that the
 * randomized tests cannot pin down (which addresses, which pages), and the block-struct
 * bookkeeping of the slow path, which needs the pool's internals to set up. */
#include <stdint.h>

#include "harness.h"
#include "../../csrc/alloc/internal.h"

#define MiB ((uint64_t)1 << 20)
#define PAGE (20 * MiB)

static vram_pool_t *expandable_pool(uint64_t capacity) {
    return make_sim_pool(capacity, "expandable_segments:True");
}

/* Freed space at the end of the mapped part grows into a larger request: same address, one
 * more page mapped, reserved bytes = pages. */
static void test_free_tail_grows_into_a_larger_request(void) {
    vram_pool_t *pool = expandable_pool(8192 * MiB);
    void *a = NULL, *b = NULL;
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &a));
    CHECK(get_stats(pool).reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(2 * PAGE));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 50 * MiB, 0, 0, &b));
    CHECK(a == b);
    vram_stats_t s = get_stats(pool);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(3 * PAGE));
    CHECK(s.num_device_alloc == 2 && s.segment[VRAM_STAT_ALL].current == 0);
    CHECK(s.inactive_split[VRAM_STAT_ALL].current == 0);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, b, 0));
    uint64_t released = 0;
    CHECK_OK(vram_empty_cache(pool, &released));
    CHECK(released == 3 * PAGE && get_stats(pool).reserved_bytes[VRAM_STAT_ALL].current == 0);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

/* A map and the split after it take block structs on top of those malloc set aside: with the
 * spares drained to what malloc reserves, a request that reserves a new range, maps a page
 * of it and splits the page must still find the structs it needs (this once read a NULL). */
static void test_slow_path_keeps_malloc_spares(void) {
    vram_pool_t *pool = expandable_pool(8192 * MiB);
    void *big = NULL, *small = NULL;
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &big));
    while (pool->num_spare > 2) (void)vram__block_new(pool); /* the slab still owns them */
    CHECK_OK(vram_malloc(pool, 1000, 0, 0, &small)); /* new small-pool range, one page, split */
    CHECK(small != NULL);
    CHECK_POOL(pool);
    /* And on the OOM ladder: unmapping takes structs too. */
    CHECK_OK(vram_free(pool, big, 0));
    while (pool->num_spare > 2) (void)vram__block_new(pool);
    void *huge = NULL;
    CHECK_OK(vram_malloc(pool, 8000 * MiB, 0, 0, &huge));
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, huge, 0));
    CHECK_OK(vram_free(pool, small, 0));
    vram_pool_destroy(pool);
}

/* empty_cache unmaps the whole pages inside free blocks, leaving a hole between mapped runs;
 * the snapshot reports each run as a segment. */
static void test_empty_cache_leaves_holes_and_snapshot_runs(void) {
    vram_pool_t *pool = expandable_pool(8192 * MiB);
    void *p[3];
    for (int i = 0; i < 3; i++) CHECK_OK(vram_malloc(pool, PAGE, 0, 0, &p[i]));
    CHECK((uintptr_t)p[1] == (uintptr_t)p[0] + PAGE && (uintptr_t)p[2] == (uintptr_t)p[1] + PAGE);
    CHECK_OK(vram_free(pool, p[1], 0));
    CHECK_OK(vram_empty_cache(pool, NULL));
    CHECK(get_stats(pool).reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(2 * PAGE));
    vram_snapshot_t *snap = NULL;
    CHECK_OK(vram_pool_snapshot(pool, &snap));
    CHECK(snap && snap->num_segments == 2 && snap->num_blocks == 2);
    if (snap && snap->num_segments == 2) {
        CHECK(snap->segments[0].address == (uintptr_t)p[0] && snap->segments[0].total_size == PAGE);
        CHECK(snap->segments[1].address == (uintptr_t)p[2] && snap->segments[1].is_expandable == 1);
    }
    vram_snapshot_free(snap);
    /* The hole is mapped again for a request that fits it. */
    void *q = NULL;
    CHECK_OK(vram_malloc(pool, PAGE, 0, 0, &q));
    CHECK(q == p[1]);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, q, 0));
    CHECK_OK(vram_free(pool, p[0], 0));
    CHECK_OK(vram_free(pool, p[2], 0));
    vram_pool_destroy(pool);
}

/* Switching the option: refused while a block is in use (nothing changes), done otherwise. */
static void test_switching_needs_an_idle_pool(void) {
    vram_pool_t *pool = make_sim_pool(1024 * MiB, NULL);
    void *p = NULL;
    CHECK_OK(vram_malloc(pool, MiB, 0, 0, &p));
    CHECK_STATUS(vram_configure(pool, "expandable_segments:True"), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "expandable_segments can be changed only while no memory is in use");
    vram_settings_t s;
    CHECK_OK(vram_get_settings(pool, &s));
    CHECK(s.expandable_segments == 0);
    CHECK_OK(vram_free(pool, p, 0));
    CHECK_OK(vram_configure(pool, "expandable_segments:True"));
    CHECK(get_stats(pool).reserved_bytes[VRAM_STAT_ALL].current == 0);
    CHECK_OK(vram_malloc(pool, MiB, 0, 0, &p));
    CHECK(pool->segments && pool->segments->expandable);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, p, 0));
    vram_pool_destroy(pool);
}

int main(void) {
    RUN(test_free_tail_grows_into_a_larger_request);
    RUN(test_slow_path_keeps_malloc_spares);
    RUN(test_empty_cache_leaves_holes_and_snapshot_runs);
    RUN(test_switching_needs_an_idle_pool);
    return harness_finish();
}
