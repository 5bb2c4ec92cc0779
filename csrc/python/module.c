/* module.c — vramkit._C: gathers each area's functions into one extension module. */
#include "module.h"

int vk_add_methods(PyObject *module, PyMethodDef *methods) {
    PyObject *name = PyModule_GetNameObject(module);
    if (!name) return -1;
    for (PyMethodDef *m = methods; m->ml_name; m++) {
        PyObject *fn = PyCFunction_NewEx(m, NULL, name);
        if (!fn || PyModule_AddObject(module, m->ml_name, fn) < 0) {
            Py_XDECREF(fn);
            Py_DECREF(name);
            return -1;
        }
    }
    Py_DECREF(name);
    return 0;
}

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "vramkit._C",
    "vramkit's C core: a caching allocator for CUDA, host and simulated memory with PyTorch-compatible "
    "counters, and fused loss-scaling kernels.", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__C(void) {
    PyObject *m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (vk_errors_init(m) || vk_devices_init(m) || vk_context_init(m) || vk_memory_init(m) || vk_snapshot_init(m) ||
        vk_buffer_init(m) || vk_numpy_init(m) || vk_bench_init(m) || vk_cuda_tools_init(m) || vk_amp_init(m) || vk_amp_torch_init(m) || vk_amp_numpy_init(m) || vk_checkpoint_init(m) ||
        vk_trace_init(m) || vk_view_init(m) || vk_smi_init(m) || vk_mempool_init(m) || vk_oom_queue_init(m) ||
        PyModule_AddStringConstant(m, "__version__", VRAM_VERSION_STRING) ||
        PyModule_AddObjectRef(m, "CUDA_COMPILED", vram_cuda_compiled() ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
