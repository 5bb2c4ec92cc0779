/* host_memory.h — the host-memory reader's entry point for tests: the same reading as
 * vram_host_memory(), with the process's mountinfo and cgroup files given (tests point them
 * at a fake cgroup tree, so cgroup v1 and v2 are both exercised on any machine) and the
 * cgroup located afresh instead of once per process. */
#ifndef VRAM_BACKENDS_HOST_MEMORY_H
#define VRAM_BACKENDS_HOST_MEMORY_H

#include "vramkit.h"

vram_status_t vram__host_memory_from(const char *mountinfo, const char *cgroup_file, vram_host_memory_t *out);

#endif
