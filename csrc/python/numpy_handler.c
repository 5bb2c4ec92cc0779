/* numpy_handler.c — a NEP 49 data-memory handler that routes NumPy array data through the
 * cpu pool, so NumPy memory shows in vramkit's counters and large temporaries reuse
 * already-faulted pages instead of a fresh mmap (and page faults) per array.
 *
 * NumPy keeps the handler capsule in each array it creates and frees through it, so arrays
 * made while the handler was installed return to the pool even after uninstall(); the pool
 * is never destroyed, so frees during interpreter teardown are safe. The NumPy C API is
 * imported on first install, so `import vramkit` does not import NumPy. */
#include "module.h"

#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

static vram_pool_t *cpu_pool;
static PyObject *handler_capsule; /* kept forever: arrays hold it too */

/* NumPy turns a NULL from the handler into its own MemoryError ("Unable to allocate 16.0 GiB
 * for an array with shape ..."), which says nothing of why. Say it in a warning: which limit
 * bound (the cgroup's, MemAvailable, the address-space limit RLIMIT_AS, a vramkit limit) and
 * what vramkit held; the pool's OOM message names it. */
static void warn_oom(vram_status_t status) {
    if (status != VRAM_ERR_OOM) return;
    PyGILState_STATE gil = PyGILState_Ensure();
    /* We are inside NumPy's allocation of an array: no finalizer may run here (context.c). */
    int gc_was_enabled = PyGC_Disable();
    if (PyErr_WarnFormat(PyExc_RuntimeWarning, 1, "vramkit could not allocate this NumPy array: %s",
                         vram_last_error()) != 0)
        PyErr_Clear(); /* warnings turned into errors: NumPy raises its MemoryError anyway */
    if (gc_was_enabled) PyGC_Enable();
    PyGILState_Release(gil);
}

#define CPU_DEVICE ((vram_device_t){VRAM_DEVICE_CPU, 0, 0})

/* Where this thread's arrays go: the cpu pool, or a private pool inside vramkit.use_mem_pool. */
static vram_pool_t *target_pool(void) {
    vram_pool_t *in_use = vram_mempool_in_use(CPU_DEVICE);
    return in_use ? in_use : cpu_pool;
}

/* The pool a live array's memory came from: the cpu pool, else a private one. */
static vram_pool_t *owner_pool(void *ptr) {
    vram_block_info_t info;
    vram_pool_t *pool = cpu_pool;
    if (vram_block_query(cpu_pool, ptr, &info) != VRAM_OK && vram_find_pool(ptr, &pool) != VRAM_OK) return NULL;
    return pool;
}

/* NumPy may ask for 0 bytes and treats NULL as failure; give it the smallest block. */
static void *np_malloc(void *ctx, size_t size) {
    (void)ctx;
    void *p = NULL;
    vram_pool_t *pool = target_pool();
    vram_status_t status = vram_malloc(pool, size ? size : 1, 0, vk_capture_context(pool), &p);
    if (status != VRAM_OK) {
        warn_oom(status);
        return NULL;
    }
    return p;
}

/* Zeroed by the pool where needed: cached blocks hold old data, but pages untouched since
 * they were mapped are zero already, and writing them would make np.zeros of a huge array
 * cost its whole size in memory at once (NumPy's default calloc does not). */
static void *np_calloc(void *ctx, size_t nelem, size_t elsize) {
    (void)ctx;
    if (elsize && nelem > SIZE_MAX / elsize) return NULL;
    size_t size = nelem * elsize;
    void *p = NULL;
    vram_pool_t *pool = target_pool();
    vram_status_t status = vram_calloc(pool, size ? size : 1, 0, vk_capture_context(pool), &p);
    if (status != VRAM_OK) {
        warn_oom(status);
        return NULL;
    }
    return p;
}

static void *np_realloc(void *ctx, void *ptr, size_t new_size) {
    if (!ptr) return np_malloc(ctx, new_size);
    vram_block_info_t info;
    vram_pool_t *owner = owner_pool(ptr);
    if (!owner || vram_block_query(owner, ptr, &info) != VRAM_OK) return NULL;
    /* Always move: keeping the old block would leave requested_bytes describing the old size. */
    void *fresh = np_malloc(ctx, new_size);
    if (!fresh) return NULL;
    memcpy(fresh, ptr, info.requested_size < new_size ? info.requested_size : new_size);
    if (vram_free(owner, ptr, vk_capture_context(owner)) != VRAM_OK) {
        /* unreachable: ptr was just found by vram_block_query */
    }
    return fresh;
}

static void np_free(void *ctx, void *ptr, size_t size) {
    (void)ctx;
    (void)size;
    /* NumPy frees through the handler that allocated, so ptr is ours; free has no error path.
     * Most arrays are the cpu pool's: try it first, then the private pools. */
    int freed = 0;
    if (!ptr || vram_try_free(cpu_pool, ptr, vk_capture_context(cpu_pool), &freed) != VRAM_OK || freed) return;
    vram_pool_t *owner = owner_pool(ptr);
    if (owner && vram_free(owner, ptr, vk_capture_context(owner)) != VRAM_OK) {
    }
}

static PyDataMem_Handler vramkit_handler = {
    "vramkit_cpu_pool",
    1,
    {NULL, np_malloc, np_calloc, np_realloc, np_free},
};

static int ensure_ready(void) {
    if (handler_capsule) return 0;
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    vram_status_t status = vram_device_pool((vram_device_t){VRAM_DEVICE_CPU, 0, 0}, &cpu_pool);
    if (status != VRAM_OK) {
        vk_raise(status);
        return -1;
    }
    handler_capsule = PyCapsule_New(&vramkit_handler, "mem_handler", NULL);
    return handler_capsule ? 0 : -1;
}

/* Install ours (or a given capsule, to restore a previous one); returns the previous one. */
static PyObject *set_handler(PyObject *self, PyObject *arg) {
    (void)self;
    if (ensure_ready() != 0) return NULL;
    return PyDataMem_SetHandler(arg == Py_None ? handler_capsule : arg);
}

static PyObject *get_handler(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (ensure_ready() != 0) return NULL;
    return PyDataMem_GetHandler();
}

static PyObject *handler(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (ensure_ready() != 0) return NULL;
    return Py_NewRef(handler_capsule);
}

/* _C.ndarray_info(a) -> (data_ptr, size, flags) with NumPy's NPY_ARRAY_* flag bits: the
 * gradient intake of vramkit.amp reads all three per array, and one call here costs a tenth
 * of a.__array_interface__ plus the attribute lookups. */
static PyObject *ndarray_info(PyObject *self, PyObject *a) {
    (void)self;
    static int api_ready;
    if (!api_ready) {
        if (PyArray_ImportNumPyAPI() < 0) return NULL;
        api_ready = 1;
    }
    if (!PyArray_Check(a)) return PyErr_Format(PyExc_TypeError, "expected a numpy.ndarray, not %.100s", Py_TYPE(a)->tp_name);
    PyArrayObject *arr = (PyArrayObject *)a;
    return Py_BuildValue("(KLi)", (unsigned long long)(uintptr_t)PyArray_DATA(arr), (long long)PyArray_SIZE(arr),
                         PyArray_FLAGS(arr));
}

static PyMethodDef methods[] = {
    {"ndarray_info", ndarray_info, METH_O, "ndarray_info(a) -> (data_ptr, size, NPY_ARRAY_* flags)"},
    {"numpy_set_handler", set_handler, METH_O,
     "numpy_set_handler(capsule_or_None) -> previous handler. None installs vramkit's handler."},
    {"numpy_get_handler", get_handler, METH_NOARGS, "The NumPy data-memory handler of the current context."},
    {"numpy_handler", handler, METH_NOARGS, "vramkit's handler capsule."},
    {NULL, NULL, 0, NULL},
};

int vk_numpy_init(PyObject *module) { return vk_add_methods(module, methods); }
