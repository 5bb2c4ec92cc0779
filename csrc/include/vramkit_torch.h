/* vramkit_torch.h — vramkit as PyTorch's CUDA allocator, through
 * torch.cuda.memory.CUDAPluggableAllocator(path, "vramkit_torch_malloc", "vramkit_torch_free").
 * Part of vramkit's public C API; vramkit.h includes it. Plain C ABI: nothing here is compiled
 * against PyTorch.
 *
 * torch calls the two allocation hooks for every CUDA storage once the allocator is installed
 * (python: vramkit.torch.use_as_cuda_allocator()). A request for cuda:N goes to vramkit's
 * cuda:N pool on the caller's stream, so vramkit's counters, summaries, snapshots, history and
 * empty_cache describe the script's own tensors. The other hooks have the signatures of
 * CUDAPluggableAllocator's C++ setters (set_reset_fn, set_record_stream_fn, ...), for C++
 * code that registers them; torch's Python API registers only the two. */
#ifndef VRAMKIT_TORCH_H
#define VRAMKIT_TORCH_H

#include <stddef.h>
#include <sys/types.h>

#include "vramkit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* torch's alloc_fn and free_fn. `stream` is a cudaStream_t. vramkit_torch_malloc throws a C++
 * std::runtime_error carrying vramkit's out-of-memory message when no memory can be found (torch
 * turns it into a Python RuntimeError); it never returns NULL for size > 0, which torch would
 * wrap into a tensor whose first kernel faults. vramkit_torch_free of a pointer vramkit does not
 * own is a no-op, counted (vram_torch_stray_frees). Both are defined in csrc/torch/. */
VRAM_API void *vramkit_torch_malloc(ssize_t size, int device, void *stream);
VRAM_API void vramkit_torch_free(void *ptr, ssize_t size, int device, void *stream);

/* The same allocation without the C++ exception, for C callers and ctypes: VRAM_ERR_OOM with
 * the message in vram_last_error(). */
VRAM_API VRAM_NODISCARD vram_status_t vram_torch_malloc(int64_t size, int device, void *stream, void **out);

/* The hooks of CUDAPluggableAllocator's other setters. */
VRAM_API void vramkit_torch_init(int device_count);                    /* set_init_fn: nothing to do */
VRAM_API void vramkit_torch_empty_cache(void);                         /* set_reset_fn */
VRAM_API void vramkit_torch_set_memory_fraction(double fraction, int device); /* set_memory_fraction_fn */
VRAM_API void vramkit_torch_record_stream(void *ptr, void *stream);   /* set_record_stream_fn */
VRAM_API void *vramkit_torch_base_alloc(void *ptr, size_t *size);     /* set_base_alloc_fn */

/* Pointers vramkit_torch_free was given that no vramkit pool owned (ignored). */
VRAM_API uint64_t vram_torch_stray_frees(void);

/* The allocation history's stacks: vram_torch_malloc asks `hook` for the context id of each
 * allocation while the pool records its history (vram_malloc's `context`). Python's module sets
 * one that reads the calling thread's Python frames; NULL (the default) records none. */
typedef uint64_t (*vram_torch_context_fn)(vram_pool_t *pool);
VRAM_API void vram_torch_set_context_hook(vram_torch_context_fn hook);

/* Test and dry-run switch: send requests for cuda:N to `device` instead ("sim:3", or "cuda" to
 * go back to the real devices). With it the hooks run, and are tested, without a GPU. */
VRAM_API VRAM_NODISCARD vram_status_t vram_torch_route(const char *device);

#ifdef __cplusplus
}
#endif
#endif
