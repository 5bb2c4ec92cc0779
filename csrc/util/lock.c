/* lock.c — the slow paths of the futex mutex in lock.h (Drepper, "Futexes Are Tricky",
 * mutex 3): spin a little, then mark the mutex contended (2) and sleep until it is free. */
#include "lock.h"

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#define SPINS 100

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

void vram__lock_contended(vram__mutex_t *m) {
    for (int i = 0; i < SPINS; i++) {
        int expected = 0;
        if (__atomic_load_n(&m->state, __ATOMIC_RELAXED) == 0 &&
            __atomic_compare_exchange_n(&m->state, &expected, 1, 0, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            return;
        cpu_relax();
    }
    /* Taking it as 2 tells the holder's unlock to wake a sleeper; a thread that wins here may
     * leave a needless wake-up behind, which is harmless. */
    while (__atomic_exchange_n(&m->state, 2, __ATOMIC_ACQUIRE) != 0)
        syscall(SYS_futex, &m->state, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
}

void vram__wake_one(vram__mutex_t *m) { syscall(SYS_futex, &m->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }

#else
typedef int vram__lock_c_is_empty_without_futexes;
#endif
