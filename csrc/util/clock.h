/* clock.h — monotonic nanoseconds for history timestamps and benchmarks. */
#ifndef VRAM_UTIL_CLOCK_H
#define VRAM_UTIL_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t vram__now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

#endif
