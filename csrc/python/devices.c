/* devices.c — device arguments, the default device, and size arguments.
 *
 * The default device lives here rather than in Python so that raw_alloc(n) with no device
 * resolves without a round trip through Python. It starts as cuda:0 where CUDA is usable and
 * cpu elsewhere. */
#include "module.h"

static vram_device_t default_device;
static vram_pool_t *default_pool; /* cached: pools are never destroyed */

PyObject *vk_device_name(vram_device_t device) {
    char buf[32];
    vram_device_format(device, buf, sizeof buf);
    return PyUnicode_FromString(buf);
}

static int resolve(vram_device_t device, vram_pool_t **pool) {
    vram_status_t status = vram_device_pool(device, pool);
    if (status == VRAM_OK) return 0;
    /* A sim index that was never created is a wrong value; a missing GPU is an environment
     * problem, reported as VramkitError. */
    if (status == VRAM_ERR_UNAVAILABLE && device.kind == VRAM_DEVICE_SIM) status = VRAM_ERR_INVALID_ARG;
    vk_raise(status);
    return -1;
}

static int ensure_default(void) {
    if (default_pool) return 0;
    vram_device_t device = {VRAM_DEVICE_CPU, 0, 0};
    if (vram_cuda_device_count() > 0) device = (vram_device_t){VRAM_DEVICE_CUDA, 0, 0};
    if (resolve(device, &default_pool) != 0) return -1;
    default_device = device;
    return 0;
}

static int parse_text(PyObject *text, vram_device_t *out) {
    const char *s = PyUnicode_AsUTF8(text);
    if (!s) return -1;
    vram_status_t status = vram_device_parse(s, out);
    if (status != VRAM_OK) {
        vk_raise(status);
        return -1;
    }
    /* As in torch, a bare "cuda" is the current CUDA device: the default one if it is CUDA. */
    if (!strcmp(s, "cuda") && default_pool && default_device.kind == VRAM_DEVICE_CUDA) *out = default_device;
    return 0;
}

/* Parse without creating a pool. */
static int device_from_arg(PyObject *arg, vram_device_t *out) {
    if (arg == Py_None) {
        if (ensure_default() != 0) return -1;
        *out = default_device;
        return 0;
    }
    if (PyUnicode_Check(arg)) return parse_text(arg, out);
    if (PyLong_Check(arg) && !PyBool_Check(arg)) {
        long index = PyLong_AsLong(arg);
        if (index == -1 && PyErr_Occurred()) return -1;
        if (index < 0 || index > 1000000) {
            PyErr_Format(PyExc_ValueError, "CUDA device index must be non-negative, got %ld", index);
            return -1;
        }
        *out = (vram_device_t){VRAM_DEVICE_CUDA, (int)index, 0};
        return 0;
    }
    if (PyObject_HasAttrString(arg, "type") && PyObject_HasAttrString(arg, "index")) { /* torch.device */
        PyObject *text = PyObject_Str(arg);
        if (!text) return -1;
        int rc = parse_text(text, out);
        Py_DECREF(text);
        return rc;
    }
    PyErr_Format(PyExc_TypeError,
                 "device must be a string ('cpu', 'cuda', 'cuda:N', 'sim:N'), an int CUDA index, a torch.device "
                 "or None; got %.80s", Py_TYPE(arg)->tp_name);
    return -1;
}

int vk_pool_from_arg(PyObject *device, vram_pool_t **pool) {
    if (device == Py_None || device == NULL) {
        if (ensure_default() != 0) return -1;
        *pool = default_pool;
        return 0;
    }
    vram_device_t d;
    if (device_from_arg(device, &d) != 0) return -1;
    return resolve(d, pool);
}

int vk_device_from_arg(PyObject *device, vram_device_t *out) { return device_from_arg(device, out); }

int vk_alloc_pool_from_arg(PyObject *device, vram_pool_t **pool) {
    if (vk_pool_from_arg(device, pool) != 0) return -1; /* the default device's pool stays a cached pointer */
    vram_device_t d = vram_pool_device(*pool);
    if (d.mempool == 0) { /* a named private pool is used as named */
        vram_pool_t *in_use = vram_mempool_in_use(d);
        if (in_use) *pool = in_use;
    }
    return 0;
}

int vk_size_from_arg(PyObject *obj, const char *what, uint64_t *out) {
    if (PyLong_CheckExact(obj)) { /* the common case, without the __index__ protocol */
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (!overflow && v >= 0 && (uint64_t)v < VRAM_MAX_REQUEST) {
            *out = (uint64_t)v;
            return 0;
        }
        if (v == -1 && !overflow && PyErr_Occurred()) return -1;
    }
    if (PyBool_Check(obj) || PyFloat_Check(obj) || !PyIndex_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an integer number of bytes, got %.80s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *index = PyNumber_Index(obj); /* numpy integers too */
    if (!index) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index, &overflow);
    if (v == -1 && !overflow && PyErr_Occurred()) {
        Py_DECREF(index);
        return -1;
    }
    if (overflow < 0 || (!overflow && v < 0)) {
        PyErr_Format(PyExc_ValueError, "%s must be non-negative, got %S", what, index);
        Py_DECREF(index);
        return -1;
    }
    if (overflow > 0 || (uint64_t)v >= VRAM_MAX_REQUEST) {
        PyErr_Format(PyExc_ValueError, "%s %S is absurd: sizes must be below 2**62 bytes", what, index);
        Py_DECREF(index);
        return -1;
    }
    Py_DECREF(index);
    *out = (uint64_t)v;
    return 0;
}

static PyObject *set_default_device(PyObject *self, PyObject *arg) {
    (void)self;
    vram_device_t d;
    vram_pool_t *pool;
    if (device_from_arg(arg, &d) != 0 || resolve(d, &pool) != 0) return NULL;
    default_device = d;
    default_pool = pool;
    Py_RETURN_NONE;
}

static PyObject *get_default_device(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (ensure_default() != 0) return NULL;
    return vk_device_name(default_device);
}

static PyObject *canonical_device(PyObject *self, PyObject *arg) {
    (void)self;
    vram_pool_t *pool;
    if (vk_pool_from_arg(arg, &pool) != 0) return NULL;
    return vk_device_name(vram_pool_device(pool));
}

static PyObject *cuda_device_count(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(vram_cuda_device_count());
}

static PyObject *cuda_compiled(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(vram_cuda_compiled());
}

static PyObject *sim_create(PyObject *self, PyObject *arg) {
    (void)self;
    uint64_t total;
    if (vk_size_from_arg(arg, "total_bytes", &total) != 0) return NULL;
    if (total == 0) {
        PyErr_SetString(PyExc_ValueError, "a simulated device needs a capacity of at least 1 byte, got 0");
        return NULL;
    }
    vram_device_t d;
    vram_status_t status = vram_sim_create(total, &d);
    if (status != VRAM_OK) return vk_raise(status);
    return vk_device_name(d);
}

static PyObject *sim_count(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(vram_sim_count());
}

static PyMethodDef methods[] = {
    {"set_default_device", set_default_device, METH_O, "Make `device` the default (validates it first)."},
    {"default_device", get_default_device, METH_NOARGS, "The default device's name."},
    {"canonical_device", canonical_device, METH_O, "Validate a device argument and return its canonical name."},
    {"cuda_device_count", cuda_device_count, METH_NOARGS, "CUDA devices usable now (0 without a driver)."},
    {"cuda_compiled", cuda_compiled, METH_NOARGS, "Whether this build includes CUDA support."},
    {"sim_create", sim_create, METH_O, "Create a simulated device of total_bytes; returns 'sim:N'."},
    {"sim_count", sim_count, METH_NOARGS, "Number of simulated devices created."},
    {NULL, NULL, 0, NULL},
};

int vk_devices_init(PyObject *module) { return vk_add_methods(module, methods); }
