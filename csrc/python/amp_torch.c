/* amp_torch.c — the loss-scaling kernels' tensor walk for a list of plain torch tensors, in C.
 *
 * The general walk (vramkit/amp/arrays.py) reads each tensor's data pointer, size, dtype,
 * device and layout in Python, builds a tuple per tensor, checks overlaps in Python, and the
 * binding then parses the tuples again: about 2 microseconds a tensor, ten times torch's whole
 * _amp_foreach_non_finite_check_and_unscale_ on 200 small CPU tensors. Here the same facts are
 * read with five descriptor calls, the overlap check is a sort in C, and the result is a
 * capsule of vram_tensor_t spans that the kernel bindings (amp.c) take in place of the tuples.
 *
 * Only the common case is taken: every item exactly a torch.Tensor (not a subclass: a DTensor's
 * or a Parameter's data pointer means something else, or nothing), with a data pointer (sparse,
 * CSR and MKL-DNN layouts have none; a meta tensor's is NULL), of a dtype the kernels take, all
 * on the CPU or all on one CUDA device (meta, XPU and other devices are refused), none
 * overlapping.
 * Anything else returns None and the caller takes the general walk, which raises the specific
 * errors; so this file never raises for a bad list, and a refused list changes nothing. */
#include <string.h>

#include "amp_spans.h"

/* The attributes read, looked up once on torch.Tensor and called as descriptors: a getset's
 * __get__ or a method descriptor's vectorcall with the tensor as self, without the attribute
 * lookup through the type's MRO that t.<name> does each time (a third of the walk's time). */
enum { DTYPE, NBYTES, IS_CPU, IS_CUDA, SHAPE, /* getsets; then methods: */ IS_CONTIGUOUS, DATA_PTR, GET_DEVICE,
       STRIDE, N_ATTRS };
static const char *const attr_names[N_ATTRS] = {"dtype", "nbytes", "is_cpu", "is_cuda", "shape", "is_contiguous",
                                                 "data_ptr", "get_device", "stride"};
static PyObject *attr_descr[N_ATTRS];
static PyObject *attr_type; /* the torch.Tensor they were looked up on (a strong reference) */

static int look_up(PyObject *tensor_type) {
    if (attr_type == tensor_type) return 0;
    PyObject *found[N_ATTRS] = {0};
    for (int i = 0; i < N_ATTRS; i++) {
        found[i] = PyObject_GetAttrString(tensor_type, attr_names[i]);
        if (!found[i]) {
            for (int j = 0; j < i; j++) Py_DECREF(found[j]);
            return -1;
        }
    }
    for (int i = 0; i < N_ATTRS; i++) Py_XSETREF(attr_descr[i], found[i]);
    Py_XSETREF(attr_type, Py_NewRef(tensor_type));
    return 0;
}

/* t.<attr> (a getset) or t.<attr>() (a method), as a new reference; NULL with the error cleared. */
static PyObject *read_attr(PyObject *t, int attr) {
    PyObject *d = attr_descr[attr], *r;
    descrgetfunc get = Py_TYPE(d)->tp_descr_get;
    if (attr >= IS_CONTIGUOUS) r = PyObject_Vectorcall(d, &t, 1, NULL); /* the methods */
    else r = get ? get(d, t, (PyObject *)Py_TYPE(t)) : NULL;
    if (!r) PyErr_Clear();
    return r;
}

/* An int as a C integer; sets *failed (no exception left) when it is not one that fits.
 * (The AndOverflow form: on 3.11 PyLong_AsLongLong takes a byte-array detour for every int
 * above 2**30, which a data pointer always is.) */
static long long as_int(PyObject *r, int *failed) {
    int overflow = 0;
    long long v = r ? PyLong_AsLongLongAndOverflow(r, &overflow) : -1;
    if (!r || overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *failed = 1;
    }
    return v;
}

/* t.<attr>() as a C integer; sets *failed (no exception left) when it is not one. */
static long long call_int(PyObject *t, int attr, int *failed) {
    PyObject *r = read_attr(t, attr);
    long long v = as_int(r, failed);
    Py_XDECREF(r);
    return v;
}

/* Read t.shape and t.stride() into dims[0..2*ndim) and decide from them what
 * t.is_contiguous() would say (size-1 dimensions aside, each stride the product of the sizes
 * after it; an empty tensor counts as contiguous): returns the number of dimensions with
 * *numel and *dense set, or -1 when they cannot be read or the layout is not one the kernels
 * take as it is: more than VRAM_AMP_MAX_DIMS dimensions, a stride that is not positive under a
 * dimension of more than one element (an expanded tensor would be unscaled twice over), or
 * dimensions that overlap (sorted by stride, each stride at least the span of the ones below). */
static int read_layout(PyObject *t, int64_t *dims, int64_t *numel, int *dense) {
    PyObject *size = read_attr(t, SHAPE), *stride = size ? read_attr(t, STRIDE) : NULL;
    int nd = -1;
    if (size && stride && PyTuple_Check(size) && PyTuple_Check(stride) &&
        PyTuple_GET_SIZE(size) == PyTuple_GET_SIZE(stride) && PyTuple_GET_SIZE(size) <= VRAM_AMP_MAX_DIMS) {
        nd = (int)PyTuple_GET_SIZE(size);
        int failed = 0;
        for (int d = 0; d < nd; d++) {
            dims[d] = as_int(PyTuple_GET_ITEM(size, d), &failed);
            dims[nd + d] = as_int(PyTuple_GET_ITEM(stride, d), &failed);
            failed |= dims[d] < 0;
        }
        if (failed) nd = -1;
    }
    PyErr_Clear();
    Py_XDECREF(size);
    Py_XDECREF(stride);
    if (nd < 0) return -1;
    int64_t n = 1, expected = 1;
    int contiguous = 1;
    for (int d = nd - 1; d >= 0; d--) {
        if (__builtin_mul_overflow(n, dims[d], &n)) return -1;
        if (dims[d] == 1) continue;
        contiguous = contiguous && dims[nd + d] == expected;
        if (contiguous && __builtin_mul_overflow(expected, dims[d], &expected)) return -1;
    }
    *numel = n;
    *dense = contiguous || n == 0;
    return *dense || vk_spans_layout_ok(dims, nd) ? nd : -1;
}

/* Walk `tensors`: 0 with *out the spans (device and dtype bits set), 0 with *out NULL when
 * the list is one the general walk must take, -1 with an exception (out of memory). */
static int walk(PyObject *tensors, PyObject *tensor_type, PyObject *const dtypes[4], vk_spans_t **out,
                long long *device_out, unsigned *mask_out) {
    *out = NULL;
    if (look_up(tensor_type) < 0) return -1;
    if (!PyList_CheckExact(tensors) && !PyTuple_CheckExact(tensors)) return 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(tensors);
    if (count == 0) return 0;
    vk_spans_t *s = vk_spans_new(count);
    if (!s) return -1;
    int64_t dims[2 * VRAM_AMP_MAX_DIMS];
    long long device = -2; /* not yet known */
    unsigned mask = 0;
    int failed = 0, taken = 0, after_strided = 0;
    for (Py_ssize_t i = 0; i < count && !failed; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(tensors, i);
        /* (a later tensor's object, asked for now: its cache miss then overlaps this one's reads) */
        if (i + 4 < count) __builtin_prefetch(PySequence_Fast_GET_ITEM(tensors, i + 4), 0, 3);
        if ((PyObject *)Py_TYPE(t) != tensor_type) break;
        int code = -1;
        PyObject *dt = read_attr(t, DTYPE);
        for (int c = 0; c < 4 && dt; c++)
            if (dt == dtypes[c]) code = c;
        Py_XDECREF(dt);
        if (code < 0) break;
        /* The device: the CPU, or a CUDA device's index; any other (meta, whose data pointer is
         * NULL; XPU, MPS, ...) falls back. Getsets first: cheaper than get_device(). */
        PyObject *cpu = read_attr(t, IS_CPU), *cuda = cpu == Py_False ? read_attr(t, IS_CUDA) : NULL;
        long long dev = cpu == Py_True ? -1 : cuda == Py_True ? call_int(t, GET_DEVICE, &failed) : -3;
        Py_XDECREF(cpu);
        Py_XDECREF(cuda);
        if (failed || dev == -3 || (device != -2 && dev != device)) break;
        device = dev;
        /* The layout. Most lists are all dense: is_contiguous() then nbytes, two cheap reads.
         * After a strided tensor the next is likely strided too: read its shape and strides
         * first, which also say whether it is contiguous and how many elements it has (five
         * reads a strided tensor instead of seven; the descriptor calls are the walk's cost). */
        int dense = -1, nd = 0;
        int64_t numel = -1;
        if (!after_strided) {
            PyObject *contiguous = read_attr(t, IS_CONTIGUOUS);
            if (!contiguous) break;
            dense = contiguous == Py_True;
            Py_DECREF(contiguous);
        }
        if (dense != 1 && (nd = read_layout(t, dims, &numel, &dense)) < 0) break;
        if (!dense && dev >= 0) break; /* the CPU's strided kernels take it in place; CUDA's take dense tensors only */
        after_strided = !dense;
        /* (sparse, CSR and MKL-DNN tensors have no data pointer: data_ptr() raises, and they fall back) */
        long long ptr = call_int(t, DATA_PTR, &failed);
        if (failed) break;
        if (dense && numel < 0) {
            long long nbytes = call_int(t, NBYTES, &failed);
            if (failed) break;
            numel = (int64_t)(nbytes / (long long)vk_itemsize[code]);
        }
        if (ptr == 0 && numel != 0) break; /* (no memory behind it: the general walk decides) */
        mask |= 1u << code;
        if (dense) {
            s->items[s->count++] = (vram_tensor_t){(void *)(uintptr_t)ptr, numel, (vram_dtype_t)code};
        } else if (vk_spans_add_strided(s, (void *)(uintptr_t)ptr, (vram_dtype_t)code, nd, dims) < 0) {
            vk_spans_release(s);
            return -1;
        }
        taken++;
    }
    if (taken != count) { /* an item the walk does not take: the general walk decides (and raises) */
        vk_spans_release(s);
        return 0;
    }
    int ready = vk_spans_finish(s);
    if (ready <= 0) return ready; /* (released: overlapping, for the general walk; or out of memory) */
    *out = s;
    *device_out = device;
    *mask_out = mask;
    return 0;
}

static int parse_consts(PyObject *consts, PyObject **tensor_type, PyObject *dtypes[4]) {
    return PyArg_ParseTuple(consts, "OOOOO;consts must be (torch.Tensor, float32, float16, bfloat16, float64)",
                            tensor_type, &dtypes[VRAM_FLOAT32], &dtypes[VRAM_FLOAT16], &dtypes[VRAM_BFLOAT16],
                            &dtypes[VRAM_FLOAT64]) ? 0 : -1;
}

/* _C.amp_torch_spans(tensors, consts) -> (spans, device, dtypes) or None.
 * consts: (torch.Tensor, torch.float32, torch.float16, torch.bfloat16, torch.float64).
 * device: -1 for the CPU, else the CUDA device index; dtypes: a bit per dtype code present. */
static PyObject *amp_torch_spans(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *consts, *tensor_type, *dtypes[4];
    vk_spans_t *s;
    long long device;
    unsigned mask;
    if (!PyArg_ParseTuple(args, "OO!:amp_torch_spans", &tensors, &PyTuple_Type, &consts) ||
        parse_consts(consts, &tensor_type, dtypes) < 0 || walk(tensors, tensor_type, dtypes, &s, &device, &mask) < 0)
        return NULL;
    if (!s) Py_RETURN_NONE;
    PyObject *capsule = vk_spans_capsule(s);
    if (!capsule) return NULL;
    return Py_BuildValue("(NLI)", capsule, device, mask);
}

/* _C.amp_torch_unscale_check(tensors, consts, inv_scale, want_sumsq) -> (found_inf, sumsq or None, dtypes)
 * or None: amp_unscale_check on the CPU in one call, walk and kernel, for a list of plain CPU
 * torch tensors (None, nothing written, for any other list). */
static PyObject *amp_torch_unscale_check(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *consts, *tensor_type, *dtypes[4];
    float inv_scale;
    int want_sumsq;
    vk_spans_t *s;
    long long device;
    unsigned mask;
    if (!PyArg_ParseTuple(args, "OO!fp:amp_torch_unscale_check", &tensors, &PyTuple_Type, &consts, &inv_scale,
                          &want_sumsq) ||
        parse_consts(consts, &tensor_type, dtypes) < 0 || walk(tensors, tensor_type, dtypes, &s, &device, &mask) < 0)
        return NULL;
    if (!s || device != -1) {
        vk_spans_release(s);
        Py_RETURN_NONE;
    }
    float found = 0.0f;
    double sumsq = 0.0;
    if (vk_spans_unscale(s, inv_scale, &found, want_sumsq ? &sumsq : NULL) < 0) return NULL;
    PyObject *flag = found != 0.0f ? Py_True : Py_False;
    if (want_sumsq) return Py_BuildValue("(OdI)", flag, sumsq, mask);
    return Py_BuildValue("(OOI)", flag, Py_None, mask);
}

/* The address of a one-element float32 CPU torch tensor (exactly a torch.Tensor), else NULL
 * with no exception: the caller then takes the general path, which names what is wrong. */
static float *cpu_scalar(PyObject *t, PyObject *tensor_type, PyObject *float32) {
    if ((PyObject *)Py_TYPE(t) != tensor_type) return NULL;
    int failed = 0;
    PyObject *dt = read_attr(t, DTYPE), *cpu = read_attr(t, IS_CPU);
    int ok = dt == float32 && cpu == Py_True;
    Py_XDECREF(dt);
    Py_XDECREF(cpu);
    if (!ok || call_int(t, NBYTES, &failed) != 4 || failed) return NULL;
    long long ptr = call_int(t, DATA_PTR, &failed);
    return failed ? NULL : (float *)(uintptr_t)ptr;
}

/* _C.amp_torch_unscale_found(tensors, consts, found_inf, inv_scale) -> True or None: the whole
 * non_finite_check_and_unscale_ for plain CPU torch tensors and CPU scalars in one call
 * (found_inf set to 1.0 when an inf/NaN is met, never reset); None, with nothing written, for
 * anything else, which the general path then takes. */
static PyObject *amp_torch_unscale_found(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensors, *consts, *tensor_type, *dtypes[4], *found_obj, *inv_obj;
    vk_spans_t *s;
    long long device;
    unsigned mask;
    if (!PyArg_ParseTuple(args, "OO!OO:amp_torch_unscale_found", &tensors, &PyTuple_Type, &consts, &found_obj,
                          &inv_obj) ||
        parse_consts(consts, &tensor_type, dtypes) < 0 || look_up(tensor_type) < 0)
        return NULL;
    float *found_ptr = cpu_scalar(found_obj, tensor_type, dtypes[VRAM_FLOAT32]);
    float *inv_ptr = found_ptr ? cpu_scalar(inv_obj, tensor_type, dtypes[VRAM_FLOAT32]) : NULL;
    if (!inv_ptr) Py_RETURN_NONE;
    if (walk(tensors, tensor_type, dtypes, &s, &device, &mask) < 0) return NULL;
    if (!s || device != -1) {
        vk_spans_release(s);
        Py_RETURN_NONE;
    }
    float found = 0.0f, inv_scale = *inv_ptr;
    if (vk_spans_unscale(s, inv_scale, &found, NULL) < 0) return NULL;
    if (found != 0.0f) *found_ptr = 1.0f;
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"amp_torch_unscale_found", amp_torch_unscale_found, METH_VARARGS,
     "amp_torch_unscale_found(tensors, consts, found_inf, inv_scale) -> True, or None: "
     "non_finite_check_and_unscale_ for plain CPU torch tensors and scalars in one call (None: the general path's)"},
    {"amp_torch_unscale_check", amp_torch_unscale_check, METH_VARARGS,
     "amp_torch_unscale_check(tensors, consts, inv_scale, want_sumsq) -> (found_inf, sumsq or None, dtype_bits) or "
     "None: the CPU unscale of plain torch tensors, walk and kernel in one call (None: the general walk's)"},
    {"amp_torch_spans", amp_torch_spans, METH_VARARGS,
     "amp_torch_spans(tensors, (Tensor, float32, float16, bfloat16, float64)) -> (spans, device, dtype_bits) "
     "or None when some tensor is not a plain, dense torch tensor of those dtypes on one device, or tensors overlap"},
    {NULL, NULL, 0, NULL},
};

int vk_amp_torch_init(PyObject *module) { return vk_add_methods(module, methods); }
