/* smi.c — _C.nvml_*: the GPUs and their processes as NVML reports them (csrc/backends/nvml.c),
 * as lists of dicts for vramkit.smi, which joins them with /proc. NVML calls run without the
 * GIL (a query can take milliseconds). */
#include "module.h"

#include <stdlib.h>
#include <string.h>

static PyObject *text(const char *s) { return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace"); }

/* nvml_load() -> None when NVML is loaded and initialised, else the reason it is not (str). */
static PyObject *nvml_load(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    vram_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = vram_nvml_open();
    Py_END_ALLOW_THREADS
    if (status == VRAM_OK) Py_RETURN_NONE;
    if (status == VRAM_ERR_UNAVAILABLE) return text(vram_last_error());
    return vk_raise(status);
}

static PyObject *nvml_close(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    vram_nvml_close();
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* vram_nvml_device_count with the GIL released (loading NVML can take a while). */
static vram_status_t count_devices(uint32_t *count) {
    vram_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = vram_nvml_device_count(count);
    Py_END_ALLOW_THREADS
    return status;
}

static PyObject *nvml_device_count(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    uint32_t count = 0;
    vram_status_t status = count_devices(&count);
    if (status != VRAM_OK) return vk_raise(status);
    return PyLong_FromUnsignedLong(count);
}

static PyObject *percent_or_none(int value) {
    return value < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(value);
}


static PyObject *device_dict(const vram_gpu_info_t *g) {
    return Py_BuildValue("{s:I,s:N,s:N,s:K,s:K,s:K,s:N,s:N}", "index", (unsigned int)g->index, "name", text(g->name),
                         "uuid", text(g->uuid), "memory_total", (unsigned long long)g->memory_total, "memory_used",
                         (unsigned long long)g->memory_used, "memory_free", (unsigned long long)g->memory_free,
                         "utilization_gpu", percent_or_none(g->utilization_gpu), "utilization_memory",
                         percent_or_none(g->utilization_memory));
}

/* nvml_devices() -> [{index, name, uuid, memory_total, memory_used, memory_free, utilization_gpu,
 * utilization_memory}], utilisations None where NVML does not support them. */
static PyObject *nvml_devices(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    uint32_t count = 0;
    vram_status_t status = count_devices(&count);
    if (status != VRAM_OK) return vk_raise(status);
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    for (uint32_t i = 0; i < count; i++) {
        vram_gpu_info_t info;
        Py_BEGIN_ALLOW_THREADS
        status = vram_nvml_device_info(i, &info);
        Py_END_ALLOW_THREADS
        if (status != VRAM_OK) {
            Py_DECREF(list);
            return vk_raise(status);
        }
        PyObject *d = device_dict(&info);
        if (!d || PyList_Append(list, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(d);
    }
    return list;
}

static PyObject *id_or_none(uint32_t id) {
    return id == VRAM_NVML_NO_ID ? Py_NewRef(Py_None) : PyLong_FromUnsignedLong(id);
}

/* nvml_processes(index) -> [{pid, used_memory, kind, gpu_instance_id, compute_instance_id}]:
 * used_memory None where NVML reports "not available"; kind "compute" or "graphics"; the MIG
 * ids None without MIG. */
static PyObject *nvml_processes(PyObject *self, PyObject *args) {
    (void)self;
    unsigned int index;
    if (!PyArg_ParseTuple(args, "I:nvml_processes", &index)) return NULL;
    vram_gpu_process_t *procs = NULL;
    size_t cap = 0, count = 0;
    vram_status_t status;
    for (;;) { /* the list can grow between calls: retry until it fits */
        Py_BEGIN_ALLOW_THREADS
        status = vram_nvml_processes(index, procs, cap, &count);
        Py_END_ALLOW_THREADS
        if (status != VRAM_OK || count <= cap) break;
        cap = count + 16;
        vram_gpu_process_t *grown = realloc(procs, cap * sizeof *procs);
        if (!grown) {
            free(procs);
            return PyErr_NoMemory();
        }
        procs = grown;
    }
    if (status != VRAM_OK) {
        free(procs);
        return vk_raise(status);
    }
    PyObject *list = PyList_New(0);
    for (size_t i = 0; list && i < count; i++) {
        const vram_gpu_process_t *p = &procs[i];
        PyObject *used = p->used_memory == VRAM_NVML_NOT_AVAILABLE ? Py_NewRef(Py_None)
                                                                  : PyLong_FromUnsignedLongLong(p->used_memory);
        PyObject *d = used ? Py_BuildValue("{s:I,s:N,s:s,s:N,s:N}", "pid", (unsigned int)p->pid, "used_memory", used,
                                           "kind", p->kind == VRAM_GPU_PROCESS_GRAPHICS ? "graphics" : "compute",
                                           "gpu_instance_id", id_or_none(p->gpu_instance_id), "compute_instance_id",
                                           id_or_none(p->compute_instance_id))
                           : NULL;
        if (!d || PyList_Append(list, d) < 0) Py_CLEAR(list);
        Py_XDECREF(d);
    }
    free(procs);
    return list;
}

static PyMethodDef methods[] = {
    {"nvml_load", nvml_load, METH_NOARGS,
     "nvml_load() -> None when NVML is loaded (VRAMKIT_NVML_LIBRARY or libnvidia-ml.so.1), else the reason"},
    {"nvml_close", nvml_close, METH_NOARGS,
     "nvml_close(): shut NVML down and unload it; the next nvml_* call loads it again (tests, retries)"},
    {"nvml_device_count", nvml_device_count, METH_NOARGS, "nvml_device_count() -> the number of GPUs NVML sees"},
    {"nvml_devices", nvml_devices, METH_NOARGS, "nvml_devices() -> list of dicts, one per GPU, in NVML order"},
    {"nvml_processes", nvml_processes, METH_VARARGS,
     "nvml_processes(index) -> list of dicts, one per process context on GPU `index` (compute, then graphics)"},
    {NULL, NULL, 0, NULL},
};

int vk_smi_init(PyObject *module) { return vk_add_methods(module, methods); }
