/* address_space.h — the process's address-space limit (RLIMIT_AS, what `ulimit -v` sets) and
 * a thread-local note of a mapping it refused, so the OOM message can name the limit.
 *
 * Why: under RLIMIT_AS, mmap fails with ENOMEM however much memory the host has free, and an
 * OOM message that only says "21 GiB is free" hides the cause. The backend that saw the
 * failure notes it; the pool clears the note before each attempt to map memory and the OOM
 * report takes it (taking clears it), so a note never describes another failure. */
#ifndef VRAM_UTIL_ADDRESS_SPACE_H
#define VRAM_UTIL_ADDRESS_SPACE_H

#include <stdint.h>

#include "vramkit.h"

/* The soft RLIMIT_AS (UINT64_MAX when unlimited) and the address space mapped now (VmSize;
 * 0 when /proc cannot be read). Reads /proc only when a limit is set. No malloc: under the
 * limit, malloc itself may be what fails. */
void vram__address_space(uint64_t *limit, uint64_t *used);

typedef struct vram__as_refusal {
    uint64_t size;  /* the bytes that were to be mapped */
    uint64_t limit; /* RLIMIT_AS then */
    uint64_t used;  /* address space in use then */
} vram__as_refusal_t;

/* After mmap of `span` bytes (`size` of them asked for by the pool) failed with ENOMEM: note
 * the refusal if RLIMIT_AS explains it (the mapping would have passed it), else clear. */
void vram__as_refusal_after_enomem(uint64_t size, uint64_t span);
/* Record a refusal with known figures (tests, and callers that checked the limit first). */
void vram__as_refusal_set(uint64_t size, uint64_t limit, uint64_t used);
void vram__as_refusal_clear(void);
/* 1 and the figures if this thread has a note (which is then cleared), else 0. */
int vram__as_refusal_take(vram__as_refusal_t *out);

#endif
