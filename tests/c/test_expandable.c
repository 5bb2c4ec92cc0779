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

/* Requests no release could serve are OOM errors, before any address space is reserved for
 * them (a range sized to 2^59 bytes would exhaust the simulated addresses). */
static void test_impossible_requests_are_oom(void) {
    vram_pool_t *pool = expandable_pool(8192 * MiB);
    void *p = NULL;
    CHECK_STATUS(vram_malloc(pool, (uint64_t)1 << 59, 0, 0, &p), VRAM_ERR_OOM);
    CHECK_STATUS(vram_malloc(pool, (uint64_t)4 << 50, 0, 0, &p), VRAM_ERR_OOM);
    CHECK_STATUS(vram_malloc(pool, 8193 * MiB, 0, 0, &p), VRAM_ERR_OOM);
    CHECK(pool->segments == NULL); /* nothing reserved for them */
    CHECK_OK(vram_malloc(pool, 8000 * MiB, 0, 0, &p));
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, p, 0));
    vram_pool_destroy(pool);
}

/* empty_cache releases the empty range and the next malloc reserves one: the device reuses its
 * own released ranges, so the loop never runs out of simulated addresses (it did after
 * ~90,000 turns on an 80 GiB device). */
static void test_empty_cache_churn_reuses_ranges(void) {
    vram_pool_t *pool = expandable_pool((uint64_t)80 << 30);
    int failures = 0;
    for (int i = 0; i < 120000 && !failures; i++) {
        void *p = NULL;
        failures += vram_malloc(pool, MiB, 0, 0, &p) != VRAM_OK;
        failures += vram_free(pool, p, 0) != VRAM_OK;
        failures += vram_empty_cache(pool, NULL) != VRAM_OK;
    }
    CHECK(failures == 0);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

/* A host that reports 1 GiB available: mapped pages nobody has written yet are not in the
 * kernel's figure, so the check counts them, as it counts untouched classic segments. */
static vram_status_t one_gib_host(void *ctx, vram_host_memory_t *out) {
    (void)ctx;
    memset(out, 0, sizeof *out);
    out->total = out->ram_total = out->available = out->mem_available = 1024 * MiB;
    out->cgroup_limit = UINT64_MAX;
    return VRAM_OK;
}

static void test_host_check_counts_untouched_pages(void) {
    static vram_backend_t backend;
    backend = *vram_backend_cpu();
    backend.host_memory = one_gib_host;
    const char *confs[] = {"host_reserve_mb:0", "host_reserve_mb:0,expandable_segments:True"};
    for (int e = 0; e < 2; e++) {
        void *ctx = NULL, *a = NULL, *b = NULL;
        vram_pool_t *pool = NULL;
        CHECK_OK(vram_backend_cpu_ctx(&ctx));
        CHECK_OK(vram_pool_create(&backend, ctx, (vram_device_t){VRAM_DEVICE_CPU, 0, 0}, confs[e], &pool));
        CHECK_OK(vram_malloc(pool, 600 * MiB, 0, 0, &a)); /* untouched, like np.empty */
        CHECK_STATUS(vram_malloc(pool, 600 * MiB, 0, 0, &b), VRAM_ERR_OOM);
        CHECK_CONTAINS(vram_last_error(), "did not map 600.00 MiB because the host cannot give it");
        CHECK_POOL(pool);
        CHECK_OK(vram_free(pool, a, 0));
        vram_pool_destroy(pool);
    }
}

/* vram_calloc leaves pages it has just mapped alone (they are zero), so a large calloc costs
 * no memory until it is written; a block from the cache is zeroed. */
static void test_calloc_skips_fresh_pages(void) {
    void *ctx = NULL, *p = NULL;
    vram_pool_t *pool = NULL;
    CHECK_OK(vram_backend_cpu_ctx(&ctx));
    CHECK_OK(vram_pool_create(vram_backend_cpu(), ctx, (vram_device_t){VRAM_DEVICE_CPU, 0, 0},
                              "expandable_segments:True,host_page_release_mb:None", &pool));
    CHECK_OK(vram_calloc(pool, 256 * MiB, 0, 0, &p));
    uint64_t resident = UINT64_MAX;
    CHECK_OK(vram_backend_cpu()->resident_bytes(ctx, (uintptr_t)p, 256 * MiB, &resident));
    CHECK(resident < 8 * MiB);
    memset(p, 0x5A, 256 * MiB);
    CHECK_OK(vram_free(pool, p, 0));
    void *q = NULL;
    CHECK_OK(vram_calloc(pool, 200 * MiB, 0, 0, &q)); /* the cached, written block */
    CHECK(q == p);
    const unsigned char *bytes = q;
    int nonzero = 0;
    for (uint64_t i = 0; i < 200 * MiB; i += 4093) nonzero += bytes[i] != 0;
    CHECK(nonzero == 0 && bytes[200 * MiB - 1] == 0);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, q, 0));
    vram_pool_destroy(pool);
}

int main(void) {
    RUN(test_free_tail_grows_into_a_larger_request);
    RUN(test_slow_path_keeps_malloc_spares);
    RUN(test_empty_cache_leaves_holes_and_snapshot_runs);
    RUN(test_switching_needs_an_idle_pool);
    RUN(test_impossible_requests_are_oom);
    RUN(test_empty_cache_churn_reuses_ranges);
    RUN(test_host_check_counts_untouched_pages);
    RUN(test_calloc_skips_fresh_pages);
    return harness_finish();
}
