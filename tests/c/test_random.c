/* test_random.c — randomized operations against a plain model, with vram_pool_check after
 * every step. The model knows what must be live (sizes, streams, streams still using freed
 * blocks) and checks the allocator's counters, that live ranges never overlap, that a block
 * is only ever reused on its own stream and never while another stream may use it, and (on
 * the cpu pool) that the bytes of every live block survive all other operations.
 *
 * Usage: test_random [ops] [seed]. Runs on a small simulated device (so OOM and the release
 * paths are exercised) and on the real cpu pool, each with classic and with expandable
 * segments. */
#include <stdint.h>
#include <stdlib.h>

#include "harness.h"

#define MAX_LIVE 256

typedef struct live {
    uintptr_t addr;
    uint64_t size, requested;
    vram_stream_t stream;
    unsigned char tag;
} live_t;

typedef struct pending {
    uintptr_t addr;
    uint64_t size, requested;
    vram_stream_t stream, waits_on;
} pending_t;

typedef struct model {
    live_t live[MAX_LIVE];
    int num_live;
    pending_t pending[4096];
    int num_pending;
    int64_t requested_total, allocated_total, pending_bytes;
} model_t;

static uint64_t rng_state;
static uint64_t next_random(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static uint64_t random_size(void) {
    /* Log-uniform from 1 B to 64 MiB, so both pools and every segment rule get traffic. */
    unsigned bits = (unsigned)(next_random() % 27);
    return 1 + next_random() % ((uint64_t)1 << bits);
}

static uint64_t rounded(uint64_t size) { return size < 512 ? 512 : (size + 511) / 512 * 512; }

static int overlaps(uintptr_t a, uint64_t an, uintptr_t b, uint64_t bn) { return a < b + bn && b < a + an; }

static void drop_pending_of(model_t *m, vram_stream_t stream) {
    /* A synchronized stream releases every block waiting only on it (one use per block here). */
    for (int i = 0; i < m->num_pending;) {
        if (stream == VRAM_ALL_STREAMS || m->pending[i].waits_on == stream) {
            m->pending_bytes -= (int64_t)m->pending[i].size;
            m->requested_total -= (int64_t)m->pending[i].requested;
            m->pending[i] = m->pending[--m->num_pending];
        } else {
            i++;
        }
    }
}

static int check_counters(vram_pool_t *pool, const model_t *m) {
    vram_stats_t s = get_stats(pool);
    int ok = s.allocation[VRAM_STAT_ALL].current == m->num_live &&
             s.allocated_bytes[VRAM_STAT_ALL].current == m->allocated_total &&
             s.active[VRAM_STAT_ALL].current == m->num_live + m->num_pending &&
             s.active_bytes[VRAM_STAT_ALL].current == m->allocated_total + m->pending_bytes &&
             s.requested_bytes[VRAM_STAT_ALL].current == m->requested_total &&
             s.reserved_bytes[VRAM_STAT_ALL].current >= s.active_bytes[VRAM_STAT_ALL].current;
    if (!ok)
        fprintf(stderr, "counters differ from the model: live %d/%lld, allocated %lld/%lld, active %lld/%d\n",
                m->num_live, (long long)s.allocation[VRAM_STAT_ALL].current, (long long)m->allocated_total,
                (long long)s.allocated_bytes[VRAM_STAT_ALL].current, (long long)s.active[VRAM_STAT_ALL].current,
                m->num_live + m->num_pending);
    return ok;
}

static int verify_bytes(const live_t *l) {
    const unsigned char *p = (const unsigned char *)l->addr;
    for (uint64_t i = 0; i < l->requested; i += 4093)
        if (p[i] != l->tag) return 0;
    return p[l->requested - 1] == l->tag;
}

static void run(vram_pool_t *pool, long ops, int touch_memory) {
    static model_t m;
    memset(&m, 0, sizeof m);
    long violations = 0, ooms = 0;
    for (long op = 0; op < ops && violations < 5; op++) {
        uint64_t r = next_random() % 100;
        if (r < 45 && m.num_live < MAX_LIVE) { /* alloc */
            uint64_t size = random_size();
            vram_stream_t stream = next_random() % 3;
            void *p = NULL;
            int64_t syncs = get_stats(pool).num_sync_all_streams;
            vram_status_t st = vram_malloc(pool, size, stream, 0, &p);
            /* Under memory pressure malloc waits on every outstanding event before it
             * releases the cache (PyTorch's release_cached_blocks): all pending blocks return. */
            if (get_stats(pool).num_sync_all_streams != syncs) drop_pending_of(&m, VRAM_ALL_STREAMS);
            if (st == VRAM_ERR_OOM) {
                ooms++;
            } else if (st != VRAM_OK || !p) {
                fprintf(stderr, "op %ld: malloc(%llu) failed: %s\n", op, (unsigned long long)size, vram_last_error());
                violations++;
            } else {
                vram_block_info_t info;
                CHECK_OK(vram_block_query(pool, p, &info));
                if (info.size < rounded(size) || info.requested_size != size || info.stream != stream) violations++;
                for (int i = 0; i < m.num_live; i++)
                    if (overlaps((uintptr_t)p, info.size, m.live[i].addr, m.live[i].size)) {
                        fprintf(stderr, "op %ld: new block overlaps a live one\n", op);
                        violations++;
                    }
                for (int i = 0; i < m.num_pending; i++)
                    if (overlaps((uintptr_t)p, info.size, m.pending[i].addr, m.pending[i].size)) {
                        fprintf(stderr, "op %ld: reused a block another stream may still use\n", op);
                        violations++;
                    }
                live_t *l = &m.live[m.num_live++];
                *l = (live_t){(uintptr_t)p, info.size, size, stream, (unsigned char)(next_random() | 1)};
                if (touch_memory) memset(p, l->tag, size);
                m.allocated_total += (int64_t)info.size;
                m.requested_total += (int64_t)size;
            }
        } else if (r < 88 && m.num_live > 0) { /* free, sometimes after record_stream */
            int i = (int)(next_random() % (uint64_t)m.num_live);
            live_t l = m.live[i];
            if (touch_memory && !verify_bytes(&l)) {
                fprintf(stderr, "op %ld: a live block's bytes were overwritten\n", op);
                violations++;
            }
            vram_stream_t other = 3 + next_random() % 2;
            int use_other = next_random() % 4 == 0 && m.num_pending < 4000;
            if (use_other) CHECK_OK(vram_record_stream(pool, (void *)l.addr, other));
            CHECK_OK(vram_free(pool, (void *)l.addr, 0));
            m.live[i] = m.live[--m.num_live];
            m.allocated_total -= (int64_t)l.size;
            if (use_other) {
                m.pending[m.num_pending++] = (pending_t){l.addr, l.size, l.requested, l.stream, other};
                m.pending_bytes += (int64_t)l.size;
            } else {
                m.requested_total -= (int64_t)l.requested;
            }
        } else if (r < 93) { /* a stream finishes its work */
            vram_stream_t s = 3 + next_random() % 2;
            CHECK_OK(vram_pool_synchronize(pool, s));
            drop_pending_of(&m, s);
        } else if (r < 95) {
            CHECK_OK(vram_empty_cache(pool, NULL));
            drop_pending_of(&m, VRAM_ALL_STREAMS);
        } else if (r < 97) { /* bad input changes nothing */
            vram_stats_t before = get_stats(pool);
            void *p = NULL;
            CHECK_STATUS(vram_free(pool, (void *)(uintptr_t)0x7, 0), VRAM_ERR_INVALID_ARG);
            CHECK_STATUS(vram_malloc(pool, (uint64_t)1 << 62, 0, 0, &p), VRAM_ERR_INVALID_ARG);
            vram_stats_t after = get_stats(pool);
            if (memcmp(&before, &after, sizeof before) != 0) violations++;
        } else { /* limits change */
            uint64_t limits[] = {VRAM_NO_LIMIT, 64 * MiB, 256 * MiB, 1 * GiB};
            CHECK_OK(vram_set_memory_limit(pool, limits[next_random() % 4]));
        }
        if (vram_pool_check(pool) != VRAM_OK) {
            fprintf(stderr, "op %ld: pool check failed: %s\n", op, vram_last_error());
            violations++;
        }
        if (!check_counters(pool, &m)) violations++;
    }
    for (int i = 0; i < m.num_live; i++) CHECK_OK(vram_free(pool, (void *)m.live[i].addr, 0));
    CHECK_OK(vram_empty_cache(pool, NULL));
    vram_stats_t s = get_stats(pool);
    CHECK(s.reserved_bytes[VRAM_STAT_ALL].current == 0 && s.active[VRAM_STAT_ALL].current == 0);
    CHECK_POOL(pool);
    CHECK(violations == 0);
    printf("  %ld ops, %ld OOMs, %ld violations\n", ops, ooms, violations);
}

int main(int argc, char **argv) {
    long ops = argc > 1 ? atol(argv[1]) : 100000;
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 10) : 0x5EED1234ABCDull;
    if (!rng_state) rng_state = 1;
    /* Each pool twice: the classic policy, then expandable segments (PyTorch's pages of 20 MiB
     * on the simulated device; on the cpu pool 2 MiB pages, unmapped when a free block of
     * 4 MiB or more appears, so live bytes next to unmapped pages are checked too). */
    const char *sim_confs[] = {NULL, "expandable_segments:True"};
    const char *cpu_confs[] = {"max_split_size_mb:32", "max_split_size_mb:32,expandable_segments:True,host_page_release_mb:4"};
    for (int e = 0; e < 2; e++) {
        printf("%s\n", e ? "expandable segments:" : "classic segments:");
        vram_pool_t *sim = make_sim_pool(1536 * MiB, sim_confs[e]);
        run(sim, ops, 0);
        vram_pool_destroy(sim);
        void *ctx;
        vram_pool_t *cpu = NULL;
        CHECK_OK(vram_backend_cpu_ctx(&ctx));
        CHECK_OK(vram_pool_create(vram_backend_cpu(), ctx, (vram_device_t){VRAM_DEVICE_CPU, 0, 0}, cpu_confs[e], &cpu));
        CHECK_OK(vram_set_memory_limit(cpu, 512 * MiB));
        run(cpu, ops / 4, 1);
        vram_pool_destroy(cpu);
    }
    return harness_finish();
}
