/* vramkit_nvml.h — the machine's NVIDIA GPUs and their processes, through NVML (dlopen).
 * Part of vramkit's public C API; vramkit.h includes it (and it includes vramkit.h for the
 * status codes and export macros), so either can be included first. */
#ifndef VRAMKIT_NVML_H
#define VRAMKIT_NVML_H

#include "vramkit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ======================================================================================
 * NVML: the machine's NVIDIA GPUs and the processes holding their memory
 *
 * Read from the driver's management library, loaded at run time with dlopen (never linked):
 * the file named by VRAMKIT_NVML_LIBRARY, else "libnvidia-ml.so.1". Without it every call
 * returns VRAM_ERR_UNAVAILABLE with the loader's reason, and nothing else in vramkit changes.
 * The library is loaded and initialised once, by the first call, and kept until
 * vram_nvml_close(); the calls are serialised by one mutex (NVML queries take micro- to
 * milliseconds, this is not a hot path). Indexes are NVML's (PCI bus order), which may differ
 * from CUDA's device order unless CUDA_DEVICE_ORDER=PCI_BUS_ID.
 * ====================================================================================== */

#define VRAM_NVML_NOT_AVAILABLE UINT64_MAX /* a figure NVML cannot give (Windows WDDM, some vGPUs) */
#define VRAM_NVML_NO_ID UINT32_MAX         /* a MIG instance id when MIG is off (or unknown) */

typedef struct vram_gpu_info {
    uint32_t index;                      /* NVML index */
    char name[96];                       /* "NVIDIA H100 80GB HBM3" */
    char uuid[96];                       /* "GPU-..." */
    uint64_t memory_total, memory_used, memory_free; /* bytes, as nvmlDeviceGetMemoryInfo (v1): used
                                          * includes what the driver reserves */
    int utilization_gpu;                 /* % of the last sample period a kernel ran; -1: not supported */
    int utilization_memory;              /* % of it the memory controller was busy (not capacity); -1 */
} vram_gpu_info_t;

typedef enum vram_gpu_process_kind {
    VRAM_GPU_PROCESS_COMPUTE = 1,  /* a CUDA (or OpenCL) context */
    VRAM_GPU_PROCESS_GRAPHICS = 2, /* a graphics context (OpenGL, Vulkan, a display server) */
} vram_gpu_process_kind_t;

typedef struct vram_gpu_process {
    uint32_t pid;                  /* as the driver sees it: the host's PID namespace */
    uint32_t kind;                 /* vram_gpu_process_kind_t */
    uint64_t used_memory;          /* bytes; VRAM_NVML_NOT_AVAILABLE when NVML cannot tell */
    uint32_t gpu_instance_id;      /* MIG instance ids; VRAM_NVML_NO_ID without MIG */
    uint32_t compute_instance_id;
} vram_gpu_process_t;

/* Load and initialise NVML if that has not been tried yet. VRAM_OK, or VRAM_ERR_UNAVAILABLE
 * with the reason: "<library> could not be loaded (<dlerror>)", a missing symbol, or
 * nvmlInit's error. The outcome is kept: later calls return it again until vram_nvml_close(). */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_open(void);
/* Shut NVML down and unload it (if loaded); the next call loads it again, reading
 * VRAMKIT_NVML_LIBRARY anew. For tests and long-running tools that want to retry. */
VRAM_API void vram_nvml_close(void);
/* The number of GPUs NVML sees. */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_device_count(uint32_t *count);
/* Name, UUID, memory and utilisation of GPU `index` (VRAM_ERR_UNAVAILABLE for an index past
 * the count; VRAM_ERR_BACKEND when NVML fails, with its error string). */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_device_info(uint32_t index, vram_gpu_info_t *out);
/* The processes with a context on GPU `index`: compute ones first, then graphics ones (a
 * process with both appears twice, once per kind). *count receives how many there are; at
 * most `cap` are written to `out` (which may be NULL when cap is 0), so a caller whose array
 * was too small calls again with *count entries (the list may have changed meanwhile). */
VRAM_API VRAM_NODISCARD vram_status_t vram_nvml_processes(uint32_t index, vram_gpu_process_t *out, size_t cap,
                                                         size_t *count);


#ifdef __cplusplus
}
#endif
#endif /* VRAMKIT_NVML_H */
