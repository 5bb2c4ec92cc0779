/* errors.c — map vram_status_t to Python exceptions. The exception classes are defined in
 * python/vramkit/_core/errors.py (so they can carry attributes and pickle) and registered here. */
#include "module.h"

static PyObject *vramkit_error;      /* vramkit.VramkitError */
static PyObject *out_of_memory_error; /* vramkit.OutOfMemoryError */

static PyObject *oom_exception(void) {
    vram_oom_info_t info;
    vram_last_oom(&info);
    /* Copy the message first: building the arguments can run finalizers that call vramkit. */
    char message[1024];
    snprintf(message, sizeof message, "%s", vram_last_error());
    PyObject *device = vk_device_name((vram_device_t){(vram_device_kind_t)info.device_kind, info.device_index, 0});
    if (!device) return NULL;
    PyObject *allowed = info.allowed == UINT64_MAX ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(info.allowed);
    PyObject *kwargs = allowed ? Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:O,s:O}",
                                                "requested", (unsigned long long)info.requested,
                                                "segment_size", (unsigned long long)info.segment_size,
                                                "free", (unsigned long long)info.device_free,
                                                "total", (unsigned long long)info.device_total,
                                                "allocated", (unsigned long long)info.allocated,
                                                "reserved", (unsigned long long)info.reserved,
                                                "allowed", allowed, "device", device)
                               : NULL;
    Py_XDECREF(allowed);
    Py_DECREF(device);
    if (!kwargs) return NULL;
    PyObject *args = Py_BuildValue("(s)", message);
    PyObject *exc = args ? PyObject_Call(out_of_memory_error, args, kwargs) : NULL;
    Py_XDECREF(args);
    Py_DECREF(kwargs);
    return exc;
}

PyObject *vk_raise(vram_status_t status) {
    if (status == VRAM_ERR_OOM && out_of_memory_error) {
        PyObject *exc = oom_exception();
        if (exc) {
            PyErr_SetObject(out_of_memory_error, exc);
            Py_DECREF(exc);
        }
        return NULL;
    }
    if (status == VRAM_ERR_INVALID_ARG) {
        PyErr_SetString(PyExc_ValueError, vram_last_error());
    } else if (status == VRAM_ERR_HOST_MEMORY) {
        PyErr_SetString(PyExc_MemoryError, vram_last_error());
    } else {
        PyErr_SetString(vramkit_error ? vramkit_error : PyExc_RuntimeError, vram_last_error());
    }
    return NULL;
}

static PyObject *register_exceptions(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *base, *oom;
    if (!PyArg_ParseTuple(args, "OO:_register_exceptions", &base, &oom)) return NULL;
    if (!PyType_Check(base) || !PyType_Check(oom) ||
        !PyType_IsSubtype((PyTypeObject *)oom, (PyTypeObject *)base)) {
        PyErr_SetString(PyExc_TypeError, "_register_exceptions(VramkitError, OutOfMemoryError) takes two exception "
                                         "classes, the second a subclass of the first");
        return NULL;
    }
    Py_XSETREF(vramkit_error, Py_NewRef(base));
    Py_XSETREF(out_of_memory_error, Py_NewRef(oom));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"_register_exceptions", register_exceptions, METH_VARARGS,
     "Tell the C module which classes to raise (called once by vramkit._core.errors)."},
    {NULL, NULL, 0, NULL},
};

int vk_errors_init(PyObject *module) { return vk_add_methods(module, methods); }
