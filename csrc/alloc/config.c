/* config.c — allocator options in PyTorch's "key:value,key:value" syntax, and the size
 * rounding they control.
 *
 * Accepted keys are PyTorch's where they apply (max_split_size_mb, roundup_power2_divisions,
 * garbage_collection_threshold, max_non_split_rounding_mb, per_process_memory_fraction,
 * backend:native, expandable_segments) plus memory_limit_mb for an absolute cap,
 * expandable_page_mb for the large pool's page in expandable segments, and
 * the host_* keys of the cpu pool (named like PyTorch's pinned_* host-allocator keys, and
 * like them ignored by device pools when they come from the environment).
 * Parsing fills a copy, so a malformed string leaves the settings untouched. */
#include "internal.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

#define MB ((uint64_t)1 << 20)
#define NUM_INTERVALS 16 /* power-of-two intervals from 1 MiB to 64 GiB, as kRoundUpPowerOfTwoIntervals */
#define ALLOWED_KEYS                                                                          \
    "max_split_size_mb, max_non_split_rounding_mb, roundup_power2_divisions, "                 \
    "garbage_collection_threshold, per_process_memory_fraction, memory_limit_mb, backend, " \
    "expandable_segments, expandable_page_mb, and for the cpu pool host_memory_check, host_reserve_mb, "         \
    "host_page_release_mb, host_lazy_free, host_cache_limit_mb, host_cache_limit_fraction"

/* Host-pool defaults, documented in the README:
 * - check each new segment against the host's memory, leaving 1/64 of it (whole MiB, at most
 *   1 GiB) to the rest of the process and the system;
 * - give a free block's pages back (MADV_FREE) once 64 MiB of them hold memory: big arrays,
 *   whose residency matters, go back at once (with huge pages about 0.05 ms per 64 MiB, next
 *   to ~10 ms of work on such an array), while tensor-sized blocks that a loop frees and
 *   reuses many times a second skip the syscall (benchmarks/alloc.py: 68 ns a pair on its
 *   realistic mix at 64 MiB, 146 ns at 16 MiB, 56 ns with no release);
 * - keep at most a quarter of the host's memory cached. */
#define HOST_RESERVE_DIVISOR 64
#define HOST_RESERVE_MAX ((uint64_t)1 << 30)
#define HOST_PAGE_RELEASE_DEFAULT (64 * MB)
#define HOST_CACHE_FRACTION_DEFAULT 0.25
#define HOST_RESERVE_AUTO UINT64_MAX /* computed from the capacity by update_allowed */

void vram__settings_default(vram_settings_t *s, int host) {
    memset(s, 0, sizeof *s);
    s->max_split_size = VRAM_UNLIMITED;
    s->max_non_split_rounding = VRAM_LARGE_BUFFER;
    s->garbage_collection_threshold = 0.0;
    s->memory_fraction = 1.0;
    s->memory_limit = VRAM_NO_LIMIT;
    s->allowed_bytes = VRAM_UNLIMITED;
    s->host_memory_check = host;
    s->host_lazy_free = 1;
    s->host_reserve = host ? HOST_RESERVE_AUTO : 0;
    s->host_page_release = host ? HOST_PAGE_RELEASE_DEFAULT : VRAM_NO_LIMIT;
    s->host_cache_limit_bytes = VRAM_NO_LIMIT;
    s->host_cache_limit_fraction = host ? HOST_CACHE_FRACTION_DEFAULT : -1.0;
    s->host_cache_limit = UINT64_MAX;
    s->expandable_segments = 0;
    /* PyTorch maps large-pool pages of kLargeBuffer (20 MiB): each page is one cuMemCreate and
     * one cuMemMap. On the host a page costs an mprotect, so 2 MiB (one huge page). */
    s->expandable_page_size = host ? VRAM__PAGE_UNIT : VRAM_LARGE_BUFFER;
}

void vram__settings_update_allowed(vram_settings_t *s, uint64_t total_capacity) {
    uint64_t allowed = s->memory_limit;
    if (s->memory_fraction < 1.0) {
        uint64_t by_fraction = (uint64_t)(s->memory_fraction * (double)total_capacity);
        if (by_fraction < allowed) allowed = by_fraction;
    }
    s->allowed_bytes = allowed;
    uint64_t cache = s->host_cache_limit_bytes;
    if (s->host_cache_limit_fraction >= 0.0) {
        uint64_t by_fraction = (uint64_t)(s->host_cache_limit_fraction * (double)total_capacity);
        if (by_fraction < cache) cache = by_fraction;
    }
    s->host_cache_limit = cache;
    if (s->host_reserve == HOST_RESERVE_AUTO) { /* whole MiB, so host_reserve_mb can set it back */
        uint64_t reserve = total_capacity / HOST_RESERVE_DIVISOR / MB * MB;
        s->host_reserve = reserve < HOST_RESERVE_MAX ? reserve : HOST_RESERVE_MAX;
    }
}

static int is_pow2(uint64_t v) { return v && !(v & (v - 1)); }
static unsigned log2_floor(uint64_t v) { return 63u - (unsigned)__builtin_clzll(v); }

/* The string between [begin, end), whitespace-trimmed, as a NUL-terminated copy. */
static void copy_trimmed(const char *begin, const char *end, char *out, size_t cap) {
    while (begin < end && isspace((unsigned char)*begin)) begin++;
    while (end > begin && isspace((unsigned char)end[-1])) end--;
    size_t n = (size_t)(end - begin);
    if (n >= cap) n = cap - 1;
    memcpy(out, begin, n);
    out[n] = '\0';
}

static int parse_u64(const char *text, uint64_t *out) {
    if (!*text || *text == '-' || *text == '+') return -1;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno || *end) return -1;
    *out = v;
    return 0;
}

static int parse_double(const char *text, double *out) {
    if (!*text) return -1;
    char *end;
    errno = 0;
    double v = strtod(text, &end);
    if (errno || *end || v != v) return -1;
    *out = v;
    return 0;
}

static int is_none(const char *text) { return !strcmp(text, "None") || !strcmp(text, "none"); }

static int parse_bool(const char *text, int *out) {
    if (!strcmp(text, "True") || !strcmp(text, "true") || !strcmp(text, "1")) *out = 1;
    else if (!strcmp(text, "False") || !strcmp(text, "false") || !strcmp(text, "0")) *out = 0;
    else return -1;
    return 0;
}

/* "<MiB>" or None (stored as VRAM_NO_LIMIT) for the host size options. */
static vram_status_t parse_mb_or_none(const char *key, const char *value, const char *origin, int allow_none,
                                      uint64_t *out) {
    uint64_t u;
    if (allow_none && is_none(value)) {
        *out = VRAM_NO_LIMIT;
        return VRAM_OK;
    }
    if (parse_u64(value, &u) != 0 || u > (VRAM_MAX_REQUEST / MB))
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s must be a non-negative integer (MiB)%s; got '%s'", origin, key,
                          allow_none ? " or None" : "", value);
    *out = u * MB;
    return VRAM_OK;
}

/* The host_* options: the cpu pool's protection against the OOM killer. */
static vram_status_t apply_host_option(const char *key, const char *value, const char *origin, vram_settings_t *s) {
    double d;
    int b;
    if (!strcmp(key, "host_memory_check") || !strcmp(key, "host_lazy_free")) {
        if (parse_bool(value, &b) != 0)
            return vram__fail(VRAM_ERR_INVALID_ARG, "%s: %s must be True or False; got '%s'", origin, key, value);
        *(!strcmp(key, "host_memory_check") ? &s->host_memory_check : &s->host_lazy_free) = b;
        return VRAM_OK;
    }
    if (!strcmp(key, "host_reserve_mb")) return parse_mb_or_none(key, value, origin, 0, &s->host_reserve);
    if (!strcmp(key, "host_page_release_mb")) return parse_mb_or_none(key, value, origin, 1, &s->host_page_release);
    if (!strcmp(key, "host_cache_limit_mb")) return parse_mb_or_none(key, value, origin, 1, &s->host_cache_limit_bytes);
    /* host_cache_limit_fraction */
    if (is_none(value)) {
        s->host_cache_limit_fraction = -1.0;
        return VRAM_OK;
    }
    if (parse_double(value, &d) != 0 || !(d >= 0.0 && d <= 1.0))
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: host_cache_limit_fraction must be a number in [0, 1] or None; got '%s'",
                          origin, value);
    s->host_cache_limit_fraction = d;
    return VRAM_OK;
}

static int is_host_key(const char *key) {
    static const char *const keys[] = {"host_memory_check", "host_reserve_mb", "host_page_release_mb", "host_lazy_free",
                                       "host_cache_limit_mb", "host_cache_limit_fraction"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
        if (!strcmp(key, keys[i])) return 1;
    return 0;
}

/* roundup_power2_divisions: one power of two for every interval, or "[256:1,512:2,>:8]"
 * where each key is a power-of-two size in MiB starting an interval, and ">" fills the rest. */
static vram_status_t parse_divisions(const char *value, const char *origin, uint32_t *divisions) {
    uint64_t single;
    if (value[0] != '[') {
        if (parse_u64(value, &single) != 0 || (single != 0 && !is_pow2(single)) || single > 65536)
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "%s: roundup_power2_divisions must be 0 or a power of two up to 65536, or a "
                              "list like [256:1,512:2,>:8]; got '%s'", origin, value);
        for (int i = 0; i < NUM_INTERVALS; i++) divisions[i] = (uint32_t)single;
        return VRAM_OK;
    }
    size_t len = strlen(value);
    if (value[len - 1] != ']')
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: roundup_power2_divisions list '%s' lacks its closing ']'",
                          origin, value);
    const char *p = value + 1, *stop = value + len - 1;
    int first = 1;
    size_t last_index = 0;
    while (p < stop) {
        const char *comma = memchr(p, ',', (size_t)(stop - p));
        const char *item_end = comma ? comma : stop;
        const char *colon = memchr(p, ':', (size_t)(item_end - p));
        char key[64], val[64];
        uint64_t divs;
        if (!colon) goto bad_item;
        copy_trimmed(p, colon, key, sizeof key);
        copy_trimmed(colon + 1, item_end, val, sizeof val);
        if (parse_u64(val, &divs) != 0 || (divs != 0 && !is_pow2(divs)) || divs > 65536) goto bad_item;
        if (!strcmp(key, ">")) {
            for (size_t i = last_index; i < NUM_INTERVALS; i++) divisions[i] = (uint32_t)divs;
        } else {
            uint64_t mb;
            if (parse_u64(key, &mb) != 0 || !is_pow2(mb)) goto bad_item;
            size_t index = log2_floor(mb);
            if (index >= NUM_INTERVALS) index = NUM_INTERVALS - 1;
            if (first) {
                for (size_t i = 0; i < index; i++) divisions[i] = (uint32_t)divs;
                first = 0;
            }
            divisions[index] = (uint32_t)divs;
            last_index = index;
        }
        p = item_end + (comma ? 1 : 0);
        continue;
    bad_item:
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "%s: bad roundup_power2_divisions item in '%s': each item is <MiB power of two>:"
                          "<divisions> or >:<divisions>, divisions 0 or a power of two", origin, value);
    }
    return VRAM_OK;
}

static vram_status_t apply_option(const char *key, const char *value, const char *origin, vram_settings_t *s) {
    uint64_t u;
    double d;
    if (!strcmp(key, "max_split_size_mb")) {
        if (is_none(value)) {
            s->max_split_size = VRAM_UNLIMITED;
            return VRAM_OK;
        }
        /* As PyTorch: the value must exceed the 20 MiB large-segment size. */
        if (parse_u64(value, &u) != 0 || u <= VRAM_LARGE_BUFFER / MB || u > (VRAM_MAX_REQUEST / MB))
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "%s: max_split_size_mb must be an integer > 20 (MiB) or None; got '%s'", origin, value);
        s->max_split_size = u * MB;
    } else if (!strcmp(key, "max_non_split_rounding_mb")) {
        if (parse_u64(value, &u) != 0 || u > (VRAM_MAX_REQUEST / MB))
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "%s: max_non_split_rounding_mb must be a non-negative integer (MiB); got '%s'", origin,
                              value);
        s->max_non_split_rounding = u * MB;
    } else if (!strcmp(key, "roundup_power2_divisions")) {
        return parse_divisions(value, origin, s->roundup_power2_divisions);
    } else if (!strcmp(key, "garbage_collection_threshold")) {
        if (parse_double(value, &d) != 0 || !(d > 0.0 && d < 1.0))
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "%s: garbage_collection_threshold must be a number greater than 0.0 and less than "
                              "1.0; got '%s'", origin, value);
        s->garbage_collection_threshold = d;
    } else if (!strcmp(key, "per_process_memory_fraction")) {
        if (parse_double(value, &d) != 0 || !(d >= 0.0 && d <= 1.0))
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "%s: per_process_memory_fraction must be a number in [0, 1]; got '%s'", origin, value);
        s->memory_fraction = d;
    } else if (!strcmp(key, "memory_limit_mb")) {
        if (is_none(value)) {
            s->memory_limit = VRAM_NO_LIMIT;
            return VRAM_OK;
        }
        if (parse_u64(value, &u) != 0 || u > (VRAM_MAX_REQUEST / MB))
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "%s: memory_limit_mb must be a non-negative integer (MiB) or None; got '%s'", origin,
                              value);
        s->memory_limit = u * MB;
    } else if (!strcmp(key, "backend")) {
        if (strcmp(value, "native") != 0)
            return vram__fail(VRAM_ERR_INVALID_ARG, "%s: backend must be 'native' (the only one vramkit has); got '%s'",
                              origin, value);
    } else if (!strcmp(key, "expandable_segments")) {
        int b;
        if (parse_bool(value, &b) != 0)
            return vram__fail(VRAM_ERR_INVALID_ARG, "%s: expandable_segments must be True or False; got '%s'", origin,
                              value);
        s->expandable_segments = b;
    } else if (!strcmp(key, "expandable_page_mb")) {
        uint64_t u;
        if (parse_u64(value, &u) != 0 || u == 0 || u % 2 || u > 1024)
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "%s: expandable_page_mb must be an even number of MiB from 2 to 1024 (the mapping "
                              "granularity of CUDA's virtual memory API is 2 MiB); got '%s'", origin, value);
        s->expandable_page_size = u * MB;
    } else {
        return vram__fail(VRAM_ERR_INVALID_ARG, "%s: unrecognized option '%s'; allowed options: " ALLOWED_KEYS,
                          origin, key);
    }
    return VRAM_OK;
}

vram_status_t vram__settings_parse(const char *conf, const char *origin, vram_settings_t *settings, int host,
                                   int strict) {
    vram_settings_t s = *settings;
    const char *p = conf ? conf : "";
    while (*p) {
        /* An option ends at the first comma outside brackets. */
        const char *end = p;
        int depth = 0;
        while (*end && (depth > 0 || *end != ',')) {
            if (*end == '[') depth++;
            else if (*end == ']') depth--;
            end++;
        }
        char item[512], key[128], value[384];
        copy_trimmed(p, end, item, sizeof item);
        if (item[0] != '\0') {
            char *colon = strchr(item, ':');
            if (!colon)
                return vram__fail(VRAM_ERR_INVALID_ARG,
                                  "%s: option '%s' has no value; the syntax is key:value,key:value", origin, item);
            copy_trimmed(item, colon, key, sizeof key);
            copy_trimmed(colon + 1, item + strlen(item), value, sizeof value);
            if (value[0] == '\0')
                return vram__fail(VRAM_ERR_INVALID_ARG, "%s: option '%s' has an empty value", origin, key);
            vram_status_t status = VRAM_OK;
            if (!is_host_key(key)) status = apply_option(key, value, origin, &s);
            else if (host) status = apply_host_option(key, value, origin, &s);
            else if (strict)
                status = vram__fail(VRAM_ERR_INVALID_ARG,
                                    "%s: %s applies to the cpu pool (host memory) only; this device has no host "
                                    "memory to protect", origin, key);
            if (status != VRAM_OK) return status;
        } else if (*end == ',') {
            return vram__fail(VRAM_ERR_INVALID_ARG, "%s: empty option in '%s'", origin, conf);
        }
        p = *end ? end + 1 : end;
    }
    *settings = s;
    return VRAM_OK;
}

/* PyTorch's roundup_power2_next_division: split [2^k, 2^(k+1)) into `divisions` equal steps. */
static uint64_t round_to_division(uint64_t size, uint64_t divisions) {
    if (is_pow2(size)) return size;
    uint64_t floor2 = (uint64_t)1 << log2_floor(size);
    uint64_t step = floor2 >> log2_floor(divisions);
    if (step == 0) return floor2 << 1;
    uint64_t rounded = size & ~(step - 1);
    return rounded == size ? size : rounded + step;
}

uint64_t vram__round_size(const vram_settings_t *s, uint64_t size) {
    if (size < VRAM_MIN_BLOCK) return VRAM_MIN_BLOCK;
    int index = (int)log2_floor(size) - 20;
    if (index < 0) index = 0;
    if (index >= NUM_INTERVALS) index = NUM_INTERVALS - 1;
    uint64_t divisions = s->roundup_power2_divisions[index];
    if (divisions > 1 && size > VRAM_MIN_BLOCK * divisions) return round_to_division(size, divisions);
    return (size + VRAM_MIN_BLOCK - 1) / VRAM_MIN_BLOCK * VRAM_MIN_BLOCK;
}

uint64_t vram__segment_size(uint64_t rounded) {
    if (rounded <= VRAM_SMALL_SIZE) return VRAM_SMALL_BUFFER;
    if (rounded < VRAM_MIN_LARGE_ALLOC) return VRAM_LARGE_BUFFER;
    return (rounded + VRAM_ROUND_LARGE - 1) / VRAM_ROUND_LARGE * VRAM_ROUND_LARGE;
}
