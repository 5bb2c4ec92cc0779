/* module.h — shared declarations of the CPython bindings (the only code that sees Python).
 * One .c file per Python-facing area; each registers its functions through *_init(module). */
#ifndef VRAM_PYTHON_MODULE_H
#define VRAM_PYTHON_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "vramkit.h"

/* errors.c: raise the Python exception for a failed status (the message comes from
 * vram_last_error). INVALID_ARG becomes ValueError, OOM vramkit.OutOfMemoryError, the rest
 * vramkit.VramkitError. Always returns NULL. */
PyObject *vk_raise(vram_status_t status);
int vk_errors_init(PyObject *module);

/* devices.c: resolve a device argument (None = the default device, "cpu", "cuda:1",
 * "sim:0", an int CUDA index, or a torch.device) to its pool. Returns -1 with an exception. */
int vk_pool_from_arg(PyObject *device, vram_pool_t **pool);
/* The same for allocations: the private pool this thread uses on the device (vramkit.use_mem_pool),
 * if any, else the device's pool. Counters and summaries use vk_pool_from_arg: they name a pool. */
int vk_alloc_pool_from_arg(PyObject *device, vram_pool_t **pool);
/* The device an argument names, without creating its pool. */
int vk_device_from_arg(PyObject *device, vram_device_t *out);
int vk_devices_init(PyObject *module);
/* The canonical device string, as a new reference. */
PyObject *vk_device_name(vram_device_t device);

/* sizes: a non-negative Python int below 2**62 (TypeError / ValueError otherwise). */
int vk_size_from_arg(PyObject *obj, const char *what, uint64_t *out);

/* context.c: the interned Python stack of the caller, or 0 when the pool is not recording or
 * the GIL is not held. Call before taking any pool lock: capturing may run the GC. */
uint64_t vk_capture_context(vram_pool_t *pool);
/* A new list of {"filename", "line", "name"} dicts for a context id, innermost frame first. */
PyObject *vk_context_frames(uint64_t context);
int vk_context_init(PyObject *module);

int vk_memory_init(PyObject *module);   /* memory.c: alloc/free, stats, limits, summary */
int vk_snapshot_init(PyObject *module); /* snapshot.c: snapshot dicts */
int vk_buffer_init(PyObject *module);   /* buffer.c: vramkit.Buffer */
int vk_numpy_init(PyObject *module);    /* numpy_handler.c: the NEP 49 handler */
int vk_bench_init(PyObject *module);    /* bench.c: C-level benchmark loops */
int vk_cuda_tools_init(PyObject *module); /* cuda_tools.c: test helpers for CUDA memory */
int vk_amp_init(PyObject *module);        /* amp.c: loss-scaling kernels */
int vk_amp_torch_init(PyObject *module);  /* amp_torch.c: their tensor walk for plain torch tensors, in C */
int vk_amp_numpy_init(PyObject *module);  /* amp_numpy.c: their walk for NumPy arrays, in C */
/* amp_torch.c: the dense spans a capsule from _C.amp_torch_spans holds (and how many strided
 * tensors it holds besides), or NULL (no exception) when `obj` is not one; its strided tensors */
const vram_tensor_t *vk_amp_spans(PyObject *obj, Py_ssize_t *count, Py_ssize_t *strided_count);
const vram_strided_tensor_t *vk_amp_strided_spans(PyObject *obj, Py_ssize_t *count);
int vk_checkpoint_init(PyObject *module); /* checkpoint.c: the checkpoint planner */
int vk_trace_init(PyObject *module);      /* trace.c: allocation trace replay */
int vk_view_init(PyObject *module);       /* view.c: the snapshot viewer's reader and queries */
int vk_smi_init(PyObject *module);        /* smi.c: GPUs and their processes from NVML */
int vk_mempool_init(PyObject *module);    /* mempool.c: private pools (vramkit.MemPool) */
int vk_oom_queue_init(PyObject *module);  /* oom_queue.c: out-of-memory reports to Python */

/* Add a NULL-terminated method table to the module. */
int vk_add_methods(PyObject *module, PyMethodDef *methods);

#endif
