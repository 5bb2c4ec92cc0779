/* error.c — the thread-local last-error message behind vram_last_error(). */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>

/* One buffer per thread: a failure on one thread never clobbers another's message. */
static _Thread_local char last_error[2048]; /* the host OOM message runs to about 900 */

vram_status_t vram__fail(vram_status_t status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, args);
    va_end(args);
    return status;
}

const char *vram_last_error(void) { return last_error; }

const char *vram_status_name(vram_status_t status) {
    switch (status) {
    case VRAM_OK: return "VRAM_OK";
    case VRAM_ERR_INVALID_ARG: return "VRAM_ERR_INVALID_ARG";
    case VRAM_ERR_OOM: return "VRAM_ERR_OOM";
    case VRAM_ERR_BACKEND: return "VRAM_ERR_BACKEND";
    case VRAM_ERR_UNAVAILABLE: return "VRAM_ERR_UNAVAILABLE";
    case VRAM_ERR_CORRUPT: return "VRAM_ERR_CORRUPT";
    case VRAM_ERR_HOST_MEMORY: return "VRAM_ERR_HOST_MEMORY";
    case VRAM_ERR_INFEASIBLE: return "VRAM_ERR_INFEASIBLE";
    }
    return "VRAM_ERR_UNKNOWN";
}
