/* test_address_space.c — the cpu pool under an address-space limit (RLIMIT_AS, `ulimit -v`),
 * with the limit faked through the backend's address_space operation and the backend's note
 * of a refused mapping set by hand: a real RLIMIT_AS would break AddressSanitizer, which
 * reserves terabytes of shadow memory. The real limit is tested from Python in subprocesses
 * (tests/unit/test_expandable.py, test_host_memory.py). */
#include <stdint.h>
#include <sys/resource.h>

#include "harness.h"
#include "../../csrc/alloc/internal.h"
#include "../../csrc/util/address_space.h"

static uint64_t fake_limit = UINT64_MAX, fake_used;

static void fake_address_space(void *ctx, uint64_t *limit, uint64_t *used) {
    (void)ctx;
    *limit = fake_limit;
    *used = fake_used;
}

/* Classic segments refused as the kernel does under the limit: the backend notes why. */
static int refusals; /* how many segment allocations to refuse */
static vram_status_t refusing_alloc(void *ctx, uint64_t size, vram_stream_t stream, uintptr_t *out) {
    if (refusals > 0) {
        refusals--;
        vram__as_refusal_set(size, 3 * GiB, 5 * GiB / 2);
        return VRAM_ERR_OOM;
    }
    return vram_backend_cpu()->segment_alloc(ctx, size, stream, out);
}

/* A cpu pool whose host check is off (the figures below must not depend on the machine's
 * memory; untouched pages cost none) and whose address-space reading is the fake one. */
static vram_pool_t *limited_pool(const char *conf) {
    static vram_backend_t backend;
    backend = *vram_backend_cpu();
    backend.address_space = fake_address_space;
    backend.segment_alloc = refusing_alloc;
    void *ctx = NULL;
    vram_pool_t *pool = NULL;
    CHECK_OK(vram_backend_cpu_ctx(&ctx));
    CHECK_OK(vram_pool_create(&backend, ctx, (vram_device_t){VRAM_DEVICE_CPU, 0, 0}, conf, &pool));
    return pool;
}

#define EXPANDABLE "host_memory_check:False,expandable_segments:True"

/* A new range takes at most half (large pool) or an eighth (small pool) of what the limit
 * leaves; a request that no such range can hold gets a classic segment of its own size, in
 * the same pool, reused from the cache like any classic segment; the invariants hold with
 * both layouts, and empty_cache releases both. */
static void test_ranges_fit_what_the_limit_leaves(void) {
    fake_used = 100 * MiB;
    fake_limit = fake_used + GiB;
    vram_pool_t *pool = limited_pool(EXPANDABLE);
    void *small = NULL, *mid = NULL, *big = NULL, *reuse = NULL;
    CHECK_OK(vram_malloc(pool, 1000, 0, 0, &small));
    CHECK(pool->segments->expandable && pool->segments->is_small && pool->segments->size == 128 * MiB);
    CHECK_OK(vram_malloc(pool, 100 * MiB, 0, 0, &mid));
    CHECK(pool->segments->expandable && !pool->segments->is_small && pool->segments->size == 512 * MiB);
    CHECK_OK(vram_malloc(pool, 600 * MiB, 0, 0, &big)); /* 412 MiB left in the range; 512 MiB at most for a new one */
    vram__segment_t *classic = pool->segments;
    CHECK(!classic->expandable && classic->size == 600 * MiB && (uintptr_t)big == classic->addr && classic->clean);
    vram_stats_t s = get_stats(pool);
    CHECK(s.segment[VRAM_STAT_ALL].current == 1); /* the classic one: PyTorch's counter leaves ranges out */
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(2 * MiB + 100 * MiB + 600 * MiB));
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, big, 0));
    CHECK_OK(vram_malloc(pool, 550 * MiB, 0, 0, &reuse)); /* best fit: the cached classic block */
    CHECK(reuse == big);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, reuse, 0));
    CHECK_OK(vram_free(pool, mid, 0));
    CHECK_OK(vram_free(pool, small, 0));
    CHECK_POOL(pool);
    CHECK_OK(vram_empty_cache(pool, NULL));
    CHECK(pool->segments == NULL && get_stats(pool).reserved_bytes[VRAM_STAT_ALL].current == 0);

    /* Nothing left under the limit: every request gets a classic segment (here mmap, which
     * knows nothing of the fake limit, succeeds). Switching the layout off still works. */
    fake_used = fake_limit;
    CHECK_OK(vram_malloc(pool, 1000, 0, 0, &small));
    CHECK(!pool->segments->expandable && pool->segments->size == VRAM_SMALL_BUFFER);
    CHECK_POOL(pool);
    CHECK_OK(vram_free(pool, small, 0));
    CHECK_OK(vram_configure(pool, "expandable_segments:False"));
    CHECK(pool->segments == NULL);

    /* No limit: PyTorch's 1 1/8 of the capacity, as before. */
    fake_limit = UINT64_MAX;
    CHECK_OK(vram_configure(pool, "expandable_segments:True"));
    CHECK_OK(vram_malloc(pool, 1000, 0, 0, &small));
    CHECK(pool->segments->expandable && pool->segments->size >= pool->total_capacity);
    CHECK_OK(vram_free(pool, small, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static int mentions_limit(void) { return strstr(vram_last_error(), "RLIMIT_AS") != NULL; }

/* The OOM message names the limit when the backend noted it refused the last attempt, with
 * what the process may still map as the free figure; a note never reaches a later OOM that
 * has another cause, whether the retry that followed it succeeded or it was left by a caller
 * outside the pool. */
static void test_oom_names_the_limit_only_when_it_refused(void) {
    fake_limit = UINT64_MAX;
    vram_pool_t *pool = limited_pool("host_memory_check:False");
    void *p = NULL;
    refusals = 1000;
    CHECK_STATUS(vram_malloc(pool, 100 * MiB, 0, 0, &p), VRAM_ERR_OOM);
    CHECK_CONTAINS(vram_last_error(), "CPU out of memory. Tried to allocate 100.00 MiB.");
    CHECK_CONTAINS(vram_last_error(), "could not map 100.00 MiB because of the address-space limit RLIMIT_AS "
                                      "(ulimit -v) of 3.00 GiB, of which 2.50 GiB is in use by this process");
    CHECK_CONTAINS(vram_last_error(), "Raise the limit (ulimit -v");
    vram_oom_info_t info;
    vram_last_oom(&info);
    CHECK(info.device_free <= 512 * MiB); /* 3 GiB limit - 2.5 GiB used (or the host's less) */
    vram__as_refusal_t left;
    CHECK(vram__as_refusal_take(&left) == 0); /* the report took it */

    refusals = 0;
    CHECK_OK(vram_set_memory_limit(pool, 50 * MiB));
    CHECK_STATUS(vram_malloc(pool, 100 * MiB, 0, 0, &p), VRAM_ERR_OOM);
    CHECK_CONTAINS(vram_last_error(), "50.00 MiB allowed");
    CHECK(!mentions_limit());

    /* Refused once, then the ladder's retry succeeds: the note of the refusal must not
     * describe the next, unrelated OOM. */
    CHECK_OK(vram_set_memory_limit(pool, VRAM_NO_LIMIT));
    refusals = 1;
    CHECK_OK(vram_malloc(pool, 100 * MiB, 0, 0, &p));
    CHECK_OK(vram_set_memory_limit(pool, 110 * MiB));
    void *q = NULL;
    CHECK_STATUS(vram_malloc(pool, 100 * MiB, 0, 0, &q), VRAM_ERR_OOM);
    CHECK(!mentions_limit());
    /* A note left by someone else on this thread, outside any pool. */
    vram__as_refusal_set(GiB, 2 * GiB, 2 * GiB);
    CHECK_STATUS(vram_malloc(pool, 100 * MiB, 0, 0, &q), VRAM_ERR_OOM);
    CHECK(!mentions_limit());
    CHECK_OK(vram_free(pool, p, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);

    /* An ENOMEM the limit does not explain (this process has none) leaves no note. */
    vram__as_refusal_set(GiB, 2 * GiB, 2 * GiB);
    vram__as_refusal_after_enomem(GiB, GiB + 2 * MiB);
    CHECK(vram__as_refusal_take(&left) == 0);
}

/* The reading agrees with getrlimit, and VmSize is read only under a limit (the C tests
 * normally run without one; a real limit is exercised from Python). */
static void test_reading_follows_getrlimit(void) {
    struct rlimit rl;
    CHECK(getrlimit(RLIMIT_AS, &rl) == 0);
    uint64_t limit = 0, used = 1;
    vram__address_space(&limit, &used);
    if (rl.rlim_cur == RLIM_INFINITY) {
        CHECK(limit == UINT64_MAX && used == 0);
    } else {
        CHECK(limit == (uint64_t)rl.rlim_cur && used > 0);
    }
}

int main(void) {
    RUN(test_ranges_fit_what_the_limit_leaves);
    RUN(test_oom_names_the_limit_only_when_it_refused);
    RUN(test_reading_follows_getrlimit);
    return harness_finish();
}
