/* mempool.c — private pools for Python (vramkit.MemPool, vramkit.use_mem_pool): create one on a
 * device, start and end this thread's use of one, and count uses. A private pool is named like
 * a device ("sim:0/mempool:1"), so every counter, summary, snapshot and empty_cache function
 * takes it as its device argument. */
#include "module.h"

static PyObject *mempool_create(PyObject *self, PyObject *arg) {
    (void)self;
    vram_device_t device, pool;
    if (vk_device_from_arg(arg, &device) != 0) return NULL;
    vram_status_t status = vram_mempool_create(device, &pool);
    if (status != VRAM_OK) return vk_raise(status);
    return vk_device_name(pool);
}

static int mempool_from_arg(PyObject *arg, vram_device_t *out) {
    if (vk_device_from_arg(arg, out) != 0) return -1;
    if (out->mempool == 0) {
        PyErr_Format(PyExc_ValueError, "expected a private pool ('<device>/mempool:N', from vramkit.MemPool), got %R",
                     arg);
        return -1;
    }
    return 0;
}

static PyObject *mempool_use(PyObject *self, PyObject *arg) {
    (void)self;
    vram_device_t pool;
    if (mempool_from_arg(arg, &pool) != 0) return NULL;
    vram_status_t status = vram_mempool_use(pool);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *mempool_unuse(PyObject *self, PyObject *arg) {
    (void)self;
    vram_device_t pool;
    if (mempool_from_arg(arg, &pool) != 0) return NULL;
    vram_status_t status = vram_mempool_unuse(pool);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *mempool_use_count(PyObject *self, PyObject *arg) {
    (void)self;
    vram_device_t pool;
    if (mempool_from_arg(arg, &pool) != 0) return NULL;
    int count = vram_mempool_use_count(pool);
    if (count < 0) return PyErr_Format(PyExc_ValueError, "%R is not a private pool that exists", arg);
    return PyLong_FromLong(count);
}

static PyMethodDef methods[] = {
    {"mempool_create", mempool_create, METH_O, "mempool_create(device) -> the new private pool's name"},
    {"mempool_use", mempool_use, METH_O, "mempool_use(pool): this thread's allocations on its device go to it"},
    {"mempool_unuse", mempool_unuse, METH_O, "mempool_unuse(pool): end the innermost use (it must be pool)"},
    {"mempool_use_count", mempool_use_count, METH_O, "mempool_use_count(pool) -> active uses on all threads"},
    {NULL, NULL, 0, NULL},
};

int vk_mempool_init(PyObject *module) { return vk_add_methods(module, methods); }
