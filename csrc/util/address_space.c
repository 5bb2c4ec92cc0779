/* address_space.c — RLIMIT_AS and VmSize, and the thread-local note of a refused mapping. */
#include "address_space.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

/* VmSize from /proc/self/statm (its first field, in pages), read with open/read into a stack
 * buffer: fopen would malloc, and under an exhausted limit that can fail too. */
static uint64_t vm_size(void) {
    int fd = open("/proc/self/statm", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    char buf[128];
    ssize_t n;
    do n = read(fd, buf, sizeof buf - 1);
    while (n < 0 && errno == EINTR);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = '\0';
    uint64_t pages = 0;
    for (const char *c = buf; *c >= '0' && *c <= '9'; c++) pages = pages * 10 + (uint64_t)(*c - '0');
    long page_size = sysconf(_SC_PAGESIZE);
    return page_size > 0 ? pages * (uint64_t)page_size : 0;
}

void vram__address_space(uint64_t *limit, uint64_t *used) {
    struct rlimit rl;
    *limit = UINT64_MAX;
    *used = 0;
    if (getrlimit(RLIMIT_AS, &rl) != 0 || rl.rlim_cur == RLIM_INFINITY) return;
    *limit = (uint64_t)rl.rlim_cur;
    *used = vm_size();
}

static _Thread_local vram__as_refusal_t note;
static _Thread_local int noted;

void vram__as_refusal_set(uint64_t size, uint64_t limit, uint64_t used) {
    note = (vram__as_refusal_t){.size = size, .limit = limit, .used = used};
    noted = 1;
}

void vram__as_refusal_clear(void) { noted = 0; }

void vram__as_refusal_after_enomem(uint64_t size, uint64_t span) {
    uint64_t limit, used;
    vram__address_space(&limit, &used);
    /* The failed mapping is not in VmSize: the limit explains the failure when adding it
     * would have passed the limit. ENOMEM has other causes (vm.max_map_count, the commit
     * limit under vm.overcommit_memory=2); those leave no note. */
    if (limit != UINT64_MAX && (used >= limit || span > limit - used)) vram__as_refusal_set(size, limit, used);
    else vram__as_refusal_clear();
}

int vram__as_refusal_take(vram__as_refusal_t *out) {
    if (!noted) return 0;
    *out = note;
    noted = 0;
    return 1;
}
