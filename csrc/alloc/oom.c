/* oom.c — the out-of-memory report: PyTorch's message shape, so retry loops that match
 * " out of memory." keep working, plus the figures for a structured Python exception. */
#include "internal.h"

#include <stdio.h>
#include <string.h>

#include "../util/address_space.h"
#include "../util/error.h"

static _Thread_local vram_oom_info_t last_oom;

void vram_last_oom(vram_oom_info_t *out) { *out = last_oom; }

static vram_oom_callback_t oom_callback; /* read and written atomically: set from any thread */

void vram_set_oom_callback(vram_oom_callback_t callback) {
    __atomic_store_n(&oom_callback, callback, __ATOMIC_RELEASE);
}

/* Why the host check refused: which limit bound, and what vramkit held back. */
static void describe_host_refusal(const vram_pool_t *pool, uint64_t segment_size, char *out, size_t len) {
    const vram_host_memory_t *r = &pool->host.reading;
    char seg[32], limit[32], held[32], avail[32], swap[32], reused[32], reserve[32];
    vram_format_size(segment_size, seg, sizeof seg);
    vram_format_size(r->mem_available, avail, sizeof avail);
    vram_format_size(r->swap_free, swap, sizeof swap);
    vram_format_size(pool->settings.host_reserve, reserve, sizeof reserve);
    int n;
    if (r->cgroup_limit != UINT64_MAX && r->available < r->mem_available + r->swap_free) {
        vram_format_size(r->cgroup_limit, limit, sizeof limit);
        vram_format_size(r->cgroup_usage - r->cgroup_reclaimable, held, sizeof held);
        n = snprintf(out, len,
                     "vramkit did not map %s because the host cannot give it: the memory cgroup %s limits this "
                     "process to %s, of which %s is in use and cannot be reclaimed", seg, r->cgroup_path, limit, held);
    } else {
        n = snprintf(out, len,
                     "vramkit did not map %s because the host cannot give it: the kernel reports %s available "
                     "(MemAvailable) and %s of free swap", seg, avail, swap);
    }
    if (pool->host.lazy_reused && n > 0 && (size_t)n < len) {
        vram_format_size(pool->host.lazy_reused, reused, sizeof reused);
        n += snprintf(out + n, len - (size_t)n,
                      ", less %s that vramkit reuses after giving it back with MADV_FREE (the kernel still counts it "
                      "as free)", reused);
    }
    if (pool->host.unfaulted && n > 0 && (size_t)n < len) {
        vram_format_size(pool->host.unfaulted, reused, sizeof reused);
        n += snprintf(out + n, len - (size_t)n,
                      ", less %s of arrays handed out but not yet written (the kernel counts them once they are)",
                      reused);
    }
    if (n > 0 && (size_t)n < len)
        snprintf(out + n, len - (size_t)n,
                 "; %s is kept for the rest of the process (host_reserve_mb). Mapping it anyway would let the kernel's "
                 "OOM killer end this process. Free memory you no longer need (del, then gc.collect()), or set "
                 "VRAMKIT_ALLOC_CONF=host_memory_check:False to map it regardless.", reserve);
}

/* Address space that expandable ranges hold without memory behind it: under RLIMIT_AS it is
 * part of what the limit counts, and unlike live arrays the user can give it back. */
static uint64_t unmapped_range_bytes(const vram_pool_t *pool) {
    uint64_t bytes = 0;
    for (const vram__segment_t *seg = pool->segments; seg; seg = seg->next)
        if (seg->expandable) bytes += seg->size - seg->mapped;
    return bytes;
}

/* Why RLIMIT_AS refused: the limit, what the process maps, what vramkit's ranges hold. */
static void describe_address_limit(const vram_pool_t *pool, const vram__as_refusal_t *r, char *out, size_t len) {
    char size[32], limit[32], used[32], held[32];
    vram_format_size(r->size, size, sizeof size);
    vram_format_size(r->limit, limit, sizeof limit);
    vram_format_size(r->used, used, sizeof used);
    int n = snprintf(out, len,
                     "vramkit could not map %s because of the address-space limit RLIMIT_AS (ulimit -v) of %s, of "
                     "which %s is in use by this process (every mapping counts, memory or not)", size, limit, used);
    uint64_t unmapped = unmapped_range_bytes(pool);
    if (unmapped && n > 0 && (size_t)n < len) {
        vram_format_size(unmapped, held, sizeof held);
        n += snprintf(out + n, len - (size_t)n, ", %s of it reserved by vramkit's expandable segments and not mapped",
                      held);
    }
    if (n > 0 && (size_t)n < len)
        snprintf(out + n, len - (size_t)n,
                 ". Raise the limit (ulimit -v, or resource.setrlimit(resource.RLIMIT_AS, ...)), free memory you no "
                 "longer need%s.",
                 pool->settings.expandable_segments ? ", or turn expandable_segments off (its ranges take address "
                                                      "space before they take memory)" : "");
}

vram_status_t vram__report_oom(vram_pool_t *pool, uint64_t requested, uint64_t segment_size, vram_stream_t stream,
                               uint64_t context) {
    uint64_t device_free = 0, device_total = pool->total_capacity;
    (void)pool->backend->mem_info(pool->ctx, &device_free, &device_total);
    int host_refused = pool->host.rejected;
    if (host_refused) { /* the figures the check decided on */
        device_free = pool->host.room;
        device_total = pool->host.reading.total;
    }
    /* The backend's note of the last attempt (taking it clears it). What this process may
     * still map is then bounded by the limit, whatever the host has free. */
    vram__as_refusal_t as;
    int as_refused = vram__as_refusal_take(&as);
    if (as_refused && !host_refused) {
        uint64_t room = as.limit > as.used ? as.limit - as.used : 0;
        if (room < device_free) device_free = room;
    }
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
    /* PyTorch's advice; with expandable segments on, free pages were already unmapped and the
     * request retried, so what is left reserved is pages shared with live blocks. */
    char advice[1024] = "If reserved but unallocated memory is large try setting "
                        "VRAMKIT_ALLOC_CONF=expandable_segments:True to avoid fragmentation.";
    if (pool->settings.expandable_segments)
        snprintf(advice, sizeof advice,
                 "Expandable segments are on: every free page was unmapped before this error, and what is "
                 "reserved but unallocated shares its %s pages with live blocks%s.",
                 pool->settings.expandable_page_size > VRAM__PAGE_UNIT ? "large" : "2 MiB",
                 pool->settings.expandable_page_size > VRAM__PAGE_UNIT
                     ? " (VRAMKIT_ALLOC_CONF=expandable_page_mb:2 maps large-pool pages of 2 MiB)" : "");
    if (host_refused) describe_host_refusal(pool, pool->host.refused_size, advice, sizeof advice);
    else if (as_refused) describe_address_limit(pool, &as, advice, sizeof advice);
    vram_status_t status = vram__fail(VRAM_ERR_OOM,
                      "%s out of memory. Tried to allocate %s. %s has a total capacity of %s of which %s is free. "
                      "%sOf the allocated memory %s is allocated by vramkit, and %s is reserved by vramkit but "
                      "unallocated. %s",
                      kind, req, where, total_s, free_s, allowed_s, alloc_s, unalloc_s, advice);
    vram_oom_callback_t callback = __atomic_load_n(&oom_callback, __ATOMIC_ACQUIRE);
    if (callback && !pool->quiet_oom) callback(&last_oom, vram_last_error());
    return status;
}
