/* error.h — status codes plus a thread-local message, the library's only error channel. */
#ifndef VRAM_UTIL_ERROR_H
#define VRAM_UTIL_ERROR_H

#include "vramkit.h"

/* Record a message for this thread and return `status`, so failures read
 * `return vram__fail(VRAM_ERR_INVALID_ARG, "...", ...);`. */
vram_status_t vram__fail(vram_status_t status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

#endif
