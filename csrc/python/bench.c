/* bench.c — allocation loops timed in C, for benchmarks/alloc.py: vramkit's cached
 * alloc+free pairs against glibc malloc/free over the same size sequence, so Python call
 * overhead is not part of the comparison. Each pass returns its mean ns per pair. */
#include "module.h"

#include <stdlib.h>

#include "../util/clock.h"

static int sizes_from(PyObject *obj, Py_buffer *view) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) return -1;
    if (view->itemsize != 8 || !view->format || (strcmp(view->format, "Q") && strcmp(view->format, "<Q") &&
                                                 strcmp(view->format, "L") && strcmp(view->format, "<L"))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "sizes must be a contiguous uint64 array");
        return -1;
    }
    return 0;
}

static PyObject *pass_times(const double *ns, int passes) {
    PyObject *list = PyList_New(passes);
    if (!list) return NULL;
    for (int i = 0; i < passes; i++) PyList_SET_ITEM(list, i, PyFloat_FromDouble(ns[i]));
    return list;
}

/* bench_pool_pairs(device, sizes, passes) -> [ns per pair, one per pass] */
static PyObject *bench_pool_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *device, *sizes_obj;
    int passes;
    vram_pool_t *pool;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "OOi:bench_pool_pairs", &device, &sizes_obj, &passes) ||
        vk_pool_from_arg(device, &pool) != 0 || sizes_from(sizes_obj, &view) != 0)
        return NULL;
    const uint64_t *sizes = view.buf;
    Py_ssize_t n = view.len / 8;
    double *ns = calloc((size_t)(passes > 0 ? passes : 1), sizeof *ns);
    if (!ns) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    vram_status_t status = VRAM_OK;
    Py_BEGIN_ALLOW_THREADS for (int p = 0; p < passes && status == VRAM_OK; p++) {
        uint64_t start = vram__now_ns();
        for (Py_ssize_t i = 0; i < n; i++) {
            void *ptr;
            status = vram_malloc(pool, sizes[i], 0, 0, &ptr);
            if (status != VRAM_OK) break;
            status = vram_free(pool, ptr, 0);
            if (status != VRAM_OK) break;
        }
        ns[p] = (double)(vram__now_ns() - start) / (double)(n ? n : 1);
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&view);
    PyObject *result = status == VRAM_OK ? pass_times(ns, passes) : vk_raise(status);
    free(ns);
    return result;
}

/* bench_malloc_pairs(sizes, passes) -> [ns per pair] with glibc malloc/free. */
static PyObject *bench_malloc_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sizes_obj;
    int passes;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "Oi:bench_malloc_pairs", &sizes_obj, &passes) || sizes_from(sizes_obj, &view) != 0)
        return NULL;
    const uint64_t *sizes = view.buf;
    Py_ssize_t n = view.len / 8;
    double *ns = calloc((size_t)(passes > 0 ? passes : 1), sizeof *ns);
    if (!ns) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS for (int p = 0; p < passes && !failed; p++) {
        uint64_t start = vram__now_ns();
        for (Py_ssize_t i = 0; i < n; i++) {
            void *volatile ptr = malloc(sizes[i]); /* volatile: keep the pair from being elided */
            if (!ptr) {
                failed = 1;
                break;
            }
            free(ptr);
        }
        ns[p] = (double)(vram__now_ns() - start) / (double)(n ? n : 1);
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&view);
    PyObject *result = failed ? PyErr_NoMemory() : pass_times(ns, passes);
    free(ns);
    return result;
}

static PyMethodDef methods[] = {
    {"bench_pool_pairs", bench_pool_pairs, METH_VARARGS,
     "bench_pool_pairs(device, sizes_u64, passes) -> ns per malloc+free pair, per pass"},
    {"bench_malloc_pairs", bench_malloc_pairs, METH_VARARGS,
     "bench_malloc_pairs(sizes_u64, passes) -> ns per glibc malloc+free pair, per pass"},
    {NULL, NULL, 0, NULL},
};

int vk_bench_init(PyObject *module) { return vk_add_methods(module, methods); }
