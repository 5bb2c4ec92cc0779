/* cuda_tools.c — test helpers that touch CUDA memory (built only with CUDA): fill a range
 * with a seeded pattern and count words that differ, to prove allocations never overlap. */
#include "module.h"

#ifdef VRAMKIT_WITH_CUDA
#include "../kernels/pattern.h"

static PyObject *fill_pattern(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptr, nbytes, stream;
    unsigned int seed;
    if (!PyArg_ParseTuple(args, "KKIK:_cuda_fill_pattern", &ptr, &nbytes, &seed, &stream)) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS err = vram__cuda_fill_pattern(ptr, nbytes, seed, stream);
    Py_END_ALLOW_THREADS if (err) return PyErr_Format(PyExc_RuntimeError, "fill_pattern: %s",
                                                      vram__cuda_error_string(err));
    Py_RETURN_NONE;
}

static PyObject *count_mismatches(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long ptr, nbytes, stream;
    unsigned int seed;
    uint64_t mismatches = 0;
    if (!PyArg_ParseTuple(args, "KKIK:_cuda_count_mismatches", &ptr, &nbytes, &seed, &stream)) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS err = vram__cuda_count_mismatches(ptr, nbytes, seed, stream, &mismatches);
    Py_END_ALLOW_THREADS if (err) return PyErr_Format(PyExc_RuntimeError, "count_mismatches: %s",
                                                      vram__cuda_error_string(err));
    return PyLong_FromUnsignedLongLong(mismatches);
}

static PyMethodDef methods[] = {
    {"_cuda_fill_pattern", fill_pattern, METH_VARARGS, "_cuda_fill_pattern(ptr, nbytes, seed, stream)"},
    {"_cuda_count_mismatches", count_mismatches, METH_VARARGS,
     "_cuda_count_mismatches(ptr, nbytes, seed, stream) -> words differing from the pattern"},
    {NULL, NULL, 0, NULL},
};

int vk_cuda_tools_init(PyObject *module) { return vk_add_methods(module, methods); }

#else

int vk_cuda_tools_init(PyObject *module) {
    (void)module;
    return 0;
}

#endif
