/* amp_numpy.c — the loss-scaling kernels' walk over a list of NumPy arrays, in C.
 *
 * The general walk (vramkit/amp/arrays.py) takes about a microsecond an array in Python: on a
 * 200-tensor set of 2 Mi elements that is as long as the unscale itself. NumPy arrays need no
 * attribute calls at all: their data pointer, dtype, flags, shape and strides are fields of the
 * array object, read here through NumPy's C API.
 *
 * Only the common case is taken: every item a numpy.ndarray (subclasses included, as the general
 * walk's isinstance does), writeable, of float32, float16 or float64 in native byte order, its
 * data aligned to its elements; dense (C- or Fortran-contiguous) or strided with positive strides
 * that are multiples of the element size and do not overlap; no two arrays sharing a byte.
 * Anything else returns None and the caller takes the general walk, which raises the specific
 * errors (a read-only array, a dtype it cannot scale, ...); so this file never raises for a bad
 * list, and a refused list changes nothing. */
#include "amp_spans.h"

#define NPY_NO_DEPRECATED_API NPY_1_22_API_VERSION
#define NPY_TARGET_VERSION NPY_1_22_API_VERSION
#include <numpy/arrayobject.h>

/* NumPy's C API table, imported on first use (so `import vramkit` does not import NumPy). */
static int api_ready(void) {
    static int ready;
    if (!ready) {
        if (PyArray_ImportNumPyAPI() < 0) return -1;
        ready = 1;
    }
    return 0;
}

static int code_of(int type_num) {
    switch (type_num) {
    case NPY_FLOAT: return VRAM_FLOAT32;
    case NPY_HALF: return VRAM_FLOAT16;
    case NPY_DOUBLE: return VRAM_FLOAT64;
    default: return -1; /* (bfloat16 is ml_dtypes' user dtype: the general walk reads it) */
    }
}

/* Add one array to s: 1 taken, 0 not one this walk takes, -1 out of memory (exception set). */
static int add_array(vk_spans_t *s, PyArrayObject *a) {
    int code = code_of(PyArray_TYPE(a));
    int flags = PyArray_FLAGS(a);
    if (code < 0 || !PyArray_ISNOTSWAPPED(a) || !(flags & NPY_ARRAY_WRITEABLE)) return 0;
    char *data = PyArray_DATA(a);
    size_t esize = vk_itemsize[code];
    npy_intp numel = PyArray_SIZE(a);
    if (numel > 0 && (uintptr_t)data % esize) return 0; /* (the kernels refuse it; the general walk says why) */
    if (numel == 0 || flags & (NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_F_CONTIGUOUS)) {
        vk_spans_add_dense(s, data, (int64_t)numel, (vram_dtype_t)code);
        return 1;
    }
    int nd = PyArray_NDIM(a);
    if (nd > VRAM_AMP_MAX_DIMS) return 0;
    int64_t dims[2 * VRAM_AMP_MAX_DIMS];
    const npy_intp *shape = PyArray_DIMS(a), *strides = PyArray_STRIDES(a);
    for (int d = 0; d < nd; d++) {
        if (strides[d] % (npy_intp)esize) return 0; /* misaligned elements */
        dims[d] = (int64_t)shape[d];
        dims[nd + d] = (int64_t)(strides[d] / (npy_intp)esize);
    }
    if (!vk_spans_layout_ok(dims, nd)) return 0;
    return vk_spans_add_strided(s, data, (vram_dtype_t)code, nd, dims) < 0 ? -1 : 1;
}

/* The spans of `arrays` (a list or tuple), NULL with no exception for a list the general walk
 * must take, NULL with an exception when out of memory. */
static vk_spans_t *walk(PyObject *arrays) {
    if (api_ready() < 0) return NULL;
    if (!PyList_CheckExact(arrays) && !PyTuple_CheckExact(arrays)) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(arrays);
    if (count == 0) return NULL;
    vk_spans_t *s = vk_spans_new(count);
    if (!s) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *a = PySequence_Fast_GET_ITEM(arrays, i);
        int taken = PyArray_Check(a) ? add_array(s, (PyArrayObject *)a) : 0;
        if (taken <= 0) {
            vk_spans_release(s);
            return NULL;
        }
    }
    return vk_spans_finish(s) > 0 ? s : NULL;
}

/* _C.amp_numpy_spans(arrays) -> spans or None: the capsule the kernel bindings take in place of
 * the (data_ptr, numel, dtype) triples. */
static PyObject *amp_numpy_spans(PyObject *self, PyObject *arrays) {
    (void)self;
    vk_spans_t *s = walk(arrays);
    if (!s) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return vk_spans_capsule(s);
}

/* _C.amp_numpy_unscale_check(arrays, inv_scale, want_sumsq) -> (found_inf, sumsq or None), or
 * None with nothing written for a list the general walk must take: amp_unscale_check, walk and
 * kernel, in one call. */
static PyObject *amp_numpy_unscale_check(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *arrays;
    float inv_scale;
    int want_sumsq;
    if (!PyArg_ParseTuple(args, "Ofp:amp_numpy_unscale_check", &arrays, &inv_scale, &want_sumsq)) return NULL;
    vk_spans_t *s = walk(arrays);
    if (!s) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    float found = 0.0f;
    double sumsq = 0.0;
    if (vk_spans_unscale(s, inv_scale, &found, want_sumsq ? &sumsq : NULL) < 0) return NULL;
    PyObject *flag = found != 0.0f ? Py_True : Py_False;
    if (want_sumsq) return Py_BuildValue("(Od)", flag, sumsq);
    return Py_BuildValue("(OO)", flag, Py_None);
}

static PyMethodDef methods[] = {
    {"amp_numpy_spans", amp_numpy_spans, METH_O,
     "amp_numpy_spans(arrays) -> spans for the amp kernels, or None for a list the general walk must take"},
    {"amp_numpy_unscale_check", amp_numpy_unscale_check, METH_VARARGS,
     "amp_numpy_unscale_check(arrays, inv_scale, want_sumsq) -> (found_inf, sumsq or None), or None"},
    {NULL, NULL, 0, NULL},
};

int vk_amp_numpy_init(PyObject *module) { return vk_add_methods(module, methods); }
