/* test_policy.c — the allocator policy on simulated devices: the OOM path and its message,
 * limits and fractions, max_split_size, garbage collection, power-of-two rounding, and
 * record_stream's deferred reuse. Expected values follow PyTorch's documented rules. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "harness.h"

static void test_oom_message_and_recovery(void) {
    vram_pool_t *pool = make_sim_pool(100 * MiB, NULL);
    void *a, *b;
    CHECK_OK(vram_malloc(pool, 60 * MiB, 0, 0, &a));
    CHECK_STATUS(vram_malloc(pool, 60 * MiB, 0, 0, &b), VRAM_ERR_OOM);
    const char *msg = vram_last_error();
    CHECK_CONTAINS(msg, "sim:99 out of memory. Tried to allocate 60.00 MiB. Device sim:99 has a total capacity of "
                        "100.00 MiB of which 40.00 MiB is free. ");
    CHECK_CONTAINS(msg, "Of the allocated memory 60.00 MiB is allocated by vramkit, and 0 bytes is reserved by vramkit "
                        "but unallocated.");
    vram_oom_info_t info;
    vram_last_oom(&info);
    CHECK(info.requested == 60 * MiB && info.segment_size == 60 * MiB);
    CHECK(info.device_free == 40 * MiB && info.device_total == 100 * MiB);
    CHECK(info.allocated == 60 * MiB && info.reserved == 60 * MiB && info.allowed == UINT64_MAX);
    CHECK(info.device_kind == VRAM_DEVICE_SIM && info.device_index == 99);
    vram_stats_t s = get_stats(pool);
    CHECK(s.num_ooms == 1 && s.num_alloc_retries == 1);
    CHECK(s.allocation[VRAM_STAT_ALL].current == 1);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 60 * MiB, 0, 0, &b)); /* usable again: reuses the cached segment */
    CHECK(b == a);
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

/* The OOM callback: called once per failed request with the figures of vram_last_oom and the
 * message; a request that succeeds after freeing the cache is no OOM; NULL turns it off. */
static int callback_calls;
static vram_oom_info_t callback_info;
static char callback_message[256];
static void on_oom(const vram_oom_info_t *info, const char *message) {
    callback_calls++;
    callback_info = *info;
    snprintf(callback_message, sizeof callback_message, "%s", message);
}

static void test_oom_callback(void) {
    vram_pool_t *pool = make_sim_pool(100 * MiB, NULL);
    void *a, *b;
    callback_calls = 0;
    vram_set_oom_callback(on_oom);
    CHECK_OK(vram_malloc(pool, 60 * MiB, 0, 0, &a));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 70 * MiB, 0, 0, &b)); /* frees the cached 60 MiB first: no OOM */
    CHECK(callback_calls == 0);
    CHECK_STATUS(vram_malloc(pool, 60 * MiB, 0, 0, &a), VRAM_ERR_OOM);
    CHECK(callback_calls == 1);
    CHECK(callback_info.requested == 60 * MiB && callback_info.allocated == 70 * MiB);
    CHECK(callback_info.device_total == 100 * MiB && callback_info.device_free == 30 * MiB);
    CHECK_CONTAINS(callback_message, "out of memory. Tried to allocate 60.00 MiB.");
    vram_set_oom_callback(NULL);
    CHECK_STATUS(vram_malloc(pool, 60 * MiB, 0, 0, &a), VRAM_ERR_OOM);
    CHECK(callback_calls == 1);
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_oom_frees_cache_and_retries(void) {
    vram_pool_t *pool = make_sim_pool(100 * MiB, NULL);
    void *a, *b;
    CHECK_OK(vram_malloc(pool, 60 * MiB, 0, 0, &a));
    CHECK_OK(vram_free(pool, a, 0)); /* 60 MiB cached, too small for 70 MiB */
    CHECK_OK(vram_malloc(pool, 70 * MiB, 0, 0, &b));
    vram_stats_t s = get_stats(pool);
    CHECK(s.num_alloc_retries == 1 && s.num_ooms == 0);
    CHECK(s.num_device_free == 1 && s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(70 * MiB));
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_limits_and_fraction(void) {
    vram_pool_t *pool = make_sim_pool(GiB, NULL);
    void *a, *b;
    CHECK_OK(vram_set_memory_limit(pool, 100 * MiB));
    CHECK_OK(vram_malloc(pool, 60 * MiB, 0, 0, &a));
    CHECK_STATUS(vram_malloc(pool, 60 * MiB, 0, 0, &b), VRAM_ERR_OOM);
    CHECK_CONTAINS(vram_last_error(), "100.00 MiB allowed; Of the allocated memory");
    vram_oom_info_t info;
    vram_last_oom(&info);
    CHECK(info.allowed == 100 * MiB);
    CHECK_OK(vram_set_memory_limit(pool, VRAM_NO_LIMIT));
    CHECK_OK(vram_set_memory_fraction(pool, 0.125)); /* 128 MiB */
    CHECK_STATUS(vram_malloc(pool, 70 * MiB, 0, 0, &b), VRAM_ERR_OOM);
    CHECK_CONTAINS(vram_last_error(), "128.00 MiB allowed;");
    CHECK_OK(vram_set_memory_fraction(pool, 0.5));
    CHECK_OK(vram_malloc(pool, 70 * MiB, 0, 0, &b));
    vram_settings_t st;
    CHECK_OK(vram_get_settings(pool, &st));
    CHECK(st.allowed_bytes == 512 * MiB && st.memory_fraction == 0.5 && st.memory_limit == VRAM_NO_LIMIT);
    CHECK_STATUS(vram_set_memory_fraction(pool, 1.5), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "allowed range is 0 to 1");
    CHECK_STATUS(vram_set_memory_fraction(pool, -0.1), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_set_memory_limit(pool, (uint64_t)1 << 62), VRAM_ERR_INVALID_ARG);
    CHECK_OK(vram_get_settings(pool, &st));
    CHECK(st.allowed_bytes == 512 * MiB); /* unchanged by the rejected calls */
    /* Lowering the cap below what is reserved keeps existing memory but refuses growth. */
    CHECK_OK(vram_set_memory_limit(pool, 10 * MiB));
    void *c;
    CHECK_STATUS(vram_malloc(pool, 30 * MiB, 0, 0, &c), VRAM_ERR_OOM);
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &c)); /* served from the cached 60 MiB segment */
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_max_split_size(void) {
    vram_pool_t *pool = make_sim_pool(64 * MiB, "max_split_size_mb:30");
    vram_stats_t s = get_stats(pool);
    CHECK(s.max_split_size == (int64_t)(30 * MiB));
    void *a, *b, *c;
    CHECK_OK(vram_malloc(pool, 40 * MiB, 0, 0, &a));
    s = get_stats(pool);
    CHECK(s.oversize_allocations.current == 1 && s.oversize_segments.current == 1);
    CHECK_OK(vram_free(pool, a, 0));
    /* 25 MiB is below max_split: it may not take the cached 40 MiB block. The device has no
     * room for a new 26 MiB segment, so the oversize block is released and the call retried. */
    CHECK_OK(vram_malloc(pool, 25 * MiB, 0, 0, &b));
    vram_block_info_t info;
    CHECK_OK(vram_block_query(pool, b, &info));
    CHECK(info.segment_size == 26 * MiB);
    s = get_stats(pool);
    CHECK(s.num_alloc_retries == 0 && s.num_device_free == 1);
    CHECK(s.oversize_segments.current == 0 && s.oversize_segments.peak == 1);
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_OK(vram_empty_cache(pool, NULL));
    /* An oversize request takes a cached oversize block only within 20 MiB. */
    CHECK_OK(vram_malloc(pool, 50 * MiB, 0, 0, &a));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 40 * MiB, 0, 0, &c)); /* 50 < 40 + 20: reused whole, not split */
    CHECK(c == a);
    CHECK_OK(vram_block_query(pool, c, &info));
    CHECK(info.size == 50 * MiB && info.requested_size == 40 * MiB);
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);

    pool = make_sim_pool(GiB, "max_split_size_mb:30");
    CHECK_OK(vram_malloc(pool, 61 * MiB, 0, 0, &a));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 40 * MiB, 0, 0, &c)); /* 61 >= 40 + 20: a new segment instead */
    CHECK(c != a);
    s = get_stats(pool);
    CHECK(s.segment[VRAM_STAT_ALL].current == 2);
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_garbage_collection(void) {
    vram_pool_t *pool = make_sim_pool(100 * MiB, "garbage_collection_threshold:0.5");
    void *a, *b, *c, *d;
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &a));
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &b));
    CHECK_OK(vram_malloc(pool, 20 * MiB, 0, 0, &c));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_OK(vram_free(pool, c, 0));
    /* 80 MiB cached > 50 MiB threshold: before drawing a new segment the allocator frees
     * cached whole segments at least as old as the average, without any OOM or retry. */
    CHECK_OK(vram_malloc(pool, 40 * MiB, 0, 0, &d));
    vram_stats_t s = get_stats(pool);
    CHECK(s.num_device_free == 3);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(40 * MiB));
    CHECK(s.num_alloc_retries == 0 && s.num_ooms == 0);
    CHECK_OK(vram_free(pool, d, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);

    /* Below the threshold nothing is collected. */
    pool = make_sim_pool(100 * MiB, "garbage_collection_threshold:0.9");
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &a));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_malloc(pool, 40 * MiB, 0, 0, &d));
    s = get_stats(pool);
    CHECK(s.num_device_free == 0 && s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(70 * MiB));
    CHECK_OK(vram_free(pool, d, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static uint64_t block_size_for(vram_pool_t *pool, uint64_t request) {
    void *p;
    vram_block_info_t info = {0};
    if (vram_malloc(pool, request, 0, 0, &p) != VRAM_OK) return 0;
    if (vram_block_query(pool, p, &info) != VRAM_OK) info.size = 0;
    if (vram_free(pool, p, 0) != VRAM_OK) return 0;
    return info.size;
}

static void test_roundup_power2_divisions(void) {
    vram_pool_t *pool = make_sim_pool(64 * GiB, "roundup_power2_divisions:4");
    CHECK(block_size_for(pool, 1200) == 1536);                  /* 1200 <= 512*4: plain 512 rounding */
    CHECK(block_size_for(pool, 1258291) == 1310720);            /* 1.2 MiB -> 1.25 MiB (quarters) */
    CHECK(block_size_for(pool, 5 * MiB + 1) == 6 * MiB);        /* quarters of [4, 8) MiB */
    CHECK(block_size_for(pool, 8 * MiB) == 8 * MiB);            /* a power of two stays */
    CHECK_POOL(pool);
    vram_pool_destroy(pool);

    pool = make_sim_pool(64 * GiB, "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
    CHECK(block_size_for(pool, 100 * MiB + 1) == 100 * MiB + 512); /* the first key's 1 fills the intervals below */
    CHECK(block_size_for(pool, 300 * MiB) == 300 * MiB);        /* the 256 MiB interval: 1 division = off */
    CHECK(block_size_for(pool, 600 * MiB) == 768 * MiB);        /* halves of [512, 1024) */
    CHECK(block_size_for(pool, 1100 * MiB) == 1152 * MiB);      /* '>' overwrote 1024's 4 with 8 (PyTorch) */
    CHECK(block_size_for(pool, 2100 * MiB) == 2304 * MiB);      /* eighths of [2048, 4096) */
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_configure_is_all_or_nothing(void) {
    vram_pool_t *pool = make_sim_pool(GiB, NULL);
    vram_settings_t before, after;
    CHECK_OK(vram_get_settings(pool, &before));
    CHECK(before.max_split_size == UINT64_MAX && before.garbage_collection_threshold == 0.0);
    const char *bad[] = {
        "max_split_size_mb:20",              /* must exceed 20 */
        "max_split_size_mb:abc",
        "garbage_collection_threshold:1.0",
        "garbage_collection_threshold:0",
        "roundup_power2_divisions:3",
        "roundup_power2_divisions:[256:3]",
        "roundup_power2_divisions:[300:2]",
        "roundup_power2_divisions:[256:2",
        "per_process_memory_fraction:2",
        "max_split_size_mb:64,no_such_option:1", /* the valid part must not apply either */
        "max_split_size_mb",
        "max_split_size_mb:",
        "expandable_segments:Maybe",
        "expandable_page_mb:3",               /* pages are whole 2 MiB units */
        "expandable_page_mb:0",
        "backend:cudaMallocAsync",
        "max_split_size_mb:64,,",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_STATUS(vram_configure(pool, bad[i]), VRAM_ERR_INVALID_ARG);
        CHECK_CONTAINS(vram_last_error(), "vramkit.configure");
        CHECK_OK(vram_get_settings(pool, &after));
        CHECK(memcmp(&before, &after, sizeof before) == 0);
    }
    CHECK_OK(vram_configure(pool, "no_such_option:1") == VRAM_OK ? VRAM_ERR_CORRUPT : VRAM_OK);
    CHECK_CONTAINS(vram_last_error(), "unrecognized option 'no_such_option'; allowed options: max_split_size_mb");
    CHECK_OK(vram_configure(pool, " max_split_size_mb : 64 , garbage_collection_threshold:0.6,"
                                  "roundup_power2_divisions:[1:2,>:4],memory_limit_mb:512,backend:native,"
                                  "expandable_segments:False"));
    CHECK_OK(vram_get_settings(pool, &after));
    CHECK(after.max_split_size == 64 * MiB);
    CHECK(after.garbage_collection_threshold == 0.6);
    CHECK(after.roundup_power2_divisions[0] == 4 && after.roundup_power2_divisions[15] == 4);
    CHECK(after.memory_limit == 512 * MiB && after.allowed_bytes == 512 * MiB);
    vram_stats_t s = get_stats(pool);
    CHECK(s.max_split_size == (int64_t)(64 * MiB));
    CHECK_OK(vram_configure(pool, "max_split_size_mb:None,memory_limit_mb:none"));
    CHECK_OK(vram_get_settings(pool, &after));
    CHECK(after.max_split_size == UINT64_MAX && after.allowed_bytes == UINT64_MAX);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);

    void *ctx;
    vram_pool_t *none = NULL;
    CHECK_OK(vram_backend_sim_ctx(GiB, &ctx));
    CHECK_STATUS(vram_pool_create(vram_backend_sim(), ctx, (vram_device_t){VRAM_DEVICE_SIM, 1, 0}, "bogus:1", &none),
                 VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "VRAMKIT_ALLOC_CONF: unrecognized option 'bogus'");
    CHECK(none == NULL);
}

static void test_record_stream_defers_reuse(void) {
    vram_pool_t *pool = make_sim_pool(GiB, NULL);
    void *a, *b, *c;
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &a));
    CHECK_OK(vram_record_stream(pool, a, 2));
    CHECK_OK(vram_record_stream(pool, a, 2)); /* recorded once */
    CHECK_OK(vram_record_stream(pool, a, 1)); /* its own stream: nothing to wait for */
    CHECK_OK(vram_free(pool, a, 0));
    vram_stats_t s = get_stats(pool);
    CHECK(s.allocation[VRAM_STAT_ALL].current == 0);   /* freed by the caller... */
    CHECK(s.active[VRAM_STAT_ALL].current == 1);       /* ...but still active */
    CHECK(s.active_bytes[VRAM_STAT_ALL].current == 4096);
    CHECK_POOL(pool);
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &b));
    CHECK(b != a); /* not reused while stream 2 may still read it */
    CHECK_OK(vram_pool_synchronize(pool, 3)); /* another stream: no effect */
    s = get_stats(pool);
    CHECK(s.active[VRAM_STAT_ALL].current == 2);
    CHECK_OK(vram_pool_synchronize(pool, 2));
    s = get_stats(pool);
    CHECK(s.active[VRAM_STAT_ALL].current == 1);
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &c));
    CHECK(c == a);
    CHECK_POOL(pool);

    /* empty_cache waits on outstanding events (num_sync_all_streams) and then releases. */
    CHECK_OK(vram_record_stream(pool, b, 5));
    CHECK_OK(vram_record_stream(pool, b, 6));
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_OK(vram_free(pool, c, 0));
    s = get_stats(pool);
    CHECK(s.active[VRAM_STAT_ALL].current == 1);
    int64_t syncs = s.num_sync_all_streams;
    uint64_t released = 0;
    CHECK_OK(vram_empty_cache(pool, &released));
    s = get_stats(pool);
    CHECK(released == 2 * MiB && s.active[VRAM_STAT_ALL].current == 0);
    CHECK(s.num_sync_all_streams == syncs + 1 && s.reserved_bytes[VRAM_STAT_ALL].current == 0);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

/* A sim backend whose events and stream waits can be made to fail, as a broken CUDA context
 * would: a block used on another stream must then never be handed out again. */
static int break_streams;
static const vram_backend_t *sim_vtable;
static vram_status_t flaky_record(void *ctx, vram_stream_t stream, void **event) {
    return break_streams ? VRAM_ERR_BACKEND : sim_vtable->event_record(ctx, stream, event);
}
static vram_status_t flaky_synchronize(void *ctx, vram_stream_t stream) {
    return break_streams ? VRAM_ERR_BACKEND : sim_vtable->synchronize(ctx, stream);
}

static void test_failed_events_never_release_a_block_early(void) {
    sim_vtable = vram_backend_sim();
    static vram_backend_t flaky;
    flaky = *sim_vtable;
    flaky.event_record = flaky_record;
    flaky.synchronize = flaky_synchronize;
    void *ctx = NULL, *a = NULL, *b = NULL, *c = NULL;
    vram_pool_t *pool = NULL;
    CHECK_OK(vram_backend_sim_ctx(GiB, &ctx));
    CHECK_OK(vram_pool_create(&flaky, ctx, (vram_device_t){VRAM_DEVICE_SIM, 98, 0}, NULL, &pool));
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &a));
    CHECK_OK(vram_record_stream(pool, a, 7));
    break_streams = 1;
    CHECK_OK(vram_free(pool, a, 0)); /* the free happened; its wait is queued instead */
    vram_stats_t s = get_stats(pool);
    CHECK(s.allocation[VRAM_STAT_ALL].current == 0 && s.active[VRAM_STAT_ALL].current == 1);
    CHECK_POOL(pool);
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &b));
    CHECK(b != a);
    uint64_t released = 0;
    CHECK_OK(vram_empty_cache(pool, &released)); /* the wait still fails: a stays pending */
    CHECK(get_stats(pool).active[VRAM_STAT_ALL].current == 2);
    CHECK_POOL(pool);
    break_streams = 0;
    CHECK_OK(vram_malloc(pool, 4096, 1, 0, &c)); /* malloc polls: the stream now synchronizes */
    CHECK(c == a);
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

int main(void) {
    RUN(test_failed_events_never_release_a_block_early);
    RUN(test_oom_message_and_recovery);
    RUN(test_oom_frees_cache_and_retries);
    RUN(test_oom_callback);
    RUN(test_limits_and_fraction);
    RUN(test_max_split_size);
    RUN(test_garbage_collection);
    RUN(test_roundup_power2_divisions);
    RUN(test_configure_is_all_or_nothing);
    RUN(test_record_stream_defers_reuse);
    return harness_finish();
}
