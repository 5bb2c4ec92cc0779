/* oom.c — the out-of-memory report: PyTorch's message shape, so retry loops that match
 * " out of memory." keep working, plus the figures for a structured Python exception. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

#include "../util/error.h"

static _Thread_local vram_oom_info_t last_oom;

void vram_last_oom(vram_oom_info_t *out) { *out = last_oom; }

vram_status_t vram__report_oom(vram_pool_t *pool, uint64_t requested, uint64_t segment_size, vram_stream_t stream,
                               uint64_t context) {
    uint64_t device_free = 0, device_total = pool->total_capacity;
    (void)pool->backend->mem_info(pool->ctx, &device_free, &device_total);
    uint64_t allocated = (uint64_t)pool->stats.allocated_bytes[VRAM_STAT_ALL].current;
    uint64_t reserved = (uint64_t)pool->stats.reserved_bytes[VRAM_STAT_ALL].current;
    uint64_t allowed = pool->settings.allowed_bytes;
    pool->stats.num_ooms++;
    vram__trace(pool, VRAM_TRACE_OOM, 0, requested, stream, context, device_free);

    last_oom = (vram_oom_info_t){
        .device_kind = (int)pool->device.kind,
        .device_index = pool->device.index,
        .requested = requested,
        .segment_size = segment_size,
        .device_free = device_free,
        .device_total = device_total,
        .allocated = allocated,
        .reserved = reserved,
        .allowed = allowed,
    };

    char req[32], total_s[32], free_s[32], alloc_s[32], unalloc_s[32], allowed_s[48] = "", name[32], where[48];
    vram_format_size(requested, req, sizeof req);
    vram_format_size(device_total, total_s, sizeof total_s);
    vram_format_size(device_free, free_s, sizeof free_s);
    vram_format_size(allocated, alloc_s, sizeof alloc_s);
    vram_format_size(reserved - allocated, unalloc_s, sizeof unalloc_s);
    if (allowed != VRAM_UNLIMITED) {
        vram_format_size(allowed, allowed_s, sizeof allowed_s - 10);
        strcat(allowed_s, " allowed; ");
    }
    vram_device_format(pool->device, name, sizeof name);
    const char *kind = "CPU";
    if (pool->device.kind == VRAM_DEVICE_CUDA) {
        kind = "CUDA";
        snprintf(where, sizeof where, "GPU %d", pool->device.index);
    } else {
        if (pool->device.kind == VRAM_DEVICE_SIM) kind = name;
        snprintf(where, sizeof where, "Device %s", name);
    }
    return vram__fail(VRAM_ERR_OOM,
                      "%s out of memory. Tried to allocate %s. %s has a total capacity of %s of which %s is free. "
                      "%sOf the allocated memory %s is allocated by vramkit, and %s is reserved by vramkit but "
                      "unallocated. If reserved but unallocated memory is large try setting "
                      "VRAMKIT_ALLOC_CONF=max_split_size_mb:<MiB> to avoid fragmentation.",
                      kind, req, where, total_s, free_s, allowed_s, alloc_s, unalloc_s);
}
