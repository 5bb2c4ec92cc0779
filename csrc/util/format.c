/* format.c — c10's format_size, so OOM messages read exactly like PyTorch's. */
#include "vramkit.h"

#include <stdio.h>

int vram_format_size(uint64_t bytes, char *buf, size_t len) {
    /* c10 uses <= at each threshold: 1024 prints as "1024 bytes", 1 MiB as "1024.00 KiB". */
    if (bytes <= 1024) return snprintf(buf, len, "%llu bytes", (unsigned long long)bytes);
    if (bytes <= 1048576) return snprintf(buf, len, "%.2f KiB", (double)bytes / 1024.0);
    if (bytes <= 1073741824ull) return snprintf(buf, len, "%.2f MiB", (double)bytes / 1048576.0);
    return snprintf(buf, len, "%.2f GiB", (double)bytes / 1073741824.0);
}
