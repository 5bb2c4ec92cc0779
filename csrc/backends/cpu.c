/* cpu.c — the host backend: segments are anonymous mmap'd mappings aligned to 2 MiB.
 *
 * mmap rather than malloc so that a released segment really goes back to the OS and a kept
 * one keeps its faulted pages: that reuse is what makes large NumPy temporaries cheap.
 * Segments start on a 2 MiB boundary and large ones ask for transparent huge pages (as NumPy
 * does for arrays of 4 MiB and more), so the pool's 2 MiB page-release units are whole huge
 * pages: giving them back and faulting them in again costs a few page-table entries, not
 * 512 each, and never splits a huge page. */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "host_streams.h"
#include "../util/address_space.h"
#include "../util/error.h"

/* Nothing but the simulated streams: host_streams.c's entries serve the ctx as it is. */
typedef struct cpu_ctx {
    vram__host_streams_t streams;
} cpu_ctx_t;
_Static_assert(offsetof(cpu_ctx_t, streams) == 0, "host_streams.c takes the ctx for its streams");

#define SEGMENT_ALIGN ((uintptr_t)2 << 20)

static vram_status_t cpu_segment_alloc(void *ctx, uint64_t size, vram_stream_t stream, uintptr_t *out) {
    (void)ctx;
    (void)stream;
    if (size > SIZE_MAX - SEGMENT_ALIGN) return VRAM_ERR_OOM;
    /* Map 2 MiB more than needed and trim both ends to land on a 2 MiB boundary. */
    size_t span = (size_t)size + SEGMENT_ALIGN;
    void *p = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) { /* the pool writes the OOM message, naming RLIMIT_AS if it refused */
        if (errno == ENOMEM) vram__as_refusal_after_enomem(size, span);
        return VRAM_ERR_OOM;
    }
    uintptr_t raw = (uintptr_t)p, start = (raw + SEGMENT_ALIGN - 1) & ~(SEGMENT_ALIGN - 1);
    if (start > raw) munmap(p, start - raw);
    if (raw + span > start + size) munmap((void *)(start + size), raw + span - (start + size));
#ifdef MADV_HUGEPAGE
    /* Small-pool segments (2 MiB, many small blocks) stay on 4 KiB pages, as NumPy leaves
     * arrays under 4 MiB: a huge page would make one small block cost 2 MiB of memory. */
    if (size > SEGMENT_ALIGN) (void)madvise((void *)start, (size_t)size, MADV_HUGEPAGE);
#endif
    *out = start;
    return VRAM_OK;
}

/* Expandable segments on the host: a PROT_NONE, MAP_NORESERVE reservation costs address
 * space only; mapping makes pages accessible (the kernel still finds them on first touch),
 * and unmapping replaces them with a fresh PROT_NONE mapping, which frees them at once and
 * keeps the addresses reserved. */
static vram_status_t cpu_range_reserve(void *ctx, uint64_t size, uintptr_t *out) {
    (void)ctx;
    if (size > SIZE_MAX - SEGMENT_ALIGN) return VRAM_ERR_OOM;
    size_t span = (size_t)size + SEGMENT_ALIGN;
    void *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { /* the pool then tries a classic segment, and reports an OOM if that fails too */
        if (errno == ENOMEM) vram__as_refusal_after_enomem(size, span);
        return VRAM_ERR_OOM;
    }
    uintptr_t raw = (uintptr_t)p, start = (raw + SEGMENT_ALIGN - 1) & ~(SEGMENT_ALIGN - 1);
    if (start > raw) munmap(p, start - raw);
    if (raw + span > start + size) munmap((void *)(start + size), raw + span - (start + size));
    *out = start;
    return VRAM_OK;
}

/* Ranges are address space of this process: expandable segments size them within RLIMIT_AS. */
static void cpu_address_space(void *ctx, uint64_t *limit, uint64_t *used) {
    (void)ctx;
    vram__address_space(limit, used);
}

static vram_status_t cpu_range_map(void *ctx, uintptr_t addr, uint64_t size, uint64_t page) {
    (void)ctx;
    (void)page;
    if (mprotect((void *)addr, (size_t)size, PROT_READ | PROT_WRITE) != 0) return VRAM_ERR_OOM;
#ifdef MADV_HUGEPAGE
    (void)madvise((void *)addr, (size_t)size, MADV_HUGEPAGE);
#endif
    return VRAM_OK;
}

static vram_status_t cpu_range_unmap(void *ctx, uintptr_t addr, uint64_t size, uint64_t page) {
    (void)ctx;
    (void)page;
    void *p = mmap((void *)addr, (size_t)size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return p == MAP_FAILED ? VRAM_ERR_BACKEND : VRAM_OK;
}

static void cpu_range_release(void *ctx, uintptr_t addr, uint64_t size) {
    (void)ctx;
    munmap((void *)addr, (size_t)size);
}

/* Set once MADV_FREE has been refused where MADV_DONTNEED works (kernels before 4.5):
 * MADV_DONTNEED from then on. */
static atomic_int lazy_free_unsupported;

/* Failures write no message: the pool ignores them (the pages simply stay), and a free that
 * succeeded must not leave an error text behind. */
static vram_status_t cpu_release_pages(void *ctx, uintptr_t addr, uint64_t size, int allow_lazy, int *lazy) {
    (void)ctx;
#ifdef MADV_FREE
    if (allow_lazy && !atomic_load_explicit(&lazy_free_unsupported, memory_order_relaxed)) {
        if (madvise((void *)addr, (size_t)size, MADV_FREE) == 0) {
            *lazy = 1;
            return VRAM_OK;
        }
        if (errno != EINVAL) return VRAM_ERR_BACKEND;
        /* EINVAL: an old kernel, or memory the caller mlock()ed (which refuses both). */
        if (madvise((void *)addr, (size_t)size, MADV_DONTNEED) != 0) return VRAM_ERR_BACKEND;
        atomic_store_explicit(&lazy_free_unsupported, 1, memory_order_relaxed);
        *lazy = 0;
        return VRAM_OK;
    }
#else
    (void)allow_lazy;
#endif
    if (madvise((void *)addr, (size_t)size, MADV_DONTNEED) != 0) return VRAM_ERR_BACKEND;
    *lazy = 0;
    return VRAM_OK;
}

/* mincore over the range, a 16 KiB vector (64 MiB of 4 KiB pages) at a time. */
static vram_status_t cpu_resident_bytes(void *ctx, uintptr_t addr, uint64_t size, uint64_t *bytes) {
    (void)ctx;
    long page_size = sysconf(_SC_PAGESIZE);
    if (page_size <= 0) return VRAM_ERR_BACKEND;
    uint64_t page = (uint64_t)page_size, resident = 0;
    unsigned char vec[16384];
    for (uint64_t done = 0; done < size;) {
        uint64_t len = size - done, max = (uint64_t)sizeof vec * page;
        if (len > max) len = max;
        if (mincore((void *)(addr + done), (size_t)len, vec) != 0) return VRAM_ERR_BACKEND;
        for (uint64_t i = 0; i < (len + page - 1) / page; i++) resident += (vec[i] & 1) ? page : 0;
        done += len;
    }
    *bytes = resident;
    return VRAM_OK;
}

static vram_status_t cpu_host_memory(void *ctx, vram_host_memory_t *out) {
    (void)ctx;
    return vram_host_memory(out);
}

static void cpu_segment_free(void *ctx, uintptr_t addr, uint64_t size) {
    (void)ctx;
    munmap((void *)addr, (size_t)size);
}

/* Free and total as the host check sees them: MemAvailable plus free swap and physical RAM,
 * each bounded by the cgroup's memory limit where one applies. */
static vram_status_t cpu_mem_info(void *ctx, uint64_t *free_bytes, uint64_t *total_bytes) {
    vram_host_memory_t info;
    vram_status_t status = cpu_host_memory(ctx, &info);
    if (status != VRAM_OK) return status;
    *free_bytes = info.available;
    *total_bytes = info.total;
    return VRAM_OK;
}

/* One line per concern: segments, host pages, streams and events, expandable segments' ranges. */
static const vram_backend_t cpu_backend = {
    .name = "cpu",
    .segment_alloc = cpu_segment_alloc, .segment_free = cpu_segment_free, .mem_info = cpu_mem_info,
    .release_pages = cpu_release_pages, .host_memory = cpu_host_memory, .resident_bytes = cpu_resident_bytes,
    VRAM__HOST_STREAM_ENTRIES, .destroy = vram__host_ctx_destroy,
    .range_reserve = cpu_range_reserve, .range_map = cpu_range_map, .range_unmap = cpu_range_unmap,
    .range_release = cpu_range_release, .address_space = cpu_address_space,
};

const vram_backend_t *vram_backend_cpu(void) { return &cpu_backend; }

vram_status_t vram_backend_cpu_ctx(void **ctx) {
    return vram__host_ctx_new(sizeof(cpu_ctx_t), "the cpu backend", ctx);
}
