/* lock.h — the mutex used by pools and the device registry.
 *
 * Every malloc and free takes a pool's mutex once, so its uncontended cost is on the hot path.
 * On Linux it is a three-state futex mutex (0 free, 1 held, 2 held with waiters): an
 * uncontended lock is one compare-and-swap and an unlock one exchange, with no call into
 * libc. A contended lock spins briefly (critical sections are a few hundred nanoseconds),
 * then sleeps in the kernel. Elsewhere it falls back to pthread_mutex_t. */
#ifndef VRAM_UTIL_LOCK_H
#define VRAM_UTIL_LOCK_H

#ifdef __linux__

typedef struct vram__mutex {
    int state;
} vram__mutex_t;

#define VRAM__MUTEX_INITIALIZER {0}

void vram__lock_contended(vram__mutex_t *m);
void vram__wake_one(vram__mutex_t *m);

static inline int vram__mutex_init(vram__mutex_t *m) {
    m->state = 0;
    return 0;
}
static inline void vram__mutex_destroy(vram__mutex_t *m) { (void)m; }

static inline void vram__lock(vram__mutex_t *m) {
    int expected = 0;
    if (!__atomic_compare_exchange_n(&m->state, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        vram__lock_contended(m);
}

static inline void vram__unlock(vram__mutex_t *m) {
    if (__atomic_exchange_n(&m->state, 0, __ATOMIC_RELEASE) == 2) vram__wake_one(m);
}

#else /* not Linux: pthreads */

#include <pthread.h>

typedef pthread_mutex_t vram__mutex_t;
#define VRAM__MUTEX_INITIALIZER PTHREAD_MUTEX_INITIALIZER

static inline int vram__mutex_init(vram__mutex_t *m) { return pthread_mutex_init(m, NULL); }
static inline void vram__mutex_destroy(vram__mutex_t *m) { pthread_mutex_destroy(m); }
static inline void vram__lock(vram__mutex_t *m) { pthread_mutex_lock(m); }
static inline void vram__unlock(vram__mutex_t *m) { pthread_mutex_unlock(m); }

#endif
#endif
