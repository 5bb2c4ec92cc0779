/* buffer.c — vramkit.Buffer: memory from a pool that returns to the cache when the object
 * dies. Host buffers export the buffer protocol (numpy.asarray is zero-copy); CUDA buffers
 * export __cuda_array_interface__ v3; both export DLPack. A sim buffer has addresses but no
 * memory, so every data export refuses it with a TypeError. */
#include "module.h"

#include <stdlib.h>

#include "dlpack.h"

#define MAX_DIMS 32

typedef struct {
    PyObject_HEAD vram_pool_t *pool;
    uintptr_t ptr;
    uint64_t nbytes;
    vram_device_t device;
    int ndim;
    Py_ssize_t shape[MAX_DIMS], strides[MAX_DIMS];
    Py_ssize_t itemsize;
    char format[16];  /* struct-module format for the buffer protocol, e.g. "f" */
    char typestr[16]; /* array-interface type string, e.g. "<f4" */
    vk_dl_dtype_t dl_dtype;
    PyObject *weakrefs;
} BufferObject;

static PyTypeObject BufferType;

static int no_memory_here(const BufferObject *b, const char *what) {
    char name[32];
    vram_device_format(b->device, name, sizeof name);
    if (b->device.kind == VRAM_DEVICE_SIM)
        PyErr_Format(PyExc_TypeError,
                     "%s is not available for a Buffer on %s: a simulated device has addresses but no memory "
                     "behind them", what, name);
    else if (b->device.kind == VRAM_DEVICE_CUDA)
        PyErr_Format(PyExc_TypeError,
                     "%s is not available for a Buffer on %s: it is device memory; use __cuda_array_interface__ or "
                     "DLPack (torch.from_dlpack, cupy.from_dlpack)", what, name);
    else
        PyErr_Format(PyExc_TypeError, "%s is not available for a Buffer on %s", what, name);
    return -1;
}

static void buffer_dealloc(BufferObject *self) {
    if (self->weakrefs) PyObject_ClearWeakRefs((PyObject *)self);
    /* A pointer this object owns cannot be unknown to its pool, and a destructor has no way
     * to report an error anyway, so the status is deliberately dropped. */
    if (self->ptr && vram_free(self->pool, (void *)self->ptr, vk_capture_context(self->pool)) != VRAM_OK) {
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* _C.empty_buffer(nbytes, device, shape, format, typestr, itemsize, dl_code, dl_bits) */
static PyObject *empty_buffer(PyObject *mod, PyObject *args) {
    (void)mod;
    PyObject *nbytes_obj, *device, *shape;
    const char *format, *typestr;
    Py_ssize_t itemsize;
    int dl_code, dl_bits;
    if (!PyArg_ParseTuple(args, "OOO!ssnii:empty_buffer", &nbytes_obj, &device, &PyTuple_Type, &shape, &format,
                          &typestr, &itemsize, &dl_code, &dl_bits))
        return NULL;
    uint64_t nbytes;
    vram_pool_t *pool;
    if (vk_size_from_arg(nbytes_obj, "nbytes", &nbytes) != 0 || vk_alloc_pool_from_arg(device, &pool) != 0) return NULL;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim > MAX_DIMS || strlen(format) >= 16 || strlen(typestr) >= 16 || itemsize <= 0) {
        PyErr_Format(PyExc_ValueError, "a Buffer has at most %d dimensions and a valid dtype", MAX_DIMS);
        return NULL;
    }
    BufferObject *self = PyObject_New(BufferObject, &BufferType);
    if (!self) return NULL;
    self->pool = pool;
    self->ptr = 0;
    self->nbytes = nbytes;
    self->device = vram_pool_device(pool);
    self->ndim = (int)ndim;
    self->itemsize = itemsize;
    self->weakrefs = NULL;
    strcpy(self->format, format);
    strcpy(self->typestr, typestr);
    self->dl_dtype = (vk_dl_dtype_t){(uint8_t)dl_code, (uint8_t)dl_bits, 1};
    Py_ssize_t stride = itemsize;
    for (Py_ssize_t i = ndim - 1; i >= 0; i--) {
        self->shape[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (self->shape[i] < 0) {
            Py_DECREF(self);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "Buffer dimensions must be non-negative");
            return NULL;
        }
        self->strides[i] = stride;
        stride *= self->shape[i] ? self->shape[i] : 1;
    }
    uint64_t context = vk_capture_context(pool);
    void *ptr = NULL;
    vram_status_t status = vram_malloc(pool, nbytes, 0, context, &ptr);
    if (status != VRAM_OK) {
        Py_DECREF(self);
        return vk_raise(status);
    }
    self->ptr = (uintptr_t)ptr;
    return (PyObject *)self;
}

/* ---- buffer protocol (cpu only) ---- */

static char zero_length_target; /* a valid address for empty host buffers */

static int buffer_getbuffer(BufferObject *self, Py_buffer *view, int flags) {
    if (self->device.kind != VRAM_DEVICE_CPU) {
        view->obj = NULL;
        return no_memory_here(self, "the buffer protocol");
    }
    view->buf = self->ptr ? (void *)self->ptr : (void *)&zero_length_target;
    view->obj = Py_NewRef((PyObject *)self);
    view->len = (Py_ssize_t)self->nbytes;
    view->readonly = 0;
    view->itemsize = self->itemsize;
    view->format = (flags & PyBUF_FORMAT) ? self->format : NULL;
    view->suboffsets = NULL;
    view->internal = NULL;
    if (flags & PyBUF_ND) {
        view->ndim = self->ndim;
        view->shape = self->shape;
        view->strides = (flags & PyBUF_STRIDES) ? self->strides : NULL;
    } else { /* a simple request sees plain bytes */
        view->ndim = 1;
        view->shape = NULL;
        view->strides = NULL;
        view->itemsize = 1;
    }
    return 0;
}

/* No release hook: a view holds a reference to the Buffer, which keeps the memory alive. */
static PyBufferProcs buffer_procs = {(getbufferproc)buffer_getbuffer, NULL};

/* ---- attributes ---- */

static PyObject *shape_tuple(const BufferObject *self) {
    PyObject *t = PyTuple_New(self->ndim);
    if (!t) return NULL;
    for (int i = 0; i < self->ndim; i++) {
        PyObject *d = PyLong_FromSsize_t(self->shape[i]);
        if (!d) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, d);
    }
    return t;
}

static PyObject *get_ptr(BufferObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(self->ptr);
}
static PyObject *get_nbytes(BufferObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(self->nbytes);
}
static PyObject *get_device(BufferObject *self, void *c) {
    (void)c;
    return vk_device_name(self->device);
}
static PyObject *get_shape(BufferObject *self, void *c) {
    (void)c;
    return shape_tuple(self);
}
static PyObject *get_typestr(BufferObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(self->typestr);
}
static PyObject *get_dtype(BufferObject *self, void *c) {
    (void)c;
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (!numpy) return NULL;
    PyObject *dtype = PyObject_CallMethod(numpy, "dtype", "s", self->typestr);
    Py_DECREF(numpy);
    return dtype;
}

static PyObject *get_cuda_array_interface(BufferObject *self, void *c) {
    (void)c;
    if (self->device.kind != VRAM_DEVICE_CUDA) {
        /* AttributeError keeps hasattr() False, so CuPy and Numba never try a host pointer. */
        char name[32];
        vram_device_format(self->device, name, sizeof name);
        PyErr_Format(PyExc_AttributeError, "__cuda_array_interface__ exists only for CUDA buffers; this one is on %s",
                     name);
        return NULL;
    }
    PyObject *shape = shape_tuple(self);
    if (!shape) return NULL;
    return Py_BuildValue("{s:N,s:s,s:(KO),s:i,s:O,s:O}", "shape", shape, "typestr", self->typestr, "data",
                         (unsigned long long)self->ptr, Py_False, "version", 3, "strides", Py_None, "stream", Py_None);
}

/* ---- DLPack ---- */

typedef struct {
    PyObject *owner; /* the Buffer, kept alive until the consumer calls the deleter */
    int64_t shape[MAX_DIMS];
} dl_context_t;

static void release_owner(dl_context_t *ctx) {
    /* The consumer may call the deleter from any thread, or after the interpreter ended. */
    if (Py_IsInitialized()) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF(ctx->owner);
        PyGILState_Release(gil);
    }
    free(ctx);
}

static void delete_managed(vk_dl_managed_t *m) {
    release_owner(m->manager_ctx);
    free(m);
}

static void delete_versioned(vk_dl_managed_versioned_t *m) {
    release_owner(m->manager_ctx);
    free(m);
}

static void capsule_destructor(PyObject *capsule) {
    /* A capsule may die while an exception propagates: keep that exception intact. */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    /* Only an unconsumed capsule still owns its tensor; consumers rename it "used_...". */
    if (PyCapsule_IsValid(capsule, "dltensor")) {
        vk_dl_managed_t *m = PyCapsule_GetPointer(capsule, "dltensor");
        m->deleter(m);
    } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
        vk_dl_managed_versioned_t *m = PyCapsule_GetPointer(capsule, "dltensor_versioned");
        m->deleter(m);
    }
    PyErr_Restore(exc_type, exc_value, exc_tb);
}

static void fill_tensor(BufferObject *self, dl_context_t *ctx, vk_dl_tensor_t *t) {
    for (int i = 0; i < self->ndim; i++) ctx->shape[i] = self->shape[i];
    t->data = (void *)self->ptr;
    t->device = (vk_dl_device_t){self->device.kind == VRAM_DEVICE_CUDA ? VK_DL_CUDA : VK_DL_CPU,
                                 self->device.kind == VRAM_DEVICE_CUDA ? self->device.index : 0};
    t->ndim = self->ndim;
    t->dtype = self->dl_dtype;
    t->shape = ctx->shape;
    t->strides = NULL;
    t->byte_offset = 0;
}

static int wants_versioned(PyObject *max_version) {
    if (!max_version || max_version == Py_None) return 0;
    if (!PyTuple_Check(max_version) || PyTuple_GET_SIZE(max_version) < 1) return 0;
    long major = PyLong_AsLong(PyTuple_GET_ITEM(max_version, 0));
    if (major == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return major >= 1;
}

static PyObject *buffer_dlpack(BufferObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"stream", "max_version", "dl_device", "copy", NULL};
    PyObject *stream = Py_None, *max_version = Py_None, *dl_device = Py_None, *copy = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OOOO:__dlpack__", kwlist, &stream, &max_version, &dl_device,
                                     &copy))
        return NULL;
    if (self->device.kind == VRAM_DEVICE_SIM) {
        no_memory_here(self, "DLPack");
        return NULL;
    }
    if (copy == Py_True) {
        PyErr_SetString(PyExc_BufferError, "a vramkit Buffer is exported without copying; copy=True is not supported");
        return NULL;
    }
    if (dl_device != Py_None) {
        int type, id;
        if (!PyArg_ParseTuple(dl_device, "ii", &type, &id)) return NULL;
        int own_type = self->device.kind == VRAM_DEVICE_CUDA ? VK_DL_CUDA : VK_DL_CPU;
        int own_id = self->device.kind == VRAM_DEVICE_CUDA ? self->device.index : 0;
        if (type != own_type || id != own_id) {
            PyErr_SetString(PyExc_BufferError, "a vramkit Buffer can only be exported to its own device");
            return NULL;
        }
    }
    /* No producer work is ever queued on vramkit memory, so no stream needs to wait. */
    dl_context_t *ctx = malloc(sizeof *ctx);
    if (!ctx) return PyErr_NoMemory();
    ctx->owner = Py_NewRef((PyObject *)self);
    PyObject *capsule;
    if (wants_versioned(max_version)) {
        vk_dl_managed_versioned_t *m = calloc(1, sizeof *m);
        if (!m) {
            release_owner(ctx);
            return PyErr_NoMemory();
        }
        m->version = (vk_dl_version_t){1, 0};
        m->manager_ctx = ctx;
        m->deleter = delete_versioned;
        m->flags = 0;
        fill_tensor(self, ctx, &m->dl_tensor);
        capsule = PyCapsule_New(m, "dltensor_versioned", capsule_destructor);
        if (!capsule) delete_versioned(m);
    } else {
        vk_dl_managed_t *m = calloc(1, sizeof *m);
        if (!m) {
            release_owner(ctx);
            return PyErr_NoMemory();
        }
        m->manager_ctx = ctx;
        m->deleter = delete_managed;
        fill_tensor(self, ctx, &m->dl_tensor);
        capsule = PyCapsule_New(m, "dltensor", capsule_destructor);
        if (!capsule) delete_managed(m);
    }
    return capsule;
}

static PyObject *buffer_dlpack_device(BufferObject *self, PyObject *unused) {
    (void)unused;
    if (self->device.kind == VRAM_DEVICE_SIM) {
        no_memory_here(self, "DLPack");
        return NULL;
    }
    if (self->device.kind == VRAM_DEVICE_CUDA) return Py_BuildValue("(ii)", VK_DL_CUDA, self->device.index);
    return Py_BuildValue("(ii)", VK_DL_CPU, 0);
}

static PyObject *buffer_array(BufferObject *self, PyObject *args, PyObject *kwargs) {
    (void)args;
    (void)kwargs;
    if (self->device.kind != VRAM_DEVICE_CPU) {
        no_memory_here(self, "conversion to a NumPy array");
        return NULL;
    }
    /* numpy.asarray reaches the buffer protocol first; this covers explicit np.array(buf). */
    PyObject *numpy = PyImport_ImportModule("numpy");
    if (!numpy) return NULL;
    PyObject *view = PyMemoryView_FromObject((PyObject *)self);
    PyObject *arr = view ? PyObject_CallMethod(numpy, "asarray", "O", view) : NULL;
    Py_XDECREF(view);
    Py_DECREF(numpy);
    return arr;
}

static PyObject *buffer_repr(BufferObject *self) {
    char name[32], head[160];
    vram_device_format(self->device, name, sizeof name);
    /* PyUnicode_FromFormat has no %llx, so the numbers are formatted here first. */
    snprintf(head, sizeof head, "vramkit.Buffer(ptr=0x%llx, nbytes=%llu, device='%s', shape=",
             (unsigned long long)self->ptr, (unsigned long long)self->nbytes, name);
    PyObject *shape = shape_tuple(self);
    if (!shape) return NULL;
    PyObject *r = PyUnicode_FromFormat("%s%R, typestr='%s')", head, shape, self->typestr);
    Py_DECREF(shape);
    return r;
}

static PyGetSetDef buffer_getset[] = {
    {"ptr", (getter)get_ptr, NULL, "The address of the first byte (0 for an empty buffer).", NULL},
    {"nbytes", (getter)get_nbytes, NULL, "Size in bytes.", NULL},
    {"device", (getter)get_device, NULL, "The device name, e.g. 'cpu' or 'cuda:0'.", NULL},
    {"shape", (getter)get_shape, NULL, "The shape as a tuple.", NULL},
    {"typestr", (getter)get_typestr, NULL, "The array-interface type string, e.g. '<f4'.", NULL},
    {"dtype", (getter)get_dtype, NULL, "The element type as a numpy.dtype.", NULL},
    {"__cuda_array_interface__", (getter)get_cuda_array_interface, NULL, "CUDA Array Interface v3 (CUDA only).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef buffer_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))buffer_dlpack, METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None, max_version=None, dl_device=None, copy=None) -> PyCapsule"},
    {"__dlpack_device__", (PyCFunction)buffer_dlpack_device, METH_NOARGS, "(device_type, device_id) as DLPack codes"},
    {"__array__", (PyCFunction)(void (*)(void))buffer_array, METH_VARARGS | METH_KEYWORDS,
     "A zero-copy NumPy view (host buffers only)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BufferType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "vramkit.Buffer",
    .tp_basicsize = sizeof(BufferObject),
    .tp_dealloc = (destructor)buffer_dealloc,
    .tp_repr = (reprfunc)buffer_repr,
    .tp_as_buffer = &buffer_procs,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Memory from a vramkit pool, returned to the cache when this object is garbage collected.\n\n"
              "Create with vramkit.empty(). Host buffers support the buffer protocol (numpy.asarray is zero-copy), "
              "CUDA buffers __cuda_array_interface__; both support DLPack.",
    .tp_weaklistoffset = offsetof(BufferObject, weakrefs),
    .tp_methods = buffer_methods,
    .tp_getset = buffer_getset,
};

static PyMethodDef methods[] = {
    {"empty_buffer", empty_buffer, METH_VARARGS,
     "empty_buffer(nbytes, device, shape, format, typestr, itemsize, dl_code, dl_bits) -> Buffer"},
    {NULL, NULL, 0, NULL},
};

int vk_buffer_init(PyObject *module) {
    if (PyType_Ready(&BufferType) < 0) return -1;
    if (PyModule_AddObjectRef(module, "Buffer", (PyObject *)&BufferType) < 0) return -1;
    return vk_add_methods(module, methods);
}
