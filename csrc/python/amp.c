/* amp.c — bindings of the loss-scaling kernels. The Python layer (vramkit/amp.py and
 * vramkit/_arrays.py) turns NumPy arrays, torch tensors, CuPy arrays and vramkit buffers into
 * (data pointer, numel, dtype code) triples after checking them; this file only converts
 * those triples (or takes the spans amp_torch.c walked for plain torch tensors) and calls C
 * with the GIL released. */
#include "dlpack.h"
#include "module.h"

#define STACK_TENSORS 32

/* Fill `out` (count entries) from a sequence of (ptr, numel, dtype) tuples. */
static int parse_tensors(PyObject *seq, vram_tensor_t *out, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long long ptr;
        long long numel;
        int dtype;
        if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "KLi", &ptr, &numel, &dtype)) {
            if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_TypeError)) {
                PyErr_Clear();
                PyErr_Format(PyExc_TypeError, "tensor %zd: expected a (data_ptr, numel, dtype_code) tuple", i);
            }
            return -1;
        }
        out[i] = (vram_tensor_t){(void *)(uintptr_t)ptr, numel, (vram_dtype_t)dtype};
    }
    return 0;
}

/* A tensor list held for the duration of one call: on the stack when short. */
typedef struct tensor_list {
    vram_tensor_t stack[STACK_TENSORS];
    vram_tensor_t *items;
    Py_ssize_t count;
    PyObject *seq;
} tensor_list_t;

static int list_open(tensor_list_t *l, PyObject *obj) {
    l->items = l->stack;
    Py_ssize_t strided_count;
    const vram_tensor_t *spans = vk_amp_spans(obj, &l->count, &strided_count);
    if (spans) { /* walked in C already (amp_torch.c): used in place, the capsule held meanwhile
                  * (its strided tensors, if any, run_kernel takes from the capsule itself) */
        l->items = (vram_tensor_t *)spans;
        l->seq = Py_NewRef(obj);
        return 0;
    }
    l->seq = PySequence_Fast(obj, "tensors must be a sequence of (data_ptr, numel, dtype_code) tuples");
    if (!l->seq) return -1;
    l->count = PySequence_Fast_GET_SIZE(l->seq);
    if (l->count > STACK_TENSORS) {
        l->items = PyMem_New(vram_tensor_t, (size_t)l->count);
        if (!l->items) {
            Py_DECREF(l->seq);
            PyErr_NoMemory();
            return -1;
        }
    }
    if (parse_tensors(l->seq, l->items, l->count) < 0) {
        if (l->items != l->stack) PyMem_Free(l->items);
        Py_DECREF(l->seq);
        return -1;
    }
    return 0;
}

static void list_close(tensor_list_t *l) {
    if (l->items != l->stack && !PyCapsule_CheckExact(l->seq)) PyMem_Free(l->items);
    Py_DECREF(l->seq);
}

/* ---- strided (not dense) tensors: (data_ptr, dtype_code, shape, strides) tuples ---- */

typedef struct strided_list {
    vram_strided_tensor_t *items;
    int64_t *dims; /* shapes and strides of every tensor, back to back */
    Py_ssize_t count;
} strided_list_t;

static void strided_close(strided_list_t *l) {
    PyMem_Free(l->items);
    PyMem_Free(l->dims);
}

/* Read a tuple of ints into out[0..n); -1 with an exception naming tensor i. */
static int parse_dims(PyObject *tup, Py_ssize_t i, const char *what, int64_t *out, Py_ssize_t n) {
    for (Py_ssize_t k = 0; k < n; k++) {
        long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(tup, k));
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "tensor %zd: %s must be a tuple of ints in the int64 range", i, what);
            return -1;
        }
        out[k] = v;
    }
    return 0;
}

static int strided_open(strided_list_t *l, PyObject *obj) {
    l->items = NULL;
    l->dims = NULL;
    PyObject *seq = PySequence_Fast(obj, "tensors must be a sequence of (data_ptr, dtype_code, shape, strides) tuples");
    if (!seq) return -1;
    l->count = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < l->count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 4 || !PyTuple_Check(PyTuple_GET_ITEM(t, 2)) ||
            !PyTuple_Check(PyTuple_GET_ITEM(t, 3)) ||
            PyTuple_GET_SIZE(PyTuple_GET_ITEM(t, 2)) != PyTuple_GET_SIZE(PyTuple_GET_ITEM(t, 3))) {
            PyErr_Format(PyExc_TypeError, "tensor %zd: expected a (data_ptr, dtype_code, shape, strides) tuple with "
                         "shape and strides tuples of one length", i);
            goto fail;
        }
        Py_ssize_t nd = PyTuple_GET_SIZE(PyTuple_GET_ITEM(t, 2));
        if (nd > VRAM_AMP_MAX_DIMS) {
            PyErr_Format(PyExc_ValueError, "tensor %zd: %zd dimensions (allowed: at most %d)", i, nd, VRAM_AMP_MAX_DIMS);
            goto fail;
        }
        total += 2 * nd;
    }
    l->items = PyMem_New(vram_strided_tensor_t, (size_t)(l->count ? l->count : 1));
    l->dims = PyMem_New(int64_t, (size_t)(total ? total : 1));
    if (!l->items || !l->dims) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t *d = l->dims;
    for (Py_ssize_t i = 0; i < l->count; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, i);
        unsigned long long ptr = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0));
        long dtype = PyLong_AsLong(PyTuple_GET_ITEM(t, 1));
        if (PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "tensor %zd: data_ptr and dtype_code must be ints", i);
            goto fail;
        }
        PyObject *shape = PyTuple_GET_ITEM(t, 2), *strides = PyTuple_GET_ITEM(t, 3);
        Py_ssize_t nd = PyTuple_GET_SIZE(shape);
        if (parse_dims(shape, i, "shape", d, nd) < 0 || parse_dims(strides, i, "strides", d + nd, nd) < 0) goto fail;
        l->items[i] = (vram_strided_tensor_t){(void *)(uintptr_t)ptr, (vram_dtype_t)dtype, (int32_t)nd, d, d + nd};
        d += 2 * nd;
    }
    Py_DECREF(seq);
    return 0;
fail:
    Py_DECREF(seq);
    strided_close(l);
    return -1;
}

/* ---- the kernel bindings: one path from a Python tensor list to C, without the GIL ---- */

/* Which C entry point a binding calls, with its scalar arguments and results. */
typedef enum kernel { UNSCALE_CHECK, SCALE_INPLACE, UNSCALE_CHECK_CUDA, SCALE_INPLACE_CUDA } kernel_t;

typedef struct kernel_call {
    kernel_t kernel;
    int strided;   /* tensors are (data_ptr, dtype_code, shape, strides) tuples (CPU kernels only) */
    float factor;  /* CPU: inv_scale or the factor */
    float found;   /* CPU unscale: set to 1 when an inf/NaN is found */
    double *sumsq; /* CPU unscale: the sum of squares, or NULL */
    unsigned long long factor_ptr, found_ptr, sumsq_ptr, stream; /* CUDA: device pointers, the stream */
    int device;
} kernel_call_t;

/* Called without the GIL. */
static vram_status_t call_dense(kernel_call_t *c, const vram_tensor_t *t, size_t n) {
    switch (c->kernel) {
    case UNSCALE_CHECK: return vram_amp_unscale_check(t, n, c->factor, &c->found, c->sumsq);
    case SCALE_INPLACE: return vram_amp_scale_inplace(t, n, c->factor);
    case UNSCALE_CHECK_CUDA:
        return vram_amp_unscale_check_cuda(t, n, (const float *)(uintptr_t)c->factor_ptr,
                                           (float *)(uintptr_t)c->found_ptr, (double *)(uintptr_t)c->sumsq_ptr,
                                           (vram_stream_t)c->stream, c->device);
    case SCALE_INPLACE_CUDA:
        return vram_amp_scale_inplace_cuda(t, n, (const float *)(uintptr_t)c->factor_ptr, (vram_stream_t)c->stream,
                                           c->device);
    }
    return VRAM_ERR_INVALID_ARG; /* not reached: every kernel is listed */
}

static vram_status_t call_strided(kernel_call_t *c, const vram_strided_tensor_t *t, size_t n) {
    if (c->kernel == UNSCALE_CHECK) return vram_amp_unscale_check_strided(t, n, c->factor, &c->found, c->sumsq);
    return vram_amp_scale_inplace_strided(t, n, c->factor);
}

/* Parse `obj` as the call's tensor list and run the call with the GIL released: 0, or -1
 * with the exception set. */
static int run_kernel(PyObject *obj, kernel_call_t *c) {
    tensor_list_t dense;
    strided_list_t strided;
    if ((c->strided ? strided_open(&strided, obj) : list_open(&dense, obj)) < 0) return -1;
    /* A capsule of amp_torch.c's spans may hold strided CPU tensors besides the dense ones: they
     * run after them (their layouts were checked in the walk, so they cannot be refused once the
     * dense ones are written), with their own sum of squares. */
    Py_ssize_t n_extra = 0;
    const vram_strided_tensor_t *extra = c->strided ? NULL : vk_amp_strided_spans(obj, &n_extra);
    if (extra && n_extra && (c->kernel == UNSCALE_CHECK_CUDA || c->kernel == SCALE_INPLACE_CUDA)) {
        list_close(&dense);
        PyErr_SetString(PyExc_ValueError, "the CUDA kernels take dense tensors only");
        return -1;
    }
    vram_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = c->strided ? call_strided(c, strided.items, (size_t)strided.count)
                    : call_dense(c, dense.items, (size_t)dense.count);
    if (st == VRAM_OK && extra && n_extra) {
        double *dense_sumsq = c->sumsq, extra_sumsq = 0.0;
        if (dense_sumsq) c->sumsq = &extra_sumsq;
        st = call_strided(c, extra, (size_t)n_extra);
        if (dense_sumsq) {
            *dense_sumsq += extra_sumsq;
            c->sumsq = dense_sumsq;
        }
    }
    Py_END_ALLOW_THREADS
    if (c->strided) strided_close(&strided);
    else list_close(&dense);
    if (st == VRAM_OK) return 0;
    vk_raise(st);
    return -1;
}

/* _C.amp_unscale_check[_strided](tensors, inv_scale, want_sumsq) -> (found_inf: bool, sumsq: float | None) */
static PyObject *unscale_check(PyObject *args, int strided) {
    PyObject *obj;
    int want_sumsq;
    double sumsq = 0.0;
    kernel_call_t c = {.kernel = UNSCALE_CHECK, .strided = strided};
    if (!PyArg_ParseTuple(args, strided ? "Ofp:amp_unscale_check_strided" : "Ofp:amp_unscale_check", &obj,
                          &c.factor, &want_sumsq))
        return NULL;
    c.sumsq = want_sumsq ? &sumsq : NULL;
    if (run_kernel(obj, &c) < 0) return NULL;
    if (want_sumsq) return Py_BuildValue("(Od)", c.found != 0.0f ? Py_True : Py_False, sumsq);
    return Py_BuildValue("(OO)", c.found != 0.0f ? Py_True : Py_False, Py_None);
}

/* _C.amp_scale_inplace[_strided](tensors, factor) */
static PyObject *scale_inplace(PyObject *args, int strided) {
    PyObject *obj;
    kernel_call_t c = {.kernel = SCALE_INPLACE, .strided = strided};
    if (!PyArg_ParseTuple(args, strided ? "Of:amp_scale_inplace_strided" : "Of:amp_scale_inplace", &obj, &c.factor))
        return NULL;
    if (run_kernel(obj, &c) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *amp_unscale_check(PyObject *self, PyObject *args) { (void)self; return unscale_check(args, 0); }
static PyObject *amp_unscale_check_strided(PyObject *self, PyObject *args) { (void)self; return unscale_check(args, 1); }
static PyObject *amp_scale_inplace(PyObject *self, PyObject *args) { (void)self; return scale_inplace(args, 0); }
static PyObject *amp_scale_inplace_strided(PyObject *self, PyObject *args) { (void)self; return scale_inplace(args, 1); }

/* The policy tuple: (growth_factor, backoff_factor, growth_interval, hysteresis, min_scale, max_scale). */
static int parse_policy(PyObject *obj, vram_scale_policy_t *p) {
    if (!PyArg_ParseTuple(obj, "ddiiff;policy must be (growth_factor, backoff_factor, growth_interval, "
                               "hysteresis, min_scale, max_scale)",
                          &p->growth_factor, &p->backoff_factor, &p->growth_interval, &p->hysteresis,
                          &p->min_scale, &p->max_scale))
        return -1;
    return 0;
}

/* _C.amp_update_scale(scale_ptr, growth_tracker_ptr, hysteresis_tracker_ptr, found_inf_ptr, policy)
 * Host memory: a float32 scale, int32 trackers (hysteresis_tracker_ptr 0 = none) and a
 * float32 found_inf, updated in place. */
static PyObject *amp_update_scale(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long scale, tracker, hyst, found;
    PyObject *policy_obj;
    if (!PyArg_ParseTuple(args, "KKKKO!:amp_update_scale", &scale, &tracker, &hyst, &found, &PyTuple_Type,
                          &policy_obj))
        return NULL;
    vram_scale_policy_t policy;
    if (parse_policy(policy_obj, &policy) < 0) return NULL;
    if (!found) return PyErr_Format(PyExc_ValueError, "found_inf pointer is 0");
    float found_inf = *(const float *)(uintptr_t)found;
    vram_status_t st = vram_amp_update_scale((float *)(uintptr_t)scale, (int32_t *)(uintptr_t)tracker,
                                             (int32_t *)(uintptr_t)hyst, found_inf, &policy);
    if (st != VRAM_OK) return vk_raise(st);
    Py_RETURN_NONE;
}

/* _C.amp_check_policy(policy): ValueError naming the bad field, else None. */
static PyObject *amp_check_policy(PyObject *self, PyObject *arg) {
    (void)self;
    vram_scale_policy_t policy;
    if (!PyTuple_Check(arg)) return PyErr_Format(PyExc_TypeError, "policy must be a tuple");
    if (parse_policy(arg, &policy) < 0) return NULL;
    vram_status_t st = vram_scale_policy_check(&policy);
    if (st != VRAM_OK) return vk_raise(st);
    Py_RETURN_NONE;
}

/* ---- CUDA: every pointer is device memory on `device`; work is queued on `stream` ---- */

static PyObject *amp_unscale_check_cuda(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    kernel_call_t c = {.kernel = UNSCALE_CHECK_CUDA};
    if (!PyArg_ParseTuple(args, "OKKKKi:amp_unscale_check_cuda", &obj, &c.factor_ptr, &c.found_ptr, &c.sumsq_ptr,
                          &c.stream, &c.device))
        return NULL;
    if (run_kernel(obj, &c) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *amp_scale_inplace_cuda(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj;
    kernel_call_t c = {.kernel = SCALE_INPLACE_CUDA};
    if (!PyArg_ParseTuple(args, "OKKi:amp_scale_inplace_cuda", &obj, &c.factor_ptr, &c.stream, &c.device)) return NULL;
    if (run_kernel(obj, &c) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *amp_clip_coef_cuda(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long sumsq, coef, norm, stream;
    double max_norm;
    int device;
    if (!PyArg_ParseTuple(args, "KdKKKi:amp_clip_coef_cuda", &sumsq, &max_norm, &coef, &norm, &stream, &device))
        return NULL;
    vram_status_t st = vram_amp_clip_coef_cuda((const double *)(uintptr_t)sumsq, max_norm, (float *)(uintptr_t)coef,
                                               (float *)(uintptr_t)norm, (vram_stream_t)stream, device);
    if (st != VRAM_OK) return vk_raise(st);
    Py_RETURN_NONE;
}

static PyObject *amp_update_scale_cuda(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long scale, tracker, hyst, found, stream;
    PyObject *policy_obj;
    int device;
    if (!PyArg_ParseTuple(args, "KKKKO!Ki:amp_update_scale_cuda", &scale, &tracker, &hyst, &found, &PyTuple_Type,
                          &policy_obj, &stream, &device))
        return NULL;
    vram_scale_policy_t policy;
    if (parse_policy(policy_obj, &policy) < 0) return NULL;
    vram_status_t st = vram_amp_update_scale_cuda((float *)(uintptr_t)scale, (int32_t *)(uintptr_t)tracker,
                                                  (int32_t *)(uintptr_t)hyst, (const float *)(uintptr_t)found,
                                                  &policy, (vram_stream_t)stream, device);
    if (st != VRAM_OK) return vk_raise(st);
    Py_RETURN_NONE;
}

/* ---- DLPack intake ---- */

/* _C.dlpack_describe(capsule) -> (data_ptr, shape, strides | None, dtype_code, dtype_bits, lanes,
 * device_type, device_id, readonly). Reads a capsule from obj.__dlpack__() without consuming
 * it: the producer's deleter still runs when the capsule is released, so the caller keeps
 * the capsule alive while it uses the pointer. */
static PyObject *dlpack_describe(PyObject *self, PyObject *capsule) {
    (void)self;
    const vk_dl_tensor_t *t = NULL;
    int readonly = 0;
    if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        vk_dl_managed_versioned_t *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        if (!m) return NULL;
        if (m->version.major != 1)
            return PyErr_Format(PyExc_TypeError, "unsupported DLPack version %u.%u (vramkit reads 1.x)",
                                m->version.major, m->version.minor);
        t = &m->dl_tensor;
        readonly = (m->flags & 1u) != 0; /* DLPACK_FLAG_BITMASK_READ_ONLY */
    } else if (PyCapsule_IsValid(capsule, "dltensor")) {
        vk_dl_managed_t *m = PyCapsule_GetPointer(capsule, "dltensor");
        if (!m) return NULL;
        t = &m->dl_tensor;
    } else {
        return PyErr_Format(PyExc_TypeError, "expected an unconsumed DLPack capsule");
    }
    if (t->ndim < 0 || t->ndim > 64) return PyErr_Format(PyExc_ValueError, "DLPack tensor has ndim %d", t->ndim);
    PyObject *shape = PyTuple_New(t->ndim), *strides = NULL;
    if (!shape) return NULL;
    for (int i = 0; i < t->ndim; i++) PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(t->shape[i]));
    if (t->strides) {
        strides = PyTuple_New(t->ndim);
        if (!strides) {
            Py_DECREF(shape);
            return NULL;
        }
        for (int i = 0; i < t->ndim; i++) PyTuple_SET_ITEM(strides, i, PyLong_FromLongLong(t->strides[i]));
    } else {
        strides = Py_NewRef(Py_None);
    }
    return Py_BuildValue("(KNNiiiiii)", (unsigned long long)((uintptr_t)t->data + t->byte_offset), shape, strides,
                         (int)t->dtype.code, (int)t->dtype.bits, (int)t->dtype.lanes, (int)t->device.device_type,
                         (int)t->device.device_id, readonly);
}

/* ---- threads and SIMD path ---- */

static PyObject *get_num_threads(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLong(vram_get_num_threads());
}

static PyObject *set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    int n = PyLong_Check(arg) ? _PyLong_AsInt(arg) : -1;
    if (!PyLong_Check(arg)) return PyErr_Format(PyExc_TypeError, "num_threads must be an int, not %.100s", Py_TYPE(arg)->tp_name);
    if (n == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        n = 0; /* out of int range: let C reject it with the range in the message */
    }
    vram_status_t st = vram_set_num_threads(n);
    if (st != VRAM_OK) return vk_raise(st);
    Py_RETURN_NONE;
}

static PyObject *simd_path(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyUnicode_FromString(vram_simd_path());
}

static PyObject *simd_supported(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    return PyBool_FromLong(vram_simd_supported(name));
}

static PyObject *set_simd_path(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    vram_status_t st = vram_set_simd_path(name);
    if (st != VRAM_OK) return vk_raise(st);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"amp_unscale_check", amp_unscale_check, METH_VARARGS,
     "amp_unscale_check(tensors, inv_scale, want_sumsq) -> (found_inf, sumsq or None)"},
    {"amp_scale_inplace", amp_scale_inplace, METH_VARARGS, "amp_scale_inplace(tensors, factor)"},
    {"amp_unscale_check_strided", amp_unscale_check_strided, METH_VARARGS,
     "amp_unscale_check_strided(tensors, inv_scale, want_sumsq) -> (found_inf, sumsq or None); tensors of "
     "(data_ptr, dtype_code, shape, strides_in_elements)"},
    {"amp_scale_inplace_strided", amp_scale_inplace_strided, METH_VARARGS,
     "amp_scale_inplace_strided(tensors, factor)"},
    {"amp_update_scale", amp_update_scale, METH_VARARGS,
     "amp_update_scale(scale_ptr, growth_tracker_ptr, hysteresis_tracker_ptr, found_inf_ptr, policy)"},
    {"amp_check_policy", amp_check_policy, METH_O, "amp_check_policy(policy)"},
    {"amp_unscale_check_cuda", amp_unscale_check_cuda, METH_VARARGS,
     "amp_unscale_check_cuda(tensors, inv_scale_ptr, found_inf_ptr, sumsq_ptr, stream, device)"},
    {"amp_scale_inplace_cuda", amp_scale_inplace_cuda, METH_VARARGS,
     "amp_scale_inplace_cuda(tensors, factor_ptr, stream, device)"},
    {"amp_clip_coef_cuda", amp_clip_coef_cuda, METH_VARARGS,
     "amp_clip_coef_cuda(sumsq_ptr, max_norm, coef_ptr, norm_ptr, stream, device)"},
    {"amp_update_scale_cuda", amp_update_scale_cuda, METH_VARARGS,
     "amp_update_scale_cuda(scale_ptr, growth_tracker_ptr, hysteresis_tracker_ptr, found_inf_ptr, policy, stream, "
     "device)"},
    {"dlpack_describe", dlpack_describe, METH_O,
     "dlpack_describe(capsule) -> (ptr, shape, strides, code, bits, lanes, device_type, device_id, readonly)"},
    {"get_num_threads", get_num_threads, METH_NOARGS, "get_num_threads() -> int"},
    {"set_num_threads", set_num_threads, METH_O, "set_num_threads(n)"},
    {"simd_path", simd_path, METH_NOARGS, "simd_path() -> 'avx512' | 'avx2' | 'portable'"},
    {"simd_supported", simd_supported, METH_O, "simd_supported(name) -> bool"},
    {"set_simd_path", set_simd_path, METH_O, "set_simd_path(name)"},
    {NULL, NULL, 0, NULL},
};

int vk_amp_init(PyObject *module) { return vk_add_methods(module, methods); }
