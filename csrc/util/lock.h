/* lock.h — the one mutex type used by pools and the device registry. */
#ifndef VRAM_UTIL_LOCK_H
#define VRAM_UTIL_LOCK_H

#include <pthread.h>

typedef pthread_mutex_t vram__mutex_t;

static inline int vram__mutex_init(vram__mutex_t *m) { return pthread_mutex_init(m, NULL); }
static inline void vram__mutex_destroy(vram__mutex_t *m) { pthread_mutex_destroy(m); }
static inline void vram__lock(vram__mutex_t *m) { pthread_mutex_lock(m); }
static inline void vram__unlock(vram__mutex_t *m) { pthread_mutex_unlock(m); }

#endif
