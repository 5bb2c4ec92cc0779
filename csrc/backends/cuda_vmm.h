/* cuda_vmm.h — the CUDA driver's virtual-memory calls behind the cuda backend's expandable
 * segments (cuda_vmm.c). The driver library is loaded at run time, never linked, so the module
 * still imports where no driver is installed. The other calls need vram__cuda_vmm_load to have
 * succeeded, and work on the calling thread's current context: cuda.c makes the pool's device
 * current around them. */
#ifndef VRAM_BACKENDS_CUDA_VMM_H
#define VRAM_BACKENDS_CUDA_VMM_H

#include <stddef.h>
#include <stdint.h>

#include "vramkit.h"

/* Load libcuda.so.1 and the symbols below, once per process; later calls return the same
 * outcome. VRAM_ERR_UNAVAILABLE, with a message naming what is missing, when it cannot. */
vram_status_t vram__cuda_vmm_load(void);
/* 1 if no driver context is current on this thread (the runtime makes one current lazily). */
int vram__cuda_vmm_no_context(void);
/* The backend's range_* calls for cuda:`device`. `granularity` caches the device's minimum
 * allocation granularity (0 until the first map queries it). */
vram_status_t vram__cuda_vmm_reserve(int device, uint64_t size, uintptr_t *out);
vram_status_t vram__cuda_vmm_map(int device, size_t *granularity, uintptr_t addr, uint64_t size, uint64_t page);
vram_status_t vram__cuda_vmm_unmap(int device, uintptr_t addr, uint64_t size, uint64_t page);
void vram__cuda_vmm_release(uintptr_t addr, uint64_t size);

#endif
