/* parallel.h — a small persistent thread pool for the CPU kernels.
 *
 * vram__parallel_for(n, fn, ctx, threads) calls fn(ctx, i) once for every i in [0, n), on the
 * calling thread plus up to threads-1 pool workers, and returns when all calls are done.
 * Items are claimed one at a time from an atomic counter, so uneven items balance out.
 * Workers are created on first use and sleep between jobs. One job runs at a time: a caller
 * that finds the pool busy (another Python thread, or a nested call) runs its items itself,
 * so callers never wait for each other. After fork() the child starts with no workers. */
#ifndef VRAM_UTIL_PARALLEL_H
#define VRAM_UTIL_PARALLEL_H

#include <stddef.h>

typedef void (*vram__item_fn)(void *ctx, size_t item);

void vram__parallel_for(size_t n_items, vram__item_fn fn, void *ctx, int threads);

/* The default thread count: VRAMKIT_NUM_THREADS if it is an integer in [1, 1024], else the
 * number of CPUs this process may run on (its affinity mask), else 1. */
int vram__default_threads(void);

#endif
