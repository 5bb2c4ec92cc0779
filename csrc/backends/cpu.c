/* cpu.c — the host backend: segments are anonymous mmap'd, page-aligned mappings.
 *
 * mmap rather than malloc so that a released segment really goes back to the OS and a kept
 * one keeps its faulted pages: that reuse is what makes large NumPy temporaries cheap. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "host_streams.h"
#include "../util/error.h"

typedef struct cpu_ctx {
    vram__host_streams_t streams;
} cpu_ctx_t;

static vram_status_t cpu_segment_alloc(void *ctx, uint64_t size, vram_stream_t stream, uintptr_t *out) {
    (void)ctx;
    (void)stream;
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return VRAM_ERR_OOM; /* the pool writes the OOM message */
    *out = (uintptr_t)p;
    return VRAM_OK;
}

static void cpu_segment_free(void *ctx, uintptr_t addr, uint64_t size) {
    (void)ctx;
    munmap((void *)addr, (size_t)size);
}

/* Free memory as the kernel estimates it (MemAvailable), total as physical RAM. */
static vram_status_t cpu_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes) {
    (void)ctx;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    *total_bytes = (pages > 0 && page > 0) ? (uint64_t)pages * (uint64_t)page : 0;
    long avail = sysconf(_SC_AVPHYS_PAGES);
    *free_bytes = (avail > 0 && page > 0) ? (uint64_t)avail * (uint64_t)page : 0;
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                *free_bytes = kb * 1024ull;
                break;
            }
        fclose(f);
    }
    return VRAM_OK;
}

static vram_status_t cpu_synchronize(void *ctx, vram_stream_t stream) {
    return vram__host_streams_synchronize(&((cpu_ctx_t *)ctx)->streams, stream);
}
static vram_status_t cpu_event_record(void *ctx, vram_stream_t stream, void **event) {
    return vram__host_event_record(&((cpu_ctx_t *)ctx)->streams, stream, event);
}
static vram_status_t cpu_event_query(void *ctx, void *event, int *done) {
    return vram__host_event_query(&((cpu_ctx_t *)ctx)->streams, event, done);
}
static vram_status_t cpu_event_synchronize(void *ctx, void *event) {
    return vram__host_event_synchronize(&((cpu_ctx_t *)ctx)->streams, event);
}
static void cpu_event_destroy(void *ctx, void *event) {
    (void)ctx;
    vram__host_event_destroy(event);
}
static void cpu_destroy(void *ctx) {
    vram__host_streams_destroy(&((cpu_ctx_t *)ctx)->streams);
    free(ctx);
}

static const vram_backend_t cpu_backend = {
    .name = "cpu",
    .segment_alloc = cpu_segment_alloc,
    .segment_free = cpu_segment_free,
    .mem_info = cpu_mem_info,
    .synchronize = cpu_synchronize,
    .event_record = cpu_event_record,
    .event_query = cpu_event_query,
    .event_synchronize = cpu_event_synchronize,
    .event_destroy = cpu_event_destroy,
    .destroy = cpu_destroy,
};

const vram_backend_t *vram_backend_cpu(void) { return &cpu_backend; }

vram_status_t vram_backend_cpu_ctx(void **ctx) {
    cpu_ctx_t *c = calloc(1, sizeof *c);
    if (!c) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for the cpu backend");
    vram_status_t status = vram__host_streams_init(&c->streams);
    if (status != VRAM_OK) {
        free(c);
        return status;
    }
    *ctx = c;
    return VRAM_OK;
}
