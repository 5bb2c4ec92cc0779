/* test_api.c — the rest of the public C API: device names, the registry, the cpu backend's
 * real memory, history, snapshots, the summary table and message formatting. */
#include <stdint.h>
#include <stdlib.h>

#include "harness.h"

static void test_device_names(void) {
    vram_device_t d;
    char buf[32];
    CHECK_OK(vram_device_parse("cpu", &d));
    CHECK(d.kind == VRAM_DEVICE_CPU && d.index == 0);
    CHECK_OK(vram_device_parse("cuda", &d));
    CHECK(d.kind == VRAM_DEVICE_CUDA && d.index == 0);
    CHECK_OK(vram_device_parse("cuda:3", &d));
    CHECK(d.kind == VRAM_DEVICE_CUDA && d.index == 3);
    vram_device_format(d, buf, sizeof buf);
    CHECK(!strcmp(buf, "cuda:3"));
    CHECK_OK(vram_device_parse("sim:12", &d));
    CHECK(d.kind == VRAM_DEVICE_SIM && d.index == 12);
    vram_device_format(d, buf, sizeof buf);
    CHECK(!strcmp(buf, "sim:12"));
    const char *bad[] = {"", "gpu", "cuda:", "cuda:-1", "cuda:1x", "sim", "sim:", "CPU", "cuda:+1", "sim: 1"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_STATUS(vram_device_parse(bad[i], &d), VRAM_ERR_INVALID_ARG);
        CHECK_CONTAINS(vram_last_error(), "use 'cpu', 'cuda', 'cuda:N' or 'sim:N'");
    }
    CHECK_STATUS(vram_device_parse(NULL, &d), VRAM_ERR_INVALID_ARG);
}

static void test_status_and_format(void) {
    CHECK(!strcmp(vram_status_name(VRAM_OK), "VRAM_OK"));
    CHECK(!strcmp(vram_status_name(VRAM_ERR_OOM), "VRAM_ERR_OOM"));
    CHECK(!strcmp(vram_status_name(VRAM_ERR_CORRUPT), "VRAM_ERR_CORRUPT"));
    CHECK(!strcmp(vram_status_name((vram_status_t)99), "VRAM_ERR_UNKNOWN"));
    char buf[32];
    struct {
        uint64_t bytes;
        const char *text;
    } cases[] = {{0, "0 bytes"},           {512, "512 bytes"},         {1024, "1024 bytes"},
                 {1025, "1.00 KiB"},       {1536, "1.50 KiB"},         {MiB, "1024.00 KiB"},
                 {2 * MiB, "2.00 MiB"},    {20 * MiB, "20.00 MiB"},    {GiB, "1024.00 MiB"},
                 {GiB + GiB / 2, "1.50 GiB"}, {80 * GiB, "80.00 GiB"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        vram_format_size(cases[i].bytes, buf, sizeof buf);
        CHECK(!strcmp(buf, cases[i].text));
    }
}

static void test_registry(void) {
    vram_pool_t *cpu = NULL, *again = NULL, *sim = NULL, *found = NULL, *none = (vram_pool_t *)1;
    CHECK_OK(vram_device_pool((vram_device_t){VRAM_DEVICE_CPU, 0, 0}, &cpu));
    CHECK_OK(vram_device_pool((vram_device_t){VRAM_DEVICE_CPU, 0, 0}, &again));
    CHECK(cpu != NULL && cpu == again); /* one pool per device */
    int before = vram_sim_count();
    vram_device_t d;
    CHECK_OK(vram_sim_create(GiB, &d));
    CHECK(d.kind == VRAM_DEVICE_SIM && d.index == before && vram_sim_count() == before + 1);
    CHECK_OK(vram_device_pool(d, &sim));
    CHECK(vram_pool_device(sim).index == d.index);
    CHECK_STATUS(vram_sim_create(0, &d), VRAM_ERR_INVALID_ARG);
    CHECK_STATUS(vram_sim_create((uint64_t)1 << 62, &d), VRAM_ERR_INVALID_ARG);
    CHECK(vram_sim_count() == before + 1);
    CHECK_STATUS(vram_device_pool((vram_device_t){VRAM_DEVICE_SIM, 9999, 0}, &none), VRAM_ERR_UNAVAILABLE);
    CHECK_CONTAINS(vram_last_error(), "vramkit.sim.create");
    CHECK(none == NULL);
    if (vram_cuda_device_count() == 0) {
        CHECK_STATUS(vram_device_pool((vram_device_t){VRAM_DEVICE_CUDA, 0, 0}, &none), VRAM_ERR_UNAVAILABLE);
        CHECK_CONTAINS(vram_last_error(), "cuda:0 is not available");
    }
    void *p, *q;
    CHECK_OK(vram_malloc(sim, 3000, 0, 0, &p));
    CHECK_OK(vram_malloc(cpu, 3000, 0, 0, &q));
    CHECK_OK(vram_find_pool(p, &found));
    CHECK(found == sim);
    CHECK_OK(vram_find_pool(q, &found));
    CHECK(found == cpu);
    CHECK_STATUS(vram_find_pool((void *)0x10, &found), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "not a live allocation of vramkit on any device");
    CHECK_OK(vram_free(sim, p, 0));
    CHECK_OK(vram_free(cpu, q, 0));
    CHECK_POOL(sim);
    CHECK_POOL(cpu);
}

static void test_cpu_memory_is_real(void) {
    vram_pool_t *cpu;
    CHECK_OK(vram_device_pool((vram_device_t){VRAM_DEVICE_CPU, 0, 0}, &cpu));
    unsigned char *blocks[8];
    for (int i = 0; i < 8; i++) {
        CHECK_OK(vram_malloc(cpu, 100000 + (uint64_t)i * 7000, 0, 0, (void **)&blocks[i]));
        CHECK((uintptr_t)blocks[i] % 512 == 0);
        memset(blocks[i], 0xA0 + i, 100000 + (size_t)i * 7000);
    }
    for (int i = 0; i < 8; i++) {
        size_t n = 100000 + (size_t)i * 7000, bad = 0;
        for (size_t j = 0; j < n; j++) bad += blocks[i][j] != (unsigned char)(0xA0 + i);
        CHECK(bad == 0); /* no block overlaps another */
        CHECK_OK(vram_free(cpu, blocks[i], 0));
    }
    uint64_t free_bytes = 0, total = 0;
    CHECK_OK(vram_mem_get_info(cpu, &free_bytes, &total));
    CHECK(total > 0 && free_bytes > 0 && free_bytes <= total);
    CHECK_OK(vram_empty_cache(cpu, NULL));
    CHECK_POOL(cpu);
}

static void test_history(void) {
    vram_pool_t *pool = make_sim_pool(64 * MiB, NULL);
    void *a, *b;
    CHECK(!vram_history_enabled(pool));
    CHECK_OK(vram_malloc(pool, 1000, 0, 11, &a)); /* not recorded */
    CHECK_OK(vram_history_enable(pool, 5));
    CHECK(vram_history_enabled(pool));
    CHECK_OK(vram_free(pool, a, 12));
    uintptr_t first = (uintptr_t)a;
    CHECK_OK(vram_malloc(pool, 2 * MiB, 7, 13, &b)); /* large pool: segment_alloc then alloc */
    CHECK_STATUS(vram_malloc(pool, 100 * MiB, 7, 14, &a), VRAM_ERR_OOM);
    vram_snapshot_t *snap;
    CHECK_OK(vram_pool_snapshot(pool, &snap));
    /* 6 entries happened; the ring keeps the newest 5, oldest first. */
    uint32_t expected[] = {VRAM_TRACE_FREE_COMPLETED, VRAM_TRACE_SEGMENT_ALLOC, VRAM_TRACE_ALLOC,
                           VRAM_TRACE_SEGMENT_FREE, VRAM_TRACE_OOM};
    CHECK(snap->num_trace == 5);
    for (uint64_t i = 0; i < snap->num_trace && i < 5; i++) CHECK(snap->trace[i].action == expected[i]);
    if (snap->num_trace == 5) {
        CHECK(snap->trace[0].context == 12 && snap->trace[0].addr == first);
        CHECK(snap->trace[1].size == 20 * MiB && snap->trace[1].stream == 7 && snap->trace[1].context == 13);
        CHECK(snap->trace[2].addr == (uintptr_t)b && snap->trace[2].size == 2 * MiB);
        CHECK(snap->trace[3].size == 2 * MiB); /* the OOM path released the cached small segment */
        CHECK(snap->trace[4].size == 100 * MiB && snap->trace[4].addr == 0 && snap->trace[4].context == 14);
        CHECK(snap->trace[4].device_free == 64 * MiB - 20 * MiB);
        for (int i = 1; i < 5; i++) CHECK(snap->trace[i].time_ns >= snap->trace[i - 1].time_ns);
    }
    vram_snapshot_free(snap);
    CHECK_OK(vram_history_enable(pool, 2)); /* shrinking keeps the newest */
    CHECK_OK(vram_pool_snapshot(pool, &snap));
    CHECK(snap->num_trace == 2 && snap->trace[1].action == VRAM_TRACE_OOM);
    vram_snapshot_free(snap);
    CHECK_OK(vram_history_enable(pool, 0));
    CHECK(!vram_history_enabled(pool));
    CHECK_OK(vram_pool_snapshot(pool, &snap));
    CHECK(snap->num_trace == 0);
    vram_snapshot_free(snap);
    CHECK_STATUS(vram_history_enable(pool, ((uint64_t)1 << 32) + 1), VRAM_ERR_INVALID_ARG);
    CHECK_OK(vram_free(pool, b, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_snapshot_segments_and_blocks(void) {
    vram_pool_t *pool = make_sim_pool(GiB, NULL);
    void *a, *b, *c;
    CHECK_OK(vram_malloc(pool, 1000, 0, 21, &a));
    CHECK_OK(vram_malloc(pool, 3000, 0, 22, &b));
    CHECK_OK(vram_malloc(pool, 12 * MiB, 4, 23, &c));
    CHECK_OK(vram_record_stream(pool, b, 9));
    CHECK_OK(vram_free(pool, b, 0)); /* awaiting stream 9 */
    vram_snapshot_t *snap;
    CHECK_OK(vram_pool_snapshot(pool, &snap));
    CHECK(snap->num_segments == 2);
    CHECK(snap->device.kind == VRAM_DEVICE_SIM);
    uint64_t total_blocks = 0;
    for (uint64_t i = 0; i < snap->num_segments; i++) {
        const vram_snapshot_segment_t *s = &snap->segments[i];
        if (i > 0) CHECK(s->address > snap->segments[i - 1].address);
        uint64_t at = s->address;
        for (uint64_t j = 0; j < s->num_blocks; j++) {
            CHECK(snap->blocks[s->first_block + j].address == at); /* blocks tile the segment */
            at += snap->blocks[s->first_block + j].size;
        }
        CHECK(at == s->address + s->total_size);
        total_blocks += s->num_blocks;
        if (s->is_small) {
            CHECK(s->total_size == 2 * MiB && s->num_blocks == 3 && s->stream == 0);
            const vram_snapshot_block_t *blk = &snap->blocks[s->first_block];
            CHECK(blk[0].state == 1 && blk[0].requested_size == 1000 && blk[0].context == 21);
            CHECK(blk[1].state == 2 && blk[1].size == 3072 && blk[1].requested_size == 3000);
            CHECK(blk[2].state == 0 && blk[2].context == 0);
            CHECK(s->allocated_size == 1024 && s->active_size == 1024 + 3072 && s->requested_size == 4000);
        } else {
            CHECK(s->total_size == 12 * MiB && s->num_blocks == 1 && s->stream == 4);
            CHECK(snap->blocks[s->first_block].state == 1 && snap->blocks[s->first_block].context == 23);
        }
    }
    CHECK(total_blocks == snap->num_blocks);
    vram_snapshot_free(snap);
    CHECK_OK(vram_free(pool, a, 0));
    CHECK_OK(vram_free(pool, c, 0));
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static int count_lines(const char *text) {
    int n = 0;
    for (const char *p = text; *p; p++) n += *p == '\n';
    return n;
}

static void test_summary_layout(void) {
    vram_pool_t *pool = make_sim_pool(GiB, NULL);
    void *a;
    CHECK_OK(vram_malloc(pool, 14324 * MiB / 1000, 0, 0, &a));
    char *text = NULL;
    CHECK_OK(vram_memory_summary(pool, 0, &text));
    /* Every line is 77 characters: '|', 75 columns, '|'. */
    int lines = 0;
    for (char *line = text, *nl; (nl = strchr(line, '\n')); line = nl + 1, lines++) CHECK(nl - line == 77);
    /* 6 header lines + 9 groups x (rule + 3 rows) + 2 x (rule + row) + closing rule. */
    CHECK(lines == 6 + 9 * 4 + 2 * 2 + 1);
    CHECK_CONTAINS(text, "|                   vramkit memory summary, device sim:99                   |\n");
    /* A simulated device names itself where PyTorch's table says CUDA and GPU. */
    CHECK_CONTAINS(text, "|             sim OOMs: 0            |         sim alloc retries: 0         |\n");
    CHECK_CONTAINS(text, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n");
    CHECK_CONTAINS(text, "| Allocated memory      |  14668 KiB |  14668 KiB |  14668 KiB |      0 B   |\n");
    CHECK_CONTAINS(text, "| sim reserved memory   |  16384 KiB |  16384 KiB |  16384 KiB |      0 B   |\n");
    CHECK_CONTAINS(text, "| sim reserved segments |       1    |       1    |       1    |       0    |\n");
    CHECK_CONTAINS(text, "|       from small pool |      0 KiB |      0 KiB |      0 KiB |      0 B   |\n");
    CHECK_CONTAINS(text, "| Allocations           |       1    |       1    |       1    |       0    |\n");
    CHECK_CONTAINS(text, "| Oversize sim segments |       0    |       0    |       0    |       0    |\n");
    CHECK(strstr(text, "GPU") == NULL && strstr(text, "CUDA") == NULL && strstr(text, "cudaMalloc") == NULL);
    free(text);
    CHECK_OK(vram_memory_summary(pool, 1, &text));
    CHECK(count_lines(text) == 6 + 9 * 2 + 2 * 2 + 1);
    CHECK(strstr(text, "from large pool") == NULL);
    free(text);
    CHECK_OK(vram_free(pool, a, 0));
    vram_pool_destroy(pool);

    /* A CUDA device keeps PyTorch's words byte for byte (a sim backend standing in for CUDA). */
    void *ctx = NULL;
    CHECK_OK(vram_backend_sim_ctx(GiB, &ctx));
    CHECK_OK(vram_pool_create(vram_backend_sim(), ctx, (vram_device_t){VRAM_DEVICE_CUDA, 3, 0}, NULL, &pool));
    CHECK_OK(vram_memory_summary(pool, 0, &text));
    CHECK_CONTAINS(text, "|            CUDA OOMs: 0            |        cudaMalloc retries: 0         |\n");
    CHECK_CONTAINS(text, "| GPU reserved memory   |      0 B   |      0 B   |      0 B   |      0 B   |\n");
    CHECK_CONTAINS(text, "| GPU reserved segments |       0    |       0    |       0    |       0    |\n");
    CHECK_CONTAINS(text, "| Oversize GPU segments |       0    |       0    |       0    |       0    |\n");
    free(text);
    vram_pool_destroy(pool);
}

/* The cpu pool's table: CPU where PyTorch says CUDA and GPU, mmap for cudaMalloc. */
static void test_summary_labels_cpu(void) {
    vram_pool_t *pool;
    CHECK_OK(vram_device_pool((vram_device_t){VRAM_DEVICE_CPU, 0, 0}, &pool));
    char *text = NULL;
    CHECK_OK(vram_memory_summary(pool, 0, &text));
    CHECK_CONTAINS(text, "|             CPU OOMs: ");
    CHECK_CONTAINS(text, "|              mmap retries: ");
    CHECK_CONTAINS(text, "| CPU reserved memory   |");
    CHECK_CONTAINS(text, "| CPU reserved segments |");
    CHECK_CONTAINS(text, "| Oversize CPU segments |");
    for (char *line = text, *nl; (nl = strchr(line, '\n')); line = nl + 1) CHECK(nl - line == 77);
    free(text);
}

static void test_cuda_backend_degrades_without_a_gpu(void) {
    void *ctx = NULL;
    int n = vram_cuda_device_count();
    CHECK(n >= 0);
    if (!vram_cuda_compiled()) {
        CHECK(vram_backend_cuda() == NULL && n == 0);
        CHECK_STATUS(vram_backend_cuda_ctx(0, &ctx), VRAM_ERR_UNAVAILABLE);
        CHECK_CONTAINS(vram_last_error(), "built without CUDA support");
        return;
    }
    CHECK(vram_backend_cuda() != NULL && !strcmp(vram_backend_cuda()->name, "cuda"));
    CHECK_STATUS(vram_backend_cuda_ctx(n, &ctx), VRAM_ERR_UNAVAILABLE); /* one past the last device */
    CHECK_CONTAINS(vram_last_error(), "is not available: this machine has");
    if (n == 0) return;
    vram_pool_t *pool = NULL;
    CHECK_OK(vram_backend_cuda_ctx(0, &ctx));
    CHECK_OK(vram_pool_create(vram_backend_cuda(), ctx, (vram_device_t){VRAM_DEVICE_CUDA, 0, 0}, NULL, &pool));
    void *p = NULL;
    CHECK_OK(vram_malloc(pool, 3 * MiB, 0, 0, &p));
    CHECK(p != NULL);
    CHECK_OK(vram_record_stream(pool, p, 0));
    CHECK_OK(vram_free(pool, p, 0));
    CHECK_OK(vram_pool_synchronize(pool, VRAM_ALL_STREAMS));
    uint64_t released = 0, free_bytes = 0, total = 0;
    CHECK_OK(vram_mem_get_info(pool, &free_bytes, &total));
    CHECK(total > 0 && free_bytes <= total);
    CHECK_OK(vram_empty_cache(pool, &released));
    CHECK(released == 20 * MiB);
    CHECK_POOL(pool);
    vram_pool_destroy(pool);
}

static void test_stats_struct_size_is_checked(void) {
    vram_pool_t *pool = make_sim_pool(GiB, NULL);
    vram_stats_t s;
    memset(&s, 0, sizeof s);
    s.size = sizeof s - 8; /* an older, smaller struct */
    CHECK_STATUS(vram_get_stats(pool, &s), VRAM_ERR_INVALID_ARG);
    CHECK_CONTAINS(vram_last_error(), "sizeof(vram_stats_t)");
    s.size = sizeof s;
    CHECK_OK(vram_get_stats(pool, &s));
    CHECK(s.version == VRAM_STATS_VERSION && s.max_split_size == -1);
    vram_pool_destroy(pool);
}

int main(void) {
    RUN(test_cuda_backend_degrades_without_a_gpu);
    RUN(test_stats_struct_size_is_checked);
    RUN(test_device_names);
    RUN(test_status_and_format);
    RUN(test_registry);
    RUN(test_cpu_memory_is_real);
    RUN(test_history);
    RUN(test_snapshot_segments_and_blocks);
    RUN(test_summary_layout);
    RUN(test_summary_labels_cpu);
    return harness_finish();
}
