/* test_host.c — the host pool's protection against the OOM killer, on a scripted host.
 *
 * The fake backend hands out real memory from the cpu backend (so blocks can be written and
 * read back) but answers host_memory from a model of a small machine, as Linux counts: of
 * `total` bytes, mapped segments use only their resident pages (mincore: untouched pages
 * cost nothing yet), except that pages given back with MADV_FREE count as available, and
 * keep counting so after they are written again, until reclaim rescans them. Expected values
 * follow from that model, not from vramkit. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "harness.h"
#include "../../csrc/backends/host_memory.h"
#include "../../csrc/backends/host_streams.h"

#define UNIT (2 * MiB)
#define MAX_ADVISED 4096
#define MAX_SEGMENTS 64

typedef struct fake_host {
    vram__host_streams_t streams; /* first: the host backends' stream and event entries use it */
    void *cpu_ctx;
    uint64_t total, mapped;
    uintptr_t seg_addr[MAX_SEGMENTS];
    uint64_t seg_size[MAX_SEGMENTS];
    int num_segments;
    uintptr_t advised[MAX_ADVISED]; /* 2 MiB units the fake kernel counts as lazily free */
    int num_advised;
    int release_calls;
} fake_host_t;

static int advised_index(const fake_host_t *h, uintptr_t unit) {
    for (int i = 0; i < h->num_advised; i++)
        if (h->advised[i] == unit) return i;
    return -1;
}

static vram_status_t fake_alloc(void *ctx, uint64_t size, vram_stream_t stream, uintptr_t *out) {
    fake_host_t *h = ctx;
    vram_status_t status = vram_backend_cpu()->segment_alloc(h->cpu_ctx, size, stream, out);
    if (status == VRAM_OK) {
        h->mapped += size;
        h->seg_addr[h->num_segments] = *out;
        h->seg_size[h->num_segments++] = size;
    }
    return status;
}

static void fake_free(void *ctx, uintptr_t addr, uint64_t size) {
    fake_host_t *h = ctx;
    for (uintptr_t u = addr; u < addr + size; u += UNIT) {
        int i = advised_index(h, u);
        if (i >= 0) h->advised[i] = h->advised[--h->num_advised];
    }
    h->mapped -= size;
    for (int i = 0; i < h->num_segments; i++)
        if (h->seg_addr[i] == addr) {
            h->seg_addr[i] = h->seg_addr[--h->num_segments];
            h->seg_size[i] = h->seg_size[h->num_segments];
            break;
        }
    vram_backend_cpu()->segment_free(h->cpu_ctx, addr, size);
}

static vram_status_t fake_resident(void *ctx, uintptr_t addr, uint64_t size, uint64_t *bytes) {
    return vram_backend_cpu()->resident_bytes(((fake_host_t *)ctx)->cpu_ctx, addr, size, bytes);
}

static vram_status_t fake_release(void *ctx, uintptr_t addr, uint64_t size, int allow_lazy, int *lazy) {
    fake_host_t *h = ctx;
    vram_status_t status = vram_backend_cpu()->release_pages(h->cpu_ctx, addr, size, allow_lazy, lazy);
    if (status != VRAM_OK) return status;
    h->release_calls++;
    *lazy = allow_lazy; /* the model: lazy when asked, whatever this kernel supports */
    if (allow_lazy)
        for (uintptr_t u = addr; u < addr + size; u += UNIT)
            if (advised_index(h, u) < 0 && h->num_advised < MAX_ADVISED) h->advised[h->num_advised++] = u;
    return VRAM_OK;
}

static vram_status_t fake_host_memory(void *ctx, vram_host_memory_t *out) {
    fake_host_t *h = ctx;
    memset(out, 0, sizeof *out);
    uint64_t lazily_free = (uint64_t)h->num_advised * UNIT, resident = 0;
    for (int i = 0; i < h->num_segments; i++) {
        uint64_t r = 0;
        if (fake_resident(h, h->seg_addr[i], h->seg_size[i], &r) == VRAM_OK) resident += r;
    }
    uint64_t used = resident > lazily_free ? resident - lazily_free : 0;
    out->total = out->ram_total = h->total;
    out->available = out->mem_available = h->total > used ? h->total - used : 0;
    out->cgroup_limit = UINT64_MAX;
    return VRAM_OK;
}

static vram_status_t fake_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total) {
    vram_host_memory_t m;
    vram_status_t status = fake_host_memory(ctx, &m);
    *free_bytes = m.available;
    *total = m.total;
    return status;
}

static void fake_destroy(void *ctx) {
    vram_backend_cpu()->destroy(((fake_host_t *)ctx)->cpu_ctx);
    vram__host_ctx_destroy(ctx);
}

/* Streams and events as the host backends keep them (host_streams.h). */
static const vram_backend_t fake_backend = {
    .name = "fake-host",
    .segment_alloc = fake_alloc, .segment_free = fake_free, .mem_info = fake_mem_info,
    VRAM__HOST_STREAM_ENTRIES, .destroy = fake_destroy,
    .release_pages = fake_release, .host_memory = fake_host_memory, .resident_bytes = fake_resident,
};

/* A host pool on a fake machine of `total` bytes. The pool owns the fake; *host peeks at it. */
static vram_pool_t *make_host_pool(uint64_t total, const char *conf, fake_host_t **host) {
    void *ctx = NULL;
    vram_pool_t *pool = NULL;
    if (vram__host_ctx_new(sizeof(fake_host_t), "a fake host", &ctx) != VRAM_OK) return NULL;
    fake_host_t *h = ctx;
    if (vram_backend_cpu_ctx(&h->cpu_ctx) != VRAM_OK) return NULL;
    h->total = total;
    if (vram_pool_create(&fake_backend, h, (vram_device_t){VRAM_DEVICE_CPU, 0, 0}, conf, &pool) != VRAM_OK) return NULL;
    *host = h;
    return pool;
}

static void fill(void *p, uint64_t size, int byte) { memset(p, byte, (size_t)size); }

static int all_bytes(const void *p, uint64_t size, unsigned char byte) {
    const unsigned char *c = p;
    for (uint64_t i = 0; i < size; i++)
        if (c[i] != byte) return 0;
    return 1;
}

/* Only the check: no page release, no cache limit, no reserve. */
#define CHECK_ONLY "host_reserve_mb:0,host_page_release_mb:None,host_cache_limit_fraction:None"

static void test_check_refuses_then_ladder_frees_cache(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(256 * MiB, CHECK_ONLY, &h);
    CHECK(pool != NULL);
    void *a, *b;
    CHECK_OK(vram_malloc(pool, 100 * MiB, 0, 0, &a));
    fill(a, 100 * MiB, 1);
    CHECK_OK(vram_free(pool, a, 0)); /* 100 MiB cached and resident: the host has 156 MiB left */
    CHECK_OK(vram_malloc(pool, 200 * MiB, 0, 0, &b));
    vram_stats_t s = get_stats(pool);
    CHECK(s.num_host_memory_rejections == 1); /* 200 > 156: refused once... */
    CHECK(s.num_alloc_retries == 1 && s.num_device_free == 1 && s.num_ooms == 0); /* ...cache freed, retried */
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(200 * MiB) && h->mapped == 200 * MiB);
    fill(b, 200 * MiB, 2);
    CHECK(all_bytes(b, 200 * MiB, 2));
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_check_raises_and_leaves_state(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(256 * MiB, "host_reserve_mb:16,host_page_release_mb:None", &h);
    void *a, *b = (void *)1;
    CHECK_OK(vram_malloc(pool, 50 * MiB, 0, 0, &a));
    fill(a, 50 * MiB, 1);
    vram_stats_t before = get_stats(pool);
    /* 206 MiB free, 16 kept back: 192 MiB is the most that can be mapped. */
    CHECK_STATUS(vram_malloc(pool, 200 * MiB, 0, 0, &b), VRAM_ERR_OOM);
    CHECK(b == NULL);
    const char *msg = vram_last_error();
    CHECK_CONTAINS(msg, "CPU out of memory. Tried to allocate 200.00 MiB. Device cpu has a total capacity of "
                        "256.00 MiB of which 206.00 MiB is free.");
    CHECK_CONTAINS(msg, "vramkit did not map 200.00 MiB because the host cannot give it: the kernel reports "
                        "206.00 MiB available (MemAvailable) and 0 bytes of free swap; 16.00 MiB is kept for the "
                        "rest of the process (host_reserve_mb).");
    CHECK_CONTAINS(msg, "host_memory_check:False");
    vram_oom_info_t info;
    vram_last_oom(&info);
    CHECK(info.device_free == 206 * MiB && info.device_total == 256 * MiB && info.segment_size == 200 * MiB);
    vram_stats_t after = get_stats(pool);
    CHECK(after.num_ooms == before.num_ooms + 1 && after.num_host_memory_rejections == 2);
    CHECK(after.allocated_bytes[VRAM_STAT_ALL].current == before.allocated_bytes[VRAM_STAT_ALL].current);
    CHECK(after.reserved_bytes[VRAM_STAT_ALL].current == before.reserved_bytes[VRAM_STAT_ALL].current);
    CHECK_POOL(pool);
    CHECK_OK(vram_malloc(pool, 190 * MiB, 0, 0, &b)); /* what fits still maps */
    CHECK_OK(vram_free(pool, b, 0));
    /* Off: the pool maps what the host cannot give, as before (and as cudaMalloc never would). */
    CHECK_OK(vram_configure(pool, "host_memory_check:False"));
    CHECK_OK(vram_malloc(pool, 300 * MiB, 0, 0, &b));
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_page_release_and_reuse(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(GiB, "host_page_release_mb:6,host_cache_limit_fraction:None", &h);
    void *a, *b, *c;
    CHECK_OK(vram_malloc(pool, 8 * MiB, 0, 0, &a)); /* a 20 MiB segment: 10 units */
    vram_stats_t s = get_stats(pool);
    CHECK(s.host_reclaimable_bytes == (int64_t)(12 * MiB)); /* the untouched tail: units 4..9 */
    fill(a, 8 * MiB, 0xAB);
    CHECK_OK(vram_free(pool, a, 0)); /* 4 units hold memory, 8 MiB >= 6 MiB: given back in one call */
    s = get_stats(pool);
    CHECK(s.num_host_page_releases == 1 && h->release_calls == 1);
    CHECK(s.host_reclaimable_bytes == (int64_t)(20 * MiB) && s.host_lazy_reused_bytes == 0);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(20 * MiB)); /* still mapped and cached */
    /* Reuse: 3 MiB overlaps units 0 and 1, which the fake kernel still counts as free. */
    CHECK_OK(vram_malloc(pool, 3 * MiB, 0, 0, &b));
    CHECK(b == a);
    s = get_stats(pool);
    CHECK(s.host_lazy_reused_bytes == (int64_t)(4 * MiB) && s.host_reclaimable_bytes == (int64_t)(16 * MiB));
    uint64_t free_bytes, total;
    CHECK_OK(vram_mem_get_info(pool, &free_bytes, &total));
    /* The fake kernel: 8 MiB resident, all of it given back, so counted as free; less the
     * 4 MiB vramkit reused from them. */
    CHECK(total == GiB && free_bytes == GiB - 4 * MiB);
    /* Freeing it leaves 2 units (4 MiB) holding memory, under 6 MiB: nothing given back... */
    CHECK_OK(vram_free(pool, b, 0));
    s = get_stats(pool);
    CHECK(s.num_host_page_releases == 1 && s.host_lazy_reused_bytes == (int64_t)(4 * MiB));
    /* ...but a calloc over those units still reads zero, and so does a fresh segment. */
    CHECK_OK(vram_calloc(pool, 20 * MiB, 0, 0, &c));
    CHECK(c == a && all_bytes(c, 20 * MiB, 0));
    fill(c, 20 * MiB, 0xCD);
    CHECK_OK(vram_free(pool, c, 0)); /* 10 units hold memory: released, reused units cleaned */
    s = get_stats(pool);
    CHECK(s.num_host_page_releases == 2 && s.host_lazy_reused_bytes == 0);
    CHECK(s.host_reclaimable_bytes == (int64_t)(20 * MiB));
    CHECK_OK(vram_calloc(pool, 64 * MiB, 0, 0, &c));
    CHECK(all_bytes(c, 64 * MiB, 0));
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_lazy_reuse_is_subtracted(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(256 * MiB, "host_reserve_mb:0,host_page_release_mb:0,"
                                                  "host_cache_limit_fraction:None", &h);
    void *a, *b, *c;
    CHECK_OK(vram_malloc(pool, 100 * MiB, 0, 0, &a));
    fill(a, 100 * MiB, 1);
    CHECK_OK(vram_free(pool, a, 0)); /* given back lazily: the fake kernel counts 100 MiB as free */
    CHECK_OK(vram_malloc(pool, 100 * MiB, 0, 0, &b));
    fill(b, 100 * MiB, 2); /* written again; the kernel still counts it as free */
    vram_host_memory_t kernel;
    CHECK_OK(fake_host_memory(h, &kernel));
    CHECK(kernel.available == 256 * MiB); /* the kernel's view: 200 MiB would fit */
    CHECK_STATUS(vram_malloc(pool, 200 * MiB, 0, 0, &c), VRAM_ERR_OOM); /* 256 - 100 reused: it does not */
    CHECK_CONTAINS(vram_last_error(), "less 100.00 MiB that vramkit reuses after giving it back with MADV_FREE");
    CHECK_OK(vram_malloc(pool, 150 * MiB, 0, 0, &c));
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_OK(vram_free(pool, b, 0)); /* given back again: nothing is overstated any more */
    CHECK(get_stats(pool).host_lazy_reused_bytes == 0);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_untouched_memory_is_counted(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(256 * MiB, CHECK_ONLY, &h);
    void *a, *b, *c;
    CHECK_OK(vram_calloc(pool, 150 * MiB, 0, 0, &a)); /* a fresh segment: zero, and nothing written */
    vram_host_memory_t kernel;
    CHECK_OK(fake_host_memory(h, &kernel));
    CHECK(kernel.available >= 250 * MiB); /* the kernel sees none of it yet */
    CHECK(get_stats(pool).host_untouched_bytes == (int64_t)(150 * MiB));
    uint64_t free_bytes, total;
    CHECK_OK(vram_mem_get_info(pool, &free_bytes, &total));
    CHECK(free_bytes <= kernel.available - 149 * MiB);
    /* A second one would be approved by the kernel's figure, and writing both would not fit. */
    CHECK_STATUS(vram_calloc(pool, 150 * MiB, 0, 0, &b), VRAM_ERR_OOM);
    CHECK_CONTAINS(vram_last_error(), "of arrays handed out but not yet written");
    /* It reads zero. (Read before the check, it would map the kernel's shared zero page, which
     * mincore reports as resident: memory only read since it was handed out counts as written.) */
    CHECK(all_bytes(a, 150 * MiB, 0));
    fill(a, 150 * MiB, 5); /* now the kernel counts it, and vramkit stops counting it twice */
    CHECK_OK(vram_malloc(pool, 100 * MiB, 0, 0, &c));
    vram_stats_t s = get_stats(pool);
    CHECK(s.host_untouched_bytes == (int64_t)(100 * MiB)); /* a found resident; c is new */
    fill(c, 100 * MiB, 6);
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_cache_limit_releases_least_recently_freed(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(GiB, "host_memory_check:False,host_page_release_mb:None,"
                                            "host_cache_limit_mb:50,host_cache_limit_fraction:None", &h);
    void *a, *b, *c;
    CHECK(pool != NULL);
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &a));
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &b));
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &c));
    CHECK(get_stats(pool).host_cache_limit == (int64_t)(50 * MiB));
    CHECK_OK(vram_free(pool, a, 0)); /* 30 MiB cached: within the limit */
    CHECK(get_stats(pool).reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(90 * MiB));
    CHECK_OK(vram_free(pool, b, 0)); /* 60 MiB cached: a's segment, freed first, goes */
    vram_stats_t s = get_stats(pool);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(60 * MiB) && s.num_host_cache_limit_releases == 1);
    void *again;
    CHECK_OK(vram_malloc(pool, 30 * MiB, 0, 0, &again));
    CHECK(again == b); /* b's segment stayed */
    CHECK_OK(vram_free(pool, again, 0));
    CHECK_OK(vram_free(pool, c, 0)); /* 60 MiB cached again: b's segment, now the older, goes */
    s = get_stats(pool);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(30 * MiB) && s.num_host_cache_limit_releases == 2);
    /* A lower limit applies at once, and 0 caches nothing. */
    CHECK_OK(vram_configure(pool, "host_cache_limit_mb:0"));
    CHECK(get_stats(pool).reserved_bytes[VRAM_STAT_ALL].current == 0);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

/* Freeing B pushes the cache over its limit: A (freed first) is unmapped, and B, which stays
 * cached, still gives its pages back. */
static void test_cache_limit_and_page_release_together(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(GiB, "host_memory_check:False,host_page_release_mb:64,"
                                            "host_cache_limit_mb:100,host_cache_limit_fraction:None", &h);
    void *a, *b;
    CHECK_OK(vram_malloc(pool, 80 * MiB, 0, 0, &a));
    CHECK_OK(vram_malloc(pool, 80 * MiB, 0, 0, &b));
    fill(a, 80 * MiB, 1);
    fill(b, 80 * MiB, 2);
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_free(pool, b, 0));
    vram_stats_t s = get_stats(pool);
    CHECK(s.num_host_cache_limit_releases == 1 && s.reserved_bytes[VRAM_STAT_ALL].current == (int64_t)(80 * MiB));
    CHECK(s.num_host_page_releases == 2 && s.host_reclaimable_bytes == (int64_t)(80 * MiB));
    void *again;
    CHECK_OK(vram_malloc(pool, 80 * MiB, 0, 0, &again));
    CHECK(again == b);
    CHECK_OK(vram_free(pool, again, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

/* Cached memory the limit cannot release (a block waiting for another stream, free pieces of
 * segments in use) does not count against it, so a loop over one segment does not map and
 * unmap it every time. */
static void test_cache_limit_counts_only_releasable_memory(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(GiB, "host_memory_check:False,host_page_release_mb:None,"
                                            "host_cache_limit_mb:100,host_cache_limit_fraction:None", &h);
    void *pending, *keep, *p;
    CHECK_OK(vram_malloc(pool, 200 * MiB, 0, 0, &pending));
    CHECK_OK(vram_record_stream(pool, pending, 7));
    CHECK_OK(vram_free(pool, pending, 0)); /* 200 MiB cached, waiting for stream 7 */
    CHECK_OK(vram_malloc(pool, 3 * MiB, 0, 0, &keep)); /* a 20 MiB segment, 17 MiB of it free */
    int64_t allocs = get_stats(pool).num_device_alloc;
    for (int i = 0; i < 50; i++) {
        CHECK_OK(vram_malloc(pool, 50 * MiB, 0, 0, &p));
        CHECK_OK(vram_free(pool, p, 0));
    }
    vram_stats_t s = get_stats(pool);
    CHECK(s.num_device_alloc == allocs + 1 && s.num_host_cache_limit_releases == 0);
    CHECK_OK(vram_pool_synchronize(pool, VRAM_ALL_STREAMS)); /* now 250 MiB wholly free: over 100 */
    s = get_stats(pool);
    CHECK(s.num_host_cache_limit_releases >= 1 && s.reserved_bytes[VRAM_STAT_ALL].current <= (int64_t)(120 * MiB));
    CHECK_OK(vram_free(pool, keep, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_cache_limit_fraction_of_capacity(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(400 * MiB, "host_memory_check:False", &h);
    vram_settings_t st;
    CHECK_OK(vram_get_settings(pool, &st));
    /* Host defaults: a quarter of the capacity cached, 1/64 of it kept back, release from 64 MiB. */
    CHECK(st.host_cache_limit == 100 * MiB && st.host_cache_limit_fraction == 0.25);
    CHECK(st.host_reserve == 6 * MiB && st.host_page_release == 64 * MiB && st.host_memory_check == 0); /* 400/64, whole MiB */
    CHECK_OK(vram_configure(pool, "host_cache_limit_fraction:0.1,host_cache_limit_mb:30"));
    CHECK_OK(vram_get_settings(pool, &st));
    CHECK(st.host_cache_limit == 30 * MiB); /* the smaller of 40 MiB and 30 MiB */
    CHECK_OK(vram_configure(pool, "host_cache_limit_fraction:None,host_cache_limit_mb:None"));
    CHECK_OK(vram_get_settings(pool, &st));
    CHECK(st.host_cache_limit == UINT64_MAX && get_stats(pool).host_cache_limit == -1);
    vram_pool_destroy(pool);
}

static void test_host_options_are_checked(void) {
    fake_host_t *h;
    vram_pool_t *pool = make_host_pool(GiB, NULL, &h);
    vram_settings_t before, after;
    CHECK_OK(vram_get_settings(pool, &before));
    CHECK_STATUS(vram_configure(pool, "host_memory_check:maybe"), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "host_memory_check must be True or False; got 'maybe'");
    CHECK_STATUS(vram_configure(pool, "host_cache_limit_fraction:1.5"), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "host_cache_limit_fraction must be a number in [0, 1] or None; got '1.5'");
    CHECK_STATUS(vram_configure(pool, "host_page_release_mb:-1"), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "host_page_release_mb must be a non-negative integer (MiB) or None");
    CHECK_STATUS(vram_configure(pool, "host_reserve_mb:None"), VRAM_ERR_INVALID_ARG);
    /* All or nothing: a good option before a bad one is not applied. */
    CHECK_STATUS(vram_configure(pool, "host_cache_limit_mb:5,host_lazy_free:x"), VRAM_ERR_INVALID_ARG);
    CHECK_OK(vram_get_settings(pool, &after));
    CHECK(memcmp(&before, &after, sizeof before) == 0);
    vram_pool_destroy(pool);

    /* A device pool refuses host options from vram_configure but ignores them in its
     * configuration string (VRAMKIT_ALLOC_CONF is read by every pool). */
    vram_pool_t *sim = make_sim_pool(GiB, "host_cache_limit_mb:1,host_memory_check:True");
    CHECK(sim != NULL);
    CHECK(!vram_pool_is_host(sim));
    CHECK_OK(vram_get_settings(sim, &after));
    CHECK(after.host_cache_limit == UINT64_MAX && after.host_memory_check == 0);
    CHECK_STATUS(vram_configure(sim, "host_cache_limit_mb:1"), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "host_cache_limit_mb applies to the cpu pool (host memory) only");
    void *p;
    CHECK_STATUS(vram_calloc(sim, 100, 0, 0, &p), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "vram_calloc needs a host pool");
    vram_pool_destroy(sim);
}

/* ---- cgroup discovery on fake trees: v1 and v2, whatever this machine runs ---------------- */

static char fake_root[256];

static void write_file(const char *dir, const char *name, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "cannot write %s\n", path);
        return;
    }
    fputs(text, f);
    fclose(f);
}

/* mkdir -p of fake_root/rel; returns the path in a static buffer per call site's copy. */
static void make_dir(const char *rel, char *out, size_t len) {
    snprintf(out, len, "%s/%s", fake_root, rel);
    for (char *p = out + strlen(fake_root) + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(out, 0755);
            *p = '/';
        }
    mkdir(out, 0755);
}

/* Read with mountinfo and cgroup files of the given text. */
static vram_host_memory_t read_fake(const char *mountinfo, const char *cgroup) {
    char mi[512], cg[512];
    snprintf(mi, sizeof mi, "%s/mountinfo", fake_root);
    snprintf(cg, sizeof cg, "%s/cgroup", fake_root);
    write_file(fake_root, "mountinfo", mountinfo);
    write_file(fake_root, "cgroup", cgroup);
    vram_host_memory_t m;
    CHECK_OK(vram__host_memory_from(mi, cg, &m));
    return m;
}

static void test_cgroup_v2_limits(void) {
    char job[512], slice[512], text[1024], ns[512];
    make_dir("cg2/app.slice/job", job, sizeof job);
    make_dir("cg2/app.slice", slice, sizeof slice);
    write_file(job, "memory.max", "1073741824\n");                                   /* 1 GiB */
    write_file(job, "memory.current", "629145600\n");                                /* 600 MiB */
    write_file(job, "memory.stat", "anon 419430400\nfile 209715200\ninactive_file 209715200\nactive_file 0\n");
    write_file(job, "memory.swap.max", "0\n");
    write_file(job, "memory.swap.current", "0\n");
    write_file(slice, "memory.max", "max\n");
    snprintf(text, sizeof text, "21 1 0:19 / /proc rw - proc proc rw\n"
                                "35 24 0:30 / %s/cg2 rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
                                "rw,nsdelegate,memory_recursiveprot\n", fake_root);
    vram_host_memory_t m = read_fake(text, "0::/app.slice/job\n");
    CHECK(m.cgroup_version == 2 && m.cgroup_limit == GiB);
    CHECK(m.cgroup_usage == 600 * MiB && m.cgroup_reclaimable == 200 * MiB);
    CHECK(strcmp(m.cgroup_path, job) == 0);
    CHECK(m.total == (m.ram_total < GiB ? m.ram_total : GiB));
    CHECK(m.available == 624 * MiB || m.available == m.mem_available + m.swap_free); /* 1 GiB - (600 - 200) */

    /* An ancestor with less room binds: 700 MiB limit, 650 MiB in use, nothing reclaimable. */
    write_file(slice, "memory.max", "734003200\n");
    write_file(slice, "memory.current", "681574400\n");
    write_file(slice, "memory.stat", "anon 681574400\ninactive_file 0\n");
    m = read_fake(text, "0::/app.slice/job\n");
    CHECK(m.cgroup_limit == 700 * MiB && strcmp(m.cgroup_path, slice) == 0 && m.available == 50 * MiB);

    /* A cgroup namespace: the mount shows /app.slice as its root, and /proc/self/cgroup says
     * where we are below the hierarchy's root. */
    make_dir("cg2ns/job", ns, sizeof ns);
    write_file(ns, "memory.max", "536870912\n");
    write_file(ns, "memory.current", "0\n");
    snprintf(text, sizeof text, "35 24 0:30 /app.slice %s/cg2ns rw - cgroup2 cgroup2 rw\n", fake_root);
    m = read_fake(text, "0::/app.slice/job\n");
    CHECK(m.cgroup_limit == 512 * MiB && strcmp(m.cgroup_path, ns) == 0);
    /* A container sees "0::/" and its own cgroup at the mount point. */
    char point[512];
    make_dir("cg2ct", point, sizeof point);
    write_file(point, "memory.max", "268435456\n");
    write_file(point, "memory.current", "0\n");
    snprintf(text, sizeof text, "35 24 0:30 / %s/cg2ct rw - cgroup2 cgroup2 rw\n", fake_root);
    m = read_fake(text, "0::/\n");
    CHECK(m.cgroup_limit == 256 * MiB && strcmp(m.cgroup_path, point) == 0);
}

static void test_cgroup_v1_limits(void) {
    char sub[512], grp[512], text[1024], spaced[512];
    make_dir("mem/grp/sub", sub, sizeof sub);
    make_dir("mem/grp", grp, sizeof grp);
    write_file(sub, "memory.limit_in_bytes", "9223372036854771712\n"); /* v1's "no limit" */
    write_file(sub, "memory.usage_in_bytes", "104857600\n");
    write_file(grp, "memory.limit_in_bytes", "2147483648\n");             /* 2 GiB */
    write_file(grp, "memory.usage_in_bytes", "1073741824\n");
    /* Hierarchical total_inactive_file counts, not the cgroup's own inactive_file. */
    write_file(grp, "memory.stat", "cache 1\ninactive_file 1\ntotal_inactive_file 268435456\n");
    snprintf(text, sizeof text, "30 25 0:26 / %s/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
                                "31 25 0:27 / %s/mem rw,nosuid - cgroup cgroup rw,memory\n"
                                "32 25 0:28 / %s/unified rw - cgroup2 cgroup2 rw\n", fake_root, fake_root, fake_root);
    vram_host_memory_t m = read_fake(text, "5:cpu,cpuacct:/x\n4:memory:/grp/sub\n0::/\n");
    CHECK(m.cgroup_version == 1 && m.cgroup_limit == 2 * GiB && strcmp(m.cgroup_path, grp) == 0);
    CHECK(m.cgroup_reclaimable == 256 * MiB && m.available <= GiB + 256 * MiB);
    CHECK(m.available == GiB + 256 * MiB || m.available == m.mem_available + m.swap_free);
    /* A mount point with a space, written \040 in mountinfo. */
    char dir[512];
    make_dir("mem v1/g", dir, sizeof dir);
    write_file(dir, "memory.limit_in_bytes", "1048576000\n");
    write_file(dir, "memory.usage_in_bytes", "0\n");
    snprintf(spaced, sizeof spaced, "31 25 0:27 / %s/mem\\040v1 rw - cgroup cgroup rw,memory\n", fake_root);
    m = read_fake(spaced, "4:memory:/g\n");
    CHECK(m.cgroup_limit == 1000 * MiB && strcmp(m.cgroup_path, dir) == 0);
    /* No memory controller at all: no cgroup figures. */
    snprintf(text, sizeof text, "30 25 0:26 / %s/cpu rw - cgroup cgroup rw,cpu\n", fake_root);
    m = read_fake(text, "5:cpu:/x\n");
    CHECK(m.cgroup_version == 0 && m.cgroup_limit == UINT64_MAX && m.total == m.ram_total);
}

static void test_real_host_memory_is_sane(void) {
    vram_host_memory_t m;
    CHECK_OK(vram_host_memory(&m));
    CHECK(m.ram_total > 0 && m.total > 0 && m.total <= m.ram_total);
    CHECK(m.mem_available > 0 && m.mem_available <= m.ram_total);
    CHECK(m.available <= m.mem_available + m.swap_free);
    if (m.cgroup_limit != UINT64_MAX) CHECK(m.cgroup_path[0] == '/' && m.cgroup_version >= 1);
    vram_pool_t *cpu;
    CHECK_OK(vram_device_pool((vram_device_t){VRAM_DEVICE_CPU, 0, 0}, &cpu));
    CHECK(vram_pool_is_host(cpu));
}

int main(void) {
    RUN(test_check_refuses_then_ladder_frees_cache);
    RUN(test_check_raises_and_leaves_state);
    RUN(test_page_release_and_reuse);
    RUN(test_lazy_reuse_is_subtracted);
    RUN(test_untouched_memory_is_counted);
    RUN(test_cache_limit_releases_least_recently_freed);
    RUN(test_cache_limit_and_page_release_together);
    RUN(test_cache_limit_counts_only_releasable_memory);
    RUN(test_cache_limit_fraction_of_capacity);
    RUN(test_host_options_are_checked);
    RUN(test_real_host_memory_is_sane);
    snprintf(fake_root, sizeof fake_root, "/tmp/vramkit-cgroup-test-XXXXXX");
    if (!mkdtemp(fake_root)) {
        fprintf(stderr, "mkdtemp failed\n");
        return 1;
    }
    RUN(test_cgroup_v2_limits);
    RUN(test_cgroup_v1_limits);
    char cleanup[300];
    snprintf(cleanup, sizeof cleanup, "rm -rf '%s'", fake_root);
    if (system(cleanup) != 0) fprintf(stderr, "could not remove %s\n", fake_root);
    return harness_finish();
}
