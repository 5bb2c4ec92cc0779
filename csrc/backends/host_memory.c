/* host_memory.c — how much memory the host can really give this process.
 *
 * Two limits apply on Linux. The kernel's own (MemAvailable, plus free swap), and the memory
 * limit of the process's cgroup or of any cgroup above it, which containers, CI runners and
 * systemd services set: past it the kernel's OOM killer ends the process even when the
 * machine has memory to spare. A cgroup's room is its limit minus what it cannot reclaim:
 * usage minus inactive file pages (page cache, and pages freed with MADV_FREE, which the
 * kernel keeps on the inactive file list), the working-set figure Docker and Kubernetes use.
 *
 * Where the cgroup lives is found once per process (from /proc/self/cgroup and
 * /proc/self/mountinfo); the limit and usage files are read on every call, because limits
 * can change at run time. */
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "host_memory.h"
#include "../util/error.h"

#define NO_LIMIT UINT64_MAX
/* cgroup v1 reports "no limit" as the largest page-aligned counter, about 2^63. */
#define V1_UNLIMITED_AT ((uint64_t)1 << 62)

typedef struct cgroup_place {
    int version;                /* 0: none found */
    char dir[PATH_MAX];         /* this process's cgroup directory */
    size_t mount_len;           /* the walk up stops at the mount point: dir[0..mount_len) */
} cgroup_place_t;

static pthread_once_t place_once = PTHREAD_ONCE_INIT;
static cgroup_place_t place;

/* Copy a path, cut to fit (cgroup paths are short; the struct's field is fixed). */
static void copy_path(char *dst, size_t cap, const char *src) {
    size_t n = strlen(src);
    if (n >= cap) n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* Read a small file whole; returns its length or -1. */
static long read_small(const char *path, char *buf, size_t len) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, len - 1, f);
    fclose(f);
    buf[n] = '\0';
    return (long)n;
}

/* A counter file: a number, or "max" (v2's no limit). */
static int read_counter(const char *dir, const char *name, uint64_t *out) {
    char path[PATH_MAX + 64], buf[64];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (read_small(path, buf, sizeof buf) <= 0) return -1;
    if (!strncmp(buf, "max", 3)) {
        *out = NO_LIMIT;
        return 0;
    }
    char *end;
    unsigned long long v = strtoull(buf, &end, 10);
    if (end == buf) return -1;
    *out = v;
    return 0;
}

/* The value of "key value" in a memory.stat-style text (the key must start a line). */
static int stat_value(const char *text, const char *key, uint64_t *out) {
    size_t klen = strlen(key);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        if (!strncmp(p, key, klen) && p[klen] == ' ') {
            *out = strtoull(p + klen + 1, NULL, 10);
            return 0;
        }
    }
    return -1;
}

/* Whether a comma-separated list (mount options, cgroup controllers) names "memory". */
static int lists_memory(const char *list) {
    char copy[1024], *save = NULL;
    snprintf(copy, sizeof copy, "%s", list);
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save))
        if (!strcmp(item, "memory")) return 1;
    return 0;
}

/* mountinfo writes space, tab, newline and backslash in paths as \040-style octal escapes. */
static void unescape_octal(char *s) {
    char *out = s;
    for (char *in = s; *in;) {
        if (in[0] == '\\' && in[1] >= '0' && in[1] <= '3' && in[2] >= '0' && in[2] <= '7' && in[3] >= '0' &&
            in[3] <= '7') {
            *out++ = (char)((in[1] - '0') * 64 + (in[2] - '0') * 8 + (in[3] - '0'));
            in += 4;
        } else {
            *out++ = *in++;
        }
    }
    *out = '\0';
}

/* In mountinfo, find the mount of the v1 memory hierarchy or of cgroup2; copy its root (the
 * path inside the hierarchy that is mounted) and its mount point. */
static int find_mount(const char *mountinfo, int version, char *root, size_t root_len, char *point,
                      size_t point_len) {
    FILE *f = fopen(mountinfo, "r");
    if (!f) return -1;
    char line[4096];
    int found = -1;
    while (found != 0 && fgets(line, sizeof line, f)) {
        /* id parent major:minor root mount-point options [optional...] - fstype source super-options */
        char r[PATH_MAX], m[PATH_MAX];
        if (sscanf(line, "%*s %*s %*s %4095s %4095s", r, m) != 2) continue;
        const char *dash = strstr(line, " - ");
        if (!dash) continue;
        char fstype[64], source[256], super[1024] = "";
        if (sscanf(dash + 3, "%63s %255s %1023s", fstype, source, super) < 2) continue;
        if (version == 2 && strcmp(fstype, "cgroup2") != 0) continue;
        if (version == 1 && (strcmp(fstype, "cgroup") != 0 || !lists_memory(super))) continue;
        unescape_octal(r);
        unescape_octal(m);
        snprintf(root, root_len, "%s", r);
        snprintf(point, point_len, "%s", m);
        found = 0;
    }
    fclose(f);
    return found;
}

/* This process's cgroup path in the v1 memory hierarchy or in the v2 one. */
static int own_cgroup_path(const char *cgroup_file, int version, char *out, size_t len) {
    FILE *f = fopen(cgroup_file, "r");
    if (!f) return -1;
    char line[4096];
    int found = -1;
    while (found != 0 && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        char *c1 = strchr(line, ':');
        char *c2 = c1 ? strchr(c1 + 1, ':') : NULL;
        if (!c2) continue;
        *c1 = *c2 = '\0';
        const char *controllers = c1 + 1, *path = c2 + 1;
        if (version == 2 ? strcmp(line, "0") != 0 || *controllers : !lists_memory(controllers)) continue;
        snprintf(out, len, "%s", path);
        found = 0;
    }
    fclose(f);
    return found;
}

/* The directory of our cgroup: the mount point plus our path relative to the mounted root.
 * In a cgroup namespace, or when our path lies outside the mounted root, fall back to the
 * mount point itself (a container sees its own cgroup there). */
static int locate(const char *mountinfo, const char *cgroup_file, int version, cgroup_place_t *out) {
    char root[PATH_MAX], point[PATH_MAX], path[PATH_MAX];
    if (find_mount(mountinfo, version, root, sizeof root, point, sizeof point) != 0) return -1;
    if (own_cgroup_path(cgroup_file, version, path, sizeof path) != 0) return -1;
    size_t rlen = strlen(root);
    const char *rel = path;
    if (strcmp(root, "/") != 0) rel = !strncmp(path, root, rlen) && (path[rlen] == '/' || !path[rlen]) ? path + rlen : "";
    char dir[PATH_MAX];
    if ((size_t)snprintf(dir, sizeof dir, "%s%s", point, strcmp(rel, "/") ? rel : "") >= sizeof dir) return -1;
    while (strlen(dir) > 1 && dir[strlen(dir) - 1] == '/') dir[strlen(dir) - 1] = '\0';
    if (access(dir, R_OK) != 0) snprintf(dir, sizeof dir, "%s", point);
    out->version = version;
    snprintf(out->dir, sizeof out->dir, "%s", dir);
    out->mount_len = strlen(point);
    return 0;
}

/* The v1 memory controller if one is mounted (hybrid systems mount both), else v2. */
static void locate_any(const char *mountinfo, const char *cgroup_file, cgroup_place_t *out) {
    if (locate(mountinfo, cgroup_file, 1, out) != 0 && locate(mountinfo, cgroup_file, 2, out) != 0) out->version = 0;
}

static void find_place(void) { locate_any("/proc/self/mountinfo", "/proc/self/cgroup", &place); }

/* One cgroup level: its limit and, when limited, what it cannot reclaim and its free swap. */
typedef struct level {
    uint64_t limit, usage, reclaimable, room, swap_room;
} level_t;

static int read_level(const char *dir, int version, uint64_t swap_free, level_t *out) {
    uint64_t limit;
    if (read_counter(dir, version == 2 ? "memory.max" : "memory.limit_in_bytes", &limit) != 0) return -1;
    if (version == 1 && limit >= V1_UNLIMITED_AT) limit = NO_LIMIT;
    if (limit == NO_LIMIT) return -1;
    uint64_t usage = 0, reclaimable = 0;
    if (read_counter(dir, version == 2 ? "memory.current" : "memory.usage_in_bytes", &usage) != 0) return -1;
    char path[PATH_MAX + 64], text[8192];
    snprintf(path, sizeof path, "%s/memory.stat", dir);
    if (read_small(path, text, sizeof text) > 0)
        (void)stat_value(text, version == 2 ? "inactive_file" : "total_inactive_file", &reclaimable);
    if (reclaimable > usage) reclaimable = usage;
    uint64_t held = usage - reclaimable;
    /* Swap lets the cgroup go past its limit without an OOM kill, up to its swap limit. */
    uint64_t swap_room = swap_free;
    if (version == 2) {
        uint64_t smax, scur;
        if (read_counter(dir, "memory.swap.max", &smax) == 0 && smax != NO_LIMIT &&
            read_counter(dir, "memory.swap.current", &scur) == 0)
            swap_room = smax > scur ? smax - scur : 0;
    } else {
        uint64_t mslimit, msusage;
        if (read_counter(dir, "memory.memsw.limit_in_bytes", &mslimit) == 0 && mslimit < V1_UNLIMITED_AT &&
            read_counter(dir, "memory.memsw.usage_in_bytes", &msusage) == 0) {
            uint64_t swap_limit = mslimit > limit ? mslimit - limit : 0, swapped = msusage > usage ? msusage - usage : 0;
            swap_room = swap_limit > swapped ? swap_limit - swapped : 0;
        }
    }
    if (swap_room > swap_free) swap_room = swap_free;
    *out = (level_t){limit, usage, reclaimable, limit > held ? limit - held : 0, swap_room};
    return 0;
}

static void read_meminfo(vram_host_memory_t *out) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE), avail = sysconf(_SC_AVPHYS_PAGES);
    out->ram_total = (pages > 0 && page > 0) ? (uint64_t)pages * (uint64_t)page : 0;
    out->mem_available = (avail > 0 && page > 0) ? (uint64_t)avail * (uint64_t)page : 0;
    out->swap_free = 0;
    char text[8192];
    if (read_small("/proc/meminfo", text, sizeof text) <= 0) return;
    /* /proc/meminfo pads with spaces after the colon: "MemAvailable:   24465352 kB". */
    static const struct { const char *key; size_t offset; } fields[] = {
        {"MemTotal:", offsetof(vram_host_memory_t, ram_total)},
        {"MemAvailable:", offsetof(vram_host_memory_t, mem_available)},
        {"SwapFree:", offsetof(vram_host_memory_t, swap_free)},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        const char *p = strstr(text, fields[i].key);
        if (!p) continue;
        unsigned long long kb = strtoull(p + strlen(fields[i].key), NULL, 10);
        *(uint64_t *)((char *)out + fields[i].offset) = (uint64_t)kb * 1024u;
    }
}

/* Walk from the cgroup up to the mount point; the level with the least room binds. */
static void apply_cgroup(const cgroup_place_t *where, vram_host_memory_t *out) {
    if (where->version == 0) return;
    out->cgroup_version = where->version;
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", where->dir);
    uint64_t best_room = NO_LIMIT;
    for (;;) {
        level_t lv;
        if (read_level(dir, where->version, out->swap_free, &lv) == 0 && lv.room + lv.swap_room < best_room) {
            best_room = lv.room + lv.swap_room;
            out->cgroup_limit = lv.limit;
            out->cgroup_usage = lv.usage;
            out->cgroup_reclaimable = lv.reclaimable;
            copy_path(out->cgroup_path, sizeof out->cgroup_path, dir);
        }
        size_t len = strlen(dir);
        if (len <= where->mount_len) break;
        char *slash = strrchr(dir, '/');
        if (!slash || (size_t)(slash - dir) < where->mount_len) break;
        *slash = '\0';
    }
    if (out->cgroup_limit != NO_LIMIT) {
        if (out->cgroup_limit < out->total) out->total = out->cgroup_limit;
        if (best_room < out->available) out->available = best_room;
    }
}

static void start_reading(vram_host_memory_t *out) {
    memset(out, 0, sizeof *out);
    read_meminfo(out);
    out->total = out->ram_total;
    out->available = out->mem_available + out->swap_free;
    out->cgroup_limit = NO_LIMIT;
}

vram_status_t vram_host_memory(vram_host_memory_t *out) {
    start_reading(out);
    pthread_once(&place_once, find_place);
    apply_cgroup(&place, out);
    return VRAM_OK;
}

vram_status_t vram__host_memory_from(const char *mountinfo, const char *cgroup_file, vram_host_memory_t *out) {
    cgroup_place_t where;
    start_reading(out);
    locate_any(mountinfo, cgroup_file, &where);
    apply_cgroup(&where, out);
    return VRAM_OK;
}
