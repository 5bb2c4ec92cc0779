/* test_replay.c — vram_trace_replay: peaks and their event indices on hand-written traces
 * (expected figures derived from PyTorch's policy: 512-byte rounding, 2 MiB segments for
 * requests up to 1 MiB, 20 MiB segments for 1-10 MiB, the request rounded to 2 MiB above),
 * the OOM stop, a conf that changes the result, every bad-input rule, zero-size allocations,
 * markers, streams, the per-event columns against vram_malloc/vram_free step by step, and
 * enough replays to exhaust the shared simulated address range many times over. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define A VRAM_REPLAY_ALLOC
#define F VRAM_REPLAY_FREE
#define M 7 /* a marker */
#define SENTINEL UINT64_C(0xDEADBEEFDEADBEEF)
#define SIM_BASE (UINT64_C(1) << 48)

typedef struct trace {
    uint8_t *kind;
    int64_t *id;
    uint64_t *size;
    uint64_t *stream;
    size_t n;
} trace_t;

/* Per-event outputs, pre-filled with a sentinel so untouched entries show. */
typedef struct outs {
    uint64_t *reserved, *allocated, *addr;
} outs_t;

static outs_t outs_new(size_t n) {
    outs_t o = {malloc((n + 1) * 8), malloc((n + 1) * 8), malloc((n + 1) * 8)};
    for (size_t i = 0; i <= n; i++) o.reserved[i] = o.allocated[i] = o.addr[i] = SENTINEL;
    return o;
}
static void outs_free(outs_t o) {
    free(o.reserved);
    free(o.allocated);
    free(o.addr);
}

static vram_status_t replay(const trace_t *t, uint64_t capacity, const char *conf, outs_t *o, vram_replay_result_t *r) {
    return vram_trace_replay(t->kind, t->id, t->size, t->stream, t->n, capacity, conf, o ? o->reserved : NULL,
                             o ? o->allocated : NULL, o ? o->addr : NULL, r);
}

/* alloc 100 B (512 B from a 2 MiB small segment), alloc 1.5 MiB (a 20 MiB segment), a marker
 * (whose id and size are garbage), free, alloc 24 MiB + 1 (24 MiB + 512 does not fit the 18.5 MiB
 * left of the 20 MiB segment: a 26 MiB segment), alloc 0 B, free, alloc 24 MiB (best fit: the
 * cached 26 MiB block, split), free of the 0-B id, free. */
static void test_hand_trace_peaks_and_columns(void) {
    uint8_t kind[] = {A, A, M, F, A, A, F, A, F, F};
    int64_t id[] = {0, 1, -99, 0, 2, 3, 2, 4, 3, 1};
    uint64_t size[] = {100, 3 * MiB / 2, UINT64_MAX, 0, 24 * MiB + 1, 0, 0, 24 * MiB, 0, 0};
    trace_t t = {kind, id, size, NULL, 10};
    outs_t o = outs_new(t.n);
    vram_replay_result_t r;
    CHECK_OK(replay(&t, 8 * GiB, NULL, &o, &r));

    uint64_t big = 24 * MiB + 512, mid = 3 * MiB / 2;
    uint64_t want_reserved[] = {2 * MiB, 22 * MiB, 22 * MiB, 22 * MiB, 48 * MiB,
                                48 * MiB, 48 * MiB, 48 * MiB, 48 * MiB, 48 * MiB};
    uint64_t want_allocated[] = {512, 512 + mid, 512 + mid, mid, mid + big,
                                 mid + big, mid, mid + 24 * MiB, mid + 24 * MiB, 24 * MiB};
    for (size_t i = 0; i < t.n; i++) {
        CHECK(o.reserved[i] == want_reserved[i]);
        CHECK(o.allocated[i] == want_allocated[i]);
    }
    CHECK(o.reserved[t.n] == SENTINEL && o.allocated[t.n] == SENTINEL && o.addr[t.n] == SENTINEL);
    /* Addresses: the small segment first at the private range's base, then the 20 MiB segment,
     * then the 26 MiB one, whose head the 24 MiB request reuses. */
    CHECK(o.addr[0] == SIM_BASE);
    CHECK(o.addr[1] == SIM_BASE + 2 * MiB);
    CHECK(o.addr[4] == SIM_BASE + 22 * MiB);
    CHECK(o.addr[7] == o.addr[4]);
    CHECK(o.addr[2] == 0 && o.addr[3] == 0 && o.addr[5] == 0 && o.addr[6] == 0 && o.addr[8] == 0 && o.addr[9] == 0);

    CHECK(r.events == 10 && r.oom_event == -1);
    CHECK(r.peak_allocated == mid + big && r.peak_allocated_event == 4);
    CHECK(r.reserved_at_peak_allocated == 48 * MiB);
    CHECK(r.peak_reserved == 48 * MiB && r.peak_reserved_event == 4);
    CHECK(r.allocated_at_peak_reserved == mid + big);
    CHECK(r.segments_at_peak_reserved == 3);
    CHECK(r.peak_requested == mid + 24 * MiB + 1); /* event 4: id 0 is freed by then */
    CHECK(r.final_allocated == 24 * MiB && r.final_reserved == 48 * MiB);
    CHECK(r.num_device_alloc == 3 && r.num_device_free == 0 && r.num_ooms == 0 && r.num_alloc_retries == 0);

    /* The same trace again gives the same addresses: the range is private to each call. */
    outs_t o2 = outs_new(t.n);
    vram_replay_result_t r2;
    CHECK_OK(replay(&t, 8 * GiB, NULL, &o2, &r2));
    CHECK(memcmp(o.addr, o2.addr, t.n * 8) == 0);
    CHECK(memcmp(&r, &r2, sizeof r) == 0);
    /* Without outputs the result is the same. */
    CHECK_OK(replay(&t, 8 * GiB, NULL, NULL, &r2));
    CHECK(memcmp(&r, &r2, sizeof r) == 0);
    outs_free(o);
    outs_free(o2);
}

/* Blocks are reused only on their own stream: a 100 B block freed on stream 1 does not serve
 * a request on stream 2, which maps a second small segment. */
static void test_stream_column(void) {
    uint8_t kind[] = {A, F, A};
    int64_t id[] = {0, 0, 1};
    uint64_t size[] = {100, 0, 100};
    uint64_t stream[] = {1, 1, 2};
    trace_t t = {kind, id, size, stream, 3};
    vram_replay_result_t r;
    CHECK_OK(replay(&t, GiB, NULL, NULL, &r));
    CHECK(r.peak_reserved == 4 * MiB && r.peak_reserved_event == 2 && r.segments_at_peak_reserved == 2);
    t.stream = NULL; /* every event on stream 0: the block is reused */
    CHECK_OK(replay(&t, GiB, NULL, NULL, &r));
    CHECK(r.peak_reserved == 2 * MiB && r.peak_reserved_event == 0 && r.num_device_alloc == 1);
}

/* record_stream: a block used on stream 2 and freed is not reused on its own stream 1 until
 * stream 2 is synchronized (by itself, or with every stream: id -1). */
#define U VRAM_REPLAY_USE
#define S VRAM_REPLAY_SYNC
static void test_stream_uses_wait_for_a_synchronize(void) {
    for (int all = 0; all < 2; all++) {
        uint8_t kind[] = {A, U, F, A, S, A};
        int64_t id[] = {0, 0, 0, 1, all ? -1 : 0, 2};
        uint64_t size[] = {12 * MiB, 0, 0, 12 * MiB, 0, 12 * MiB}; /* one 12 MiB segment each */
        uint64_t stream[] = {1, 2, 1, 1, all ? 9 : 2, 1};
        trace_t t = {kind, id, size, stream, 6};
        outs_t o = outs_new(t.n);
        vram_replay_result_t r;
        CHECK_OK(replay(&t, GiB, NULL, &o, &r));
        CHECK(o.addr[3] != o.addr[0]);    /* still waiting for stream 2: a second segment */
        CHECK(o.reserved[3] == 24 * MiB);
        CHECK(o.addr[5] == o.addr[0]);    /* after the synchronize, the block is back */
        CHECK(r.peak_reserved == 24 * MiB && r.num_device_alloc == 2);
        CHECK(o.allocated[2] == 0);       /* freed for the counters at its FREE, as in PyTorch */
        outs_free(o);
    }
    /* Without the use, the free block is reused at once. */
    uint8_t kind[] = {A, F, A};
    int64_t id[] = {0, 0, 1};
    uint64_t size[] = {12 * MiB, 0, 12 * MiB};
    uint64_t stream[] = {1, 1, 1};
    trace_t t = {kind, id, size, stream, 3};
    vram_replay_result_t r;
    CHECK_OK(replay(&t, GiB, NULL, NULL, &r));
    CHECK(r.num_device_alloc == 1 && r.peak_reserved == 12 * MiB);
    /* A use of an id that is not live is bad input, named. */
    uint8_t bad_kind[] = {A, F, U};
    int64_t bad_id[] = {0, 0, 0};
    trace_t bad = {bad_kind, bad_id, size, stream, 3};
    CHECK(replay(&bad, GiB, NULL, NULL, &r) == VRAM_ERR_INVALID_ARG);
    CHECK(strstr(vram_last_error(), "trace event 2: use of id 0 on a stream, which is not allocated (it was freed)"));
    bad_kind[0] = U;
    CHECK(replay(&bad, GiB, NULL, NULL, &r) == VRAM_ERR_INVALID_ARG);
    CHECK(strstr(vram_last_error(), "trace event 0: use of id 0 on a stream, which is not allocated"));
}

/* 64 MiB device: 30 MiB + 30 MiB segments, then 10 MiB does not fit (nothing is cached to
 * release), so event 2 raises OOM and the replay stops there. */
static int replay_ooms_seen; /* a replay's OOM is its answer, not an event for the OOM callback */
static void count_oom(const vram_oom_info_t *info, const char *message) {
    (void)info;
    (void)message;
    replay_ooms_seen++;
}

static void test_oom_stops_at_the_event(void) {
    uint8_t kind[] = {A, A, A, F, A};
    int64_t id[] = {0, 1, 2, 0, 3};
    uint64_t size[] = {30 * MiB, 30 * MiB, 10 * MiB, 0, 100};
    trace_t t = {kind, id, size, NULL, 5};
    outs_t o = outs_new(t.n);
    vram_replay_result_t r;
    vram_set_oom_callback(count_oom);
    CHECK_OK(replay(&t, 64 * MiB, NULL, &o, &r));
    vram_set_oom_callback(NULL);
    CHECK(replay_ooms_seen == 0);
    CHECK(r.oom_event == 2 && r.events == 3);
    CHECK(r.num_ooms == 1 && r.num_alloc_retries == 1);
    CHECK(r.peak_reserved == 60 * MiB && r.peak_reserved_event == 1);
    CHECK(r.peak_allocated == 60 * MiB && r.peak_allocated_event == 1);
    CHECK(r.final_allocated == 60 * MiB && r.final_reserved == 60 * MiB);
    CHECK(o.reserved[2] == 60 * MiB && o.allocated[2] == 60 * MiB && o.addr[2] == 0);
    CHECK(o.reserved[3] == SENTINEL && o.allocated[3] == SENTINEL && o.addr[3] == SENTINEL);
    CHECK(o.reserved[4] == SENTINEL);
    CHECK_CONTAINS(vram_last_error(), "Tried to allocate 10.00 MiB");
    CHECK_CONTAINS(vram_last_error(), "out of memory");
    CHECK_CONTAINS(vram_last_error(), "sim:-1");
    vram_oom_info_t info;
    vram_last_oom(&info);
    CHECK(info.requested == 10 * MiB && info.segment_size == 10 * MiB);
    CHECK(info.device_total == 64 * MiB && info.reserved == 60 * MiB && info.allocated == 60 * MiB);
    CHECK(info.device_kind == VRAM_DEVICE_SIM && info.device_index == -1);
    outs_free(o);
}

/* Under pressure the pool releases its cached 30 MiB segment before mapping 40 MiB: reserved
 * never reaches 70 MiB, and the peak is 40 MiB at event 2. */
static void test_release_under_pressure_is_not_a_peak(void) {
    uint8_t kind[] = {A, F, A};
    int64_t id[] = {0, 0, 1};
    uint64_t size[] = {30 * MiB, 0, 40 * MiB};
    trace_t t = {kind, id, size, NULL, 3};
    outs_t o = outs_new(t.n);
    vram_replay_result_t r;
    CHECK_OK(replay(&t, 64 * MiB, NULL, &o, &r));
    CHECK(r.oom_event == -1 && r.events == 3 && r.num_ooms == 0);
    CHECK(o.reserved[0] == 30 * MiB && o.reserved[1] == 30 * MiB && o.reserved[2] == 40 * MiB);
    CHECK(r.peak_reserved == 40 * MiB && r.peak_reserved_event == 2);
    CHECK(r.num_device_alloc == 2 && r.num_device_free == 1 && r.num_alloc_retries == 1);
    outs_free(o);
}

/* 100 MiB freed, then 30 MiB: by default the cached 100 MiB block is split (reserved stays
 * 100 MiB); with max_split_size_mb:64 it is oversize, not given to a smaller request, and a
 * 30 MiB segment is mapped (130 MiB). A bad conf is INVALID_ARG. */
static void test_conf_changes_the_peak(void) {
    uint8_t kind[] = {A, F, A};
    int64_t id[] = {0, 0, 1};
    uint64_t size[] = {100 * MiB, 0, 30 * MiB};
    trace_t t = {kind, id, size, NULL, 3};
    vram_replay_result_t r;
    CHECK_OK(replay(&t, 8 * GiB, NULL, NULL, &r));
    CHECK(r.peak_reserved == 100 * MiB && r.peak_reserved_event == 0 && r.num_device_alloc == 1);
    CHECK_OK(replay(&t, 8 * GiB, "max_split_size_mb:64", NULL, &r));
    CHECK(r.peak_reserved == 130 * MiB && r.peak_reserved_event == 2 && r.num_device_alloc == 2);
    /* NULL means defaults: VRAMKIT_ALLOC_CONF is not read. */
    setenv("VRAMKIT_ALLOC_CONF", "max_split_size_mb:64", 1);
    CHECK_OK(replay(&t, 8 * GiB, NULL, NULL, &r));
    CHECK(r.peak_reserved == 100 * MiB);
    unsetenv("VRAMKIT_ALLOC_CONF");
    vram_replay_result_t untouched;
    memset(&untouched, 0x5A, sizeof untouched);
    r = untouched;
    CHECK_STATUS(replay(&t, 8 * GiB, "max_split_size_mb:5", NULL, &r), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "trace replay conf");
    CHECK_STATUS(replay(&t, 8 * GiB, "bogus_option:1", NULL, &r), VRAM_ERR_INVALID_ARG);
    CHECK(memcmp(&r, &untouched, sizeof r) == 0);
}

/* One bad trace: INVALID_ARG, the message has every expected piece, and neither the outputs
 * nor the result were written. */
static void expect_bad(const uint8_t *kind, const int64_t *id, const uint64_t *size, size_t n, const char *want1,
                       const char *want2) {
    outs_t o = outs_new(n);
    vram_replay_result_t r, untouched;
    memset(&untouched, 0x5A, sizeof untouched);
    r = untouched;
    CHECK_STATUS(vram_trace_replay(kind, id, size, NULL, n, GiB, NULL, o.reserved, o.allocated, o.addr, &r),
                 VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), want1);
    CHECK_CONTAINS(vram_last_error(), want2);
    CHECK(memcmp(&r, &untouched, sizeof r) == 0);
    for (size_t i = 0; i < n; i++) CHECK(o.reserved[i] == SENTINEL && o.allocated[i] == SENTINEL && o.addr[i] == SENTINEL);
    outs_free(o);
}

static void test_bad_input_rules(void) {
    {
        uint8_t k[] = {A, F};
        int64_t i[] = {0, 1};
        uint64_t s[] = {100, 0};
        expect_bad(k, i, s, 2, "trace event 1: free of id 1, which is not allocated", "");
    }
    {
        uint8_t k[] = {A, F, M, F};
        int64_t i[] = {0, 0, 0, 0};
        uint64_t s[] = {100, 0, 0, 0};
        expect_bad(k, i, s, 4, "trace event 3: free of id 0, which is not allocated", "freed at event 1");
    }
    {
        uint8_t k[] = {A, A};
        int64_t i[] = {3, 3};
        uint64_t s[] = {100, 100};
        expect_bad(k, i, s, 2, "trace event 1: alloc of id 3, which is already allocated", "at event 0");
    }
    {
        uint8_t k[] = {A, F, A};
        int64_t i[] = {2, 2, 2};
        uint64_t s[] = {0, 0, 100};
        expect_bad(k, i, s, 3, "trace event 2: alloc of id 2, which was already used", "freed at event 1");
    }
    {
        uint8_t k[] = {A, F};
        int64_t i[] = {0, -1};
        uint64_t s[] = {100, 0};
        expect_bad(k, i, s, 2, "trace event 1: free of id -1", "ids must be >= 0");
    }
    {
        uint8_t k[] = {A, A};
        int64_t i[] = {0, -7};
        uint64_t s[] = {100, 100};
        expect_bad(k, i, s, 2, "trace event 1: alloc of id -7", "ids must be >= 0");
    }
    {
        uint8_t k[] = {A, A};
        int64_t i[] = {0, 1};
        uint64_t s[] = {100, VRAM_MAX_REQUEST};
        expect_bad(k, i, s, 2, "trace event 1: alloc of id 1, size 4611686018427387904", "2**62");
    }
    { /* the first bad event wins, whichever pass finds it: a state error before an id < 0 ... */
        uint8_t k[] = {A, F, F, A};
        int64_t i[] = {0, 0, 0, -1};
        uint64_t s[] = {100, 0, 0, 100};
        expect_bad(k, i, s, 4, "trace event 2: free of id 0", "freed at event 1");
    }
    { /* ... and an id < 0 before a state error; a huge id after it does not size the tables */
        uint8_t k[] = {A, A, F, A};
        int64_t i[] = {0, -1, 5, INT64_MAX};
        uint64_t s[] = {100, 100, 0, 100};
        expect_bad(k, i, s, 4, "trace event 1: alloc of id -1", "ids must be >= 0");
    }

    /* Arguments. */
    uint8_t k[] = {A};
    int64_t i[] = {0};
    uint64_t s[] = {100};
    vram_replay_result_t r;
    CHECK_STATUS(vram_trace_replay(k, i, s, NULL, 1, 0, NULL, NULL, NULL, NULL, &r), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "capacity");
    CHECK_STATUS(vram_trace_replay(k, i, s, NULL, 1, VRAM_MAX_REQUEST, NULL, NULL, NULL, NULL, &r),
                 VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_trace_replay(NULL, i, s, NULL, 1, GiB, NULL, NULL, NULL, NULL, &r), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "kind is NULL");
    CHECK_STATUS(vram_trace_replay(k, NULL, s, NULL, 1, GiB, NULL, NULL, NULL, NULL, &r), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "id is NULL");
    CHECK_STATUS(vram_trace_replay(k, i, NULL, NULL, 1, GiB, NULL, NULL, NULL, NULL, &r), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "size is NULL");
    CHECK_STATUS(vram_trace_replay(k, i, s, NULL, 1, GiB, NULL, NULL, NULL, NULL, NULL), VRAM_ERR_INVALID_ARG);
    /* An empty trace needs no columns. */
    CHECK_OK(vram_trace_replay(NULL, NULL, NULL, NULL, 0, GiB, NULL, NULL, NULL, NULL, &r));
    CHECK(r.events == 0 && r.peak_allocated_event == -1 && r.peak_reserved_event == -1 && r.oom_event == -1);
    CHECK(r.peak_reserved == 0 && r.num_device_alloc == 0);
}

/* Size-0 allocations are live ids without a block: nothing is ever allocated or reserved, and
 * freeing them changes nothing. Markers carry any id and size. */
static void test_zero_sizes_and_markers(void) {
    uint8_t kind[] = {A, M, 255, F, A, 2};
    int64_t id[] = {0, -5, INT64_MAX, 0, 1, 0};
    uint64_t size[] = {0, UINT64_MAX, 7, 123, 0, UINT64_MAX};
    trace_t t = {kind, id, size, NULL, 6};
    outs_t o = outs_new(t.n);
    vram_replay_result_t r;
    CHECK_OK(replay(&t, GiB, NULL, &o, &r));
    CHECK(r.events == 6 && r.oom_event == -1);
    CHECK(r.peak_allocated == 0 && r.peak_allocated_event == -1);
    CHECK(r.peak_reserved == 0 && r.peak_reserved_event == -1 && r.peak_requested == 0);
    CHECK(r.num_device_alloc == 0 && r.final_reserved == 0);
    for (size_t i = 0; i < t.n; i++) CHECK(o.reserved[i] == 0 && o.allocated[i] == 0 && o.addr[i] == 0);
    outs_free(o);
}

/* Ids need not be dense: the tables are calloc'd and only touched where ids occur. Ids too large
 * to tabulate are VRAM_ERR_HOST_MEMORY, saying why, and change nothing. */
static void test_sparse_and_huge_ids(void) {
    uint8_t kind[] = {A, A, F, F};
    int64_t id[] = {(int64_t)1 << 26, 3, 3, (int64_t)1 << 26};
    uint64_t size[] = {100, 200, 0, 0};
    trace_t t = {kind, id, size, NULL, 4};
    vram_replay_result_t r;
    CHECK_OK(replay(&t, GiB, NULL, NULL, &r));
    CHECK(r.peak_allocated == 1024 && r.peak_allocated_event == 1 && r.final_allocated == 0);
    id[0] = id[3] = INT64_MAX;
    outs_t o = outs_new(t.n);
    CHECK_STATUS(replay(&t, GiB, NULL, &o, &r), VRAM_ERR_HOST_MEMORY);
    CHECK_CONTAINS(vram_last_error(), "dense");
    CHECK(o.reserved[0] == SENTINEL && o.addr[3] == SENTINEL);
    outs_free(o);
}

static uint64_t rng_state = 0x9E3779B97F4A7C15u;
static uint64_t next_rand(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1Du;
}

/* A random trace (sizes 0 B .. 300 MiB, two streams, markers, ids in a shuffled order) replayed
 * by vram_trace_replay and, event by event, by vram_malloc/vram_free on a stand-alone sim pool:
 * the per-event reserved and allocated bytes, the address offsets and the peaks agree. */
static void test_columns_match_step_by_step(void) {
    enum { N = 30000 };
    const char *confs[] = {NULL, "max_split_size_mb:64", "garbage_collection_threshold:0.6"};
    const uint64_t capacities[] = {14 * GiB, 7 * GiB, 5 * GiB};
    for (size_t run = 0; run < 3 * sizeof confs / sizeof confs[0]; run++) {
        size_t c = run / 3;
        /* Roomy, tight (the OOM ladder releases cached segments), too small (OOM). */
        uint64_t capacity = capacities[run % 3];
        trace_t t = {malloc(N), malloc(N * 8), malloc(N * 8), malloc(N * 8), N};
        int64_t *live = malloc(N * 8);
        size_t num_live = 0;
        int64_t next_id = 0;
        for (size_t i = 0; i < N; i++) {
            uint64_t x = next_rand();
            t.stream[i] = (x >> 7) % 2;
            t.size[i] = 0;
            if (x % 50 == 0) {
                t.kind[i] = (uint8_t)(2 + x % 100);
                t.id[i] = -1;
            } else if (num_live && (x % 100 < 45 || num_live > 150)) {
                size_t j = (x >> 20) % num_live;
                t.kind[i] = F;
                t.id[i] = live[j];
                live[j] = live[--num_live];
            } else {
                uint64_t band = (x >> 32) % 10;
                uint64_t y = next_rand();
                t.kind[i] = A;
                t.id[i] = (next_id++ * 7919) % 1000003; /* distinct, not in order */
                t.size[i] = band == 0 ? 0 : band < 6 ? y % MiB : band < 9 ? y % (10 * MiB) : y % (300 * MiB);
                live[num_live++] = t.id[i];
            }
        }
        outs_t o = outs_new(N);
        vram_replay_result_t r;
        CHECK_OK(replay(&t, capacity, confs[c], &o, &r));

        vram_pool_t *pool = make_sim_pool(capacity, confs[c]);
        void **ptrs = calloc(1000003, sizeof *ptrs);
        uint64_t base = 0, mismatches = 0, peak_res = 0;
        int64_t oom_at = -1;
        size_t i;
        for (i = 0; i < N; i++) {
            void *p = NULL;
            if (t.kind[i] == A) {
                vram_status_t st = vram_malloc(pool, t.size[i], t.stream[i], 0, &p);
                if (st == VRAM_ERR_OOM) oom_at = (int64_t)i;
                else CHECK_OK(st);
                ptrs[t.id[i]] = p;
                if (p && !base) base = (uint64_t)(uintptr_t)p;
            } else if (t.kind[i] == F) {
                CHECK_OK(vram_free(pool, ptrs[t.id[i]], 0));
            }
            vram_stats_t s = get_stats(pool);
            uint64_t addr = p ? (uint64_t)(uintptr_t)p - base + SIM_BASE : 0;
            mismatches += o.reserved[i] != (uint64_t)s.reserved_bytes[VRAM_STAT_ALL].current;
            mismatches += o.allocated[i] != (uint64_t)s.allocated_bytes[VRAM_STAT_ALL].current;
            mismatches += o.addr[i] != addr;
            if ((uint64_t)s.reserved_bytes[VRAM_STAT_ALL].current > peak_res)
                peak_res = (uint64_t)s.reserved_bytes[VRAM_STAT_ALL].current;
            if (oom_at >= 0) break;
        }
        CHECK(mismatches == 0);
        CHECK(r.oom_event == oom_at);
        CHECK(r.events == (oom_at >= 0 ? (uint64_t)oom_at + 1 : (uint64_t)N));
        vram_stats_t s = get_stats(pool);
        CHECK(r.peak_reserved == peak_res && r.peak_reserved == (uint64_t)s.reserved_bytes[VRAM_STAT_ALL].peak);
        CHECK(r.peak_allocated == (uint64_t)s.allocated_bytes[VRAM_STAT_ALL].peak);
        CHECK(r.peak_requested == (uint64_t)s.requested_bytes[VRAM_STAT_ALL].peak);
        CHECK(r.num_device_alloc == (uint64_t)s.num_device_alloc && r.num_device_free == (uint64_t)s.num_device_free);
        CHECK(r.num_alloc_retries == (uint64_t)s.num_alloc_retries && r.num_ooms == (uint64_t)s.num_ooms);
        CHECK(r.final_reserved == (uint64_t)s.reserved_bytes[VRAM_STAT_ALL].current);
        CHECK(o.reserved[r.peak_reserved_event] == r.peak_reserved);
        CHECK(o.allocated[r.peak_allocated_event] == r.peak_allocated);
        CHECK(o.reserved[r.peak_allocated_event] == r.reserved_at_peak_allocated);
        for (int64_t e = 0; e < r.peak_reserved_event; e++) CHECK(o.reserved[e] < r.peak_reserved);
        CHECK_POOL(pool);
        printf("  %2llu GiB, conf %s: %llu events, peak reserved %llu MiB, %llu device allocs, %llu frees, %llu retries, oom at %lld\n",
               (unsigned long long)(capacity / GiB), confs[c] ? confs[c] : "(default)", (unsigned long long)r.events,
               (unsigned long long)(r.peak_reserved / MiB), (unsigned long long)r.num_device_alloc,
               (unsigned long long)r.num_device_free, (unsigned long long)r.num_alloc_retries, (long long)r.oom_event);
        vram_pool_destroy(pool);
        free(ptrs);
        free(live);
        outs_free(o);
        free(t.kind);
        free(t.id);
        free(t.size);
        free(t.stream);
    }
}

/* Every allocation maps a new segment when each differs from the cached block by more than
 * max_non_split_rounding (20 MiB) and max_split_size makes both oversize: a smaller request
 * may not split the cached block, a larger one does not fit, and the two do not fit on the
 * device together, so the cached one is released first. */
#define CHURN_CONF "max_split_size_mb:1024"

/* 16 allocations of 60..63 GiB on an 80 GiB device, each freed before the next: one replay
 * draws 966 GiB of addresses, and 10,000 replays 9.2 PiB, more than the shared range's 8 PiB.
 * With private ranges every replay starts again at 2^48, and simulated devices keep theirs. */
static void test_repeated_replays_keep_address_space(void) {
    enum { ALLOCS = 16, REPLAYS = 10000 };
    uint8_t kind[2 * ALLOCS];
    int64_t id[2 * ALLOCS];
    uint64_t size[2 * ALLOCS];
    for (int j = 0; j < ALLOCS; j++) {
        kind[2 * j] = A, kind[2 * j + 1] = F;
        id[2 * j] = id[2 * j + 1] = j;
        size[2 * j] = (60 + (uint64_t)(j % 4)) * GiB, size[2 * j + 1] = 0;
    }
    trace_t t = {kind, id, size, NULL, 2 * ALLOCS};
    uint64_t addr[2 * ALLOCS];
    int failures = 0, wrong = 0;
    for (int k = 0; k < REPLAYS; k++) {
        vram_replay_result_t r;
        vram_status_t st = vram_trace_replay(t.kind, t.id, t.size, NULL, t.n, 80 * GiB, CHURN_CONF, NULL, NULL, addr, &r);
        failures += st != VRAM_OK;
        wrong += st == VRAM_OK && (r.oom_event != -1 || r.num_device_alloc != ALLOCS ||
                                   r.num_device_free != ALLOCS - 1 || addr[0] != SIM_BASE);
        if (st != VRAM_OK && failures == 1) fprintf(stderr, "replay %d: %s\n", k, vram_last_error());
    }
    CHECK(failures == 0 && wrong == 0);
    /* A simulated device still gets its segments. */
    vram_pool_t *pool = make_sim_pool(80 * GiB, NULL);
    void *p = NULL;
    CHECK_OK(vram_malloc(pool, 64 * GiB, 0, 0, &p));
    CHECK(p != NULL);
    CHECK_OK(vram_free(pool, p, 0));
    vram_pool_destroy(pool);
}

/* One replay may itself draw more than the shared range holds: 300,000 alternating 60/61 GiB
 * allocations, each mapping a new segment, are 17.6 PiB of addresses. */
static void test_one_replay_beyond_the_shared_range(void) {
    enum { ALLOCS = 150000 };
    trace_t t = {malloc(2 * ALLOCS), malloc(2 * ALLOCS * 8), malloc(2 * ALLOCS * 8), NULL, 2 * ALLOCS};
    for (size_t j = 0; j < ALLOCS; j++) {
        t.kind[2 * j] = A, t.kind[2 * j + 1] = F;
        t.id[2 * j] = t.id[2 * j + 1] = (int64_t)j;
        t.size[2 * j] = (60 + j % 2) * GiB, t.size[2 * j + 1] = 0;
    }
    vram_replay_result_t r;
    CHECK_OK(replay(&t, 80 * GiB, CHURN_CONF, NULL, &r));
    CHECK(r.oom_event == -1 && r.num_device_alloc == ALLOCS && r.num_device_free == ALLOCS - 1);
    CHECK(r.peak_reserved == 61 * GiB && r.peak_reserved_event == 2);
    free(t.kind);
    free(t.id);
    free(t.size);
}

int main(void) {
    RUN(test_hand_trace_peaks_and_columns);
    RUN(test_stream_column);
    RUN(test_stream_uses_wait_for_a_synchronize);
    RUN(test_oom_stops_at_the_event);
    RUN(test_release_under_pressure_is_not_a_peak);
    RUN(test_conf_changes_the_peak);
    RUN(test_bad_input_rules);
    RUN(test_zero_sizes_and_markers);
    RUN(test_sparse_and_huge_ids);
    RUN(test_columns_match_step_by_step);
    RUN(test_repeated_replays_keep_address_space);
    RUN(test_one_replay_beyond_the_shared_range);
    return harness_finish();
}
