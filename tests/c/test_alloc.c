/* test_alloc.c — malloc/free on a simulated pool: rounding, pools, segment sizes, splitting,
 * merging, stream separation, counters and invalid pointers. Expected figures come from
 * PyTorch's documented policy, not from the code under test. */
#include <stdint.h>
#include <stdlib.h>

#include "harness.h"

static void test_zero_and_absurd_sizes(void) {
    vram_pool_t *pool = make_sim_pool(8 * GiB, NULL);
    void *p = (void *)1;
    CHECK_OK(vram_malloc(pool, 0, 0, 0, &p));
    CHECK(p == NULL);
    vram_stats_t s = get_stats(pool);
    CHECK(s.allocation[VRAM_STAT_ALL].allocated == 0);
    CHECK_STATUS(vram_malloc(pool, (uint64_t)1 << 62, 0, 0, &p), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "2**62");
    CHECK_STATUS(vram_malloc(pool, UINT64_MAX, 0, 0, &p), VRAM_ERR_INVALID_ARG);
    CHECK_OK(vram_free(pool, NULL, 0));
    s = get_stats(pool);
    CHECK(s.segment[VRAM_STAT_ALL].current == 0 && s.num_ooms == 0);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_rounding_and_pools(void) {
    vram_pool_t *pool = make_sim_pool(8 * GiB, NULL);
    struct {
        uint64_t request, block, segment;
        int small;
    } cases[] = {
        {1, 512, 2 * MiB, 1},                        /* below 512 rounds up to 512 */
        {512, 512, 2 * MiB, 1},
        {513, 1024, 2 * MiB, 1},
        {MiB, MiB, 2 * MiB, 1},                      /* exactly 1 MiB is still small */
        {MiB + 1, MiB + 512, 20 * MiB, 0},           /* above 1 MiB: large pool, 20 MiB segment */
        {10 * MiB - 512, 10 * MiB - 512, 20 * MiB, 0},
        {10 * MiB, 10 * MiB, 10 * MiB, 0},           /* from 10 MiB: segment rounded to 2 MiB */
        {10 * MiB + 1, 10 * MiB + 512, 12 * MiB, 0},
        {64 * MiB + 3, 64 * MiB + 512, 66 * MiB, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        void *p = NULL;
        CHECK_OK(vram_malloc(pool, cases[i].request, 0, 0, &p));
        vram_block_info_t info;
        CHECK_OK(vram_block_query(pool, p, &info));
        CHECK(info.size == cases[i].block);
        CHECK(info.requested_size == cases[i].request);
        CHECK(info.segment_size == cases[i].segment);
        CHECK(info.is_small_pool == cases[i].small);
        CHECK(info.address % 512 == 0);
        CHECK_OK(vram_free(pool, p, 0));
        CHECK_OK(vram_empty_cache(pool, NULL));
        CHECK_POOL(pool);
    }
    vram_pool_destroy(pool);
}

static void test_split_merge_and_reuse(void) {
    vram_pool_t *pool = make_sim_pool(8 * GiB, NULL);
    void *a, *b, *c;
    CHECK_OK(vram_malloc(pool, 1000, 0, 0, &a)); /* 1024 B from one 2 MiB small segment */
    CHECK_OK(vram_malloc(pool, 1000, 0, 0, &b));
    CHECK_OK(vram_malloc(pool, 1000, 0, 0, &c));
    CHECK((uintptr_t)b == (uintptr_t)a + 1024 && (uintptr_t)c == (uintptr_t)b + 1024);
    vram_stats_t s = get_stats(pool);
    CHECK(s.segment[VRAM_STAT_SMALL_POOL].current == 1);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(2 * MiB));
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].current == 3 * 1024);
    CHECK(s.requested_bytes[VRAM_STAT_ALL].current == 3000);
    CHECK(s.inactive_split[VRAM_STAT_ALL].current == 1); /* the tail after c */
    CHECK(s.inactive_split_bytes[VRAM_STAT_ALL].current == (int64_t)(2 * MiB - 3 * 1024));
    CHECK_POOL(pool);

    CHECK_OK(vram_free(pool, b, 0)); /* a hole between two live blocks */
    s = get_stats(pool);
    CHECK(s.inactive_split[VRAM_STAT_ALL].current == 2);
    CHECK(s.active[VRAM_STAT_ALL].current == 2);
    CHECK_POOL(pool);

    void *d;
    CHECK_OK(vram_malloc(pool, 700, 0, 0, &d)); /* best fit: the 1 KiB hole, not the tail */
    CHECK(d == b);
    vram_block_info_t info;
    CHECK_OK(vram_block_query(pool, d, &info));
    CHECK(info.size == 1024); /* 512 left over is split off only in the small pool: 1024-1024=0 */
    CHECK_POOL(pool);

    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_free(pool, d, 0));
    CHECK_OK(vram_free(pool, c, 0)); /* everything merges back into one free segment */
    s = get_stats(pool);
    CHECK(s.inactive_split[VRAM_STAT_ALL].current == 0);
    CHECK(s.inactive_split_bytes[VRAM_STAT_ALL].current == 0);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].current == 0 && s.active[VRAM_STAT_ALL].current == 0);
    CHECK(s.segment[VRAM_STAT_ALL].current == 1); /* cached, not released */
    CHECK(s.allocation[VRAM_STAT_ALL].allocated == 4 && s.allocation[VRAM_STAT_ALL].freed == 4);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].peak == 3 * 1024);
    CHECK_POOL(pool);

    void *e;
    CHECK_OK(vram_malloc(pool, 2048, 0, 0, &e)); /* served from cache: no new segment */
    CHECK(e == a);
    s = get_stats(pool);
    CHECK(s.num_device_alloc == 1);
    CHECK_OK(vram_free(pool, e, 0));
    uint64_t released = 0;
    CHECK_OK(vram_empty_cache(pool, &released));
    CHECK(released == 2 * MiB);
    s = get_stats(pool);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == 0 && s.num_device_free == 1);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_large_pool_split_rule(void) {
    vram_pool_t *pool = make_sim_pool(8 * GiB, NULL);
    void *a, *b;
    /* 3 MiB from a 20 MiB segment: the 17 MiB remainder exceeds 1 MiB, so it is split off. */
    CHECK_OK(vram_malloc(pool, 3 * MiB, 0, 0, &a));
    vram_block_info_t info;
    CHECK_OK(vram_block_query(pool, a, &info));
    CHECK(info.size == 3 * MiB && info.segment_size == 20 * MiB);
    /* 18.5 MiB would leave 1.5 MiB of the remaining 17 MiB... it does not fit: new segment. */
    CHECK_OK(vram_malloc(pool, 16 * MiB + 512 * 1024, 0, 0, &b));
    CHECK_OK(vram_block_query(pool, b, &info));
    /* 16.5 MiB fits in the 17 MiB free tail; 0.5 MiB left is not > 1 MiB: no split. */
    CHECK(info.size == 17 * MiB);
    CHECK(info.requested_size == 16 * MiB + 512 * 1024);
    vram_stats_t s = get_stats(pool);
    CHECK(s.segment[VRAM_STAT_LARGE_POOL].current == 1);
    CHECK(s.allocated_bytes[VRAM_STAT_LARGE_POOL].current == (int64_t)(20 * MiB));
    CHECK(s.requested_bytes[VRAM_STAT_LARGE_POOL].current == (int64_t)(19 * MiB + 512 * 1024));
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_streams_do_not_share_blocks(void) {
    vram_pool_t *pool = make_sim_pool(8 * GiB, NULL);
    void *a, *b;
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &a));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 4096, 2, 0, &b)); /* stream 1's cached segment is not used */
    vram_block_info_t info;
    CHECK_OK(vram_block_query(pool, b, &info));
    CHECK(info.stream == 2);
    CHECK(info.segment_address != (uintptr_t)a - ((uintptr_t)a % (2 * MiB)) || (uintptr_t)b != (uintptr_t)a);
    vram_stats_t s = get_stats(pool);
    CHECK(s.segment[VRAM_STAT_ALL].current == 2);
    void *c;
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &c)); /* stream 1 reuses its own */
    CHECK(c == a);
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_invalid_pointers_change_nothing(void) {
    vram_pool_t *pool = make_sim_pool(8 * GiB, NULL);
    void *a;
    CHECK_OK(vram_malloc(pool, 5000, 0, 0, &a));
    vram_stats_t before = get_stats(pool);
    CHECK_STATUS(vram_free(pool, (char *)a + 512, 0), VRAM_ERR_INVALID_ARG); /* inside, not the start */
    CHECK_CONTAINS(vram_last_error(), "not a live allocation");
    CHECK_STATUS(vram_free(pool, (void *)0x1234, 0), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_record_stream(pool, (void *)0x1234, 3), VRAM_ERR_INVALID_ARG);
    vram_block_info_t info;
    CHECK_STATUS(vram_block_query(pool, (void *)0x1234, &info), VRAM_ERR_INVALID_ARG);
    vram_stats_t after = get_stats(pool);
    CHECK(memcmp(&before, &after, sizeof before) == 0);
    CHECK_OK(vram_free(pool, a, 0));
    vram_stats_t freed = get_stats(pool);
    CHECK_STATUS(vram_free(pool, a, 0), VRAM_ERR_INVALID_ARG); /* double free */
    vram_stats_t again = get_stats(pool);
    CHECK(memcmp(&freed, &again, sizeof freed) == 0);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_reset_peak_and_accumulated(void) {
    vram_pool_t *pool = make_sim_pool(8 * GiB, NULL);
    void *a, *b;
    CHECK_OK(vram_malloc(pool, 4 * MiB, 0, 0, &a));
    CHECK_OK(vram_malloc(pool, 4 * MiB, 0, 0, &b));
    CHECK_OK(vram_free(pool, b, 0));
    vram_stats_t s = get_stats(pool);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].peak == (int64_t)(8 * MiB));
    vram_reset_peak(pool);
    s = get_stats(pool);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].peak == (int64_t)(4 * MiB));
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].allocated == (int64_t)(8 * MiB)); /* untouched */
    vram_reset_accumulated(pool);
    s = get_stats(pool);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].allocated == 0 && s.allocated_bytes[VRAM_STAT_ALL].freed == 0);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].current == (int64_t)(4 * MiB));
    CHECK(s.num_device_alloc == 0);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, a, 0));
    s = get_stats(pool);
    CHECK(s.allocated_bytes[VRAM_STAT_ALL].freed == (int64_t)(4 * MiB));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

int main(void) {
    RUN(test_zero_and_absurd_sizes);
    RUN(test_rounding_and_pools);
    RUN(test_split_merge_and_reuse);
    RUN(test_large_pool_split_rule);
    RUN(test_streams_do_not_share_blocks);
    RUN(test_invalid_pointers_change_nothing);
    RUN(test_reset_peak_and_accumulated);
    return harness_finish();
}
