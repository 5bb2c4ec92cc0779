/* bench.c — allocation loops timed in C, for benchmarks/alloc.py and benchmarks/gpu/alloc.py:
 * vramkit's cached alloc+free pairs against glibc malloc/free, and (built with CUDA) against
 * CUDA's stream-ordered allocator (cudaMallocAsync/cudaFreeAsync), over the same size sequence,
 * so Python call overhead is not part of the comparison. Each pass returns its mean ns per pair. */
#include "module.h"

#include <stdint.h>
#include <stdlib.h>

#ifdef VRAMKIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

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

/* The size sequence and one timing slot per pass, shared by both loops. */
typedef struct bench_run {
    Py_buffer view;
    const uint64_t *sizes;
    Py_ssize_t n;
    double *ns;
    int passes;
} bench_run_t;

static int bench_begin(bench_run_t *run, PyObject *sizes_obj, int passes) {
    if (sizes_from(sizes_obj, &run->view) != 0) return -1;
    run->sizes = run->view.buf;
    run->n = run->view.len / 8;
    run->passes = passes > 0 ? passes : 0;
    run->ns = calloc((size_t)(run->passes ? run->passes : 1), sizeof *run->ns);
    if (!run->ns) {
        PyBuffer_Release(&run->view);
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* Release the inputs; on success return the per-pass figures as a list. */
static PyObject *bench_end(bench_run_t *run, int ok) {
    PyBuffer_Release(&run->view);
    PyObject *list = ok ? PyList_New(run->passes) : NULL;
    for (int i = 0; list && i < run->passes; i++) {
        PyObject *v = PyFloat_FromDouble(run->ns[i]);
        if (!v) Py_CLEAR(list);
        else PyList_SET_ITEM(list, i, v);
    }
    free(run->ns);
    return list;
}

static double per_pair(uint64_t start, Py_ssize_t n) { return (double)(vram__now_ns() - start) / (double)(n ? n : 1); }

/* bench_pool_pairs(device, sizes, passes) -> [ns per pair, one per pass] */
static PyObject *bench_pool_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *device, *sizes_obj;
    int passes;
    vram_pool_t *pool;
    bench_run_t run;
    if (!PyArg_ParseTuple(args, "OOi:bench_pool_pairs", &device, &sizes_obj, &passes) ||
        vk_pool_from_arg(device, &pool) != 0 || bench_begin(&run, sizes_obj, passes) != 0)
        return NULL;
    vram_status_t status = VRAM_OK;
    Py_BEGIN_ALLOW_THREADS for (int p = 0; p < run.passes && status == VRAM_OK; p++) {
        uint64_t start = vram__now_ns();
        for (Py_ssize_t i = 0; i < run.n && status == VRAM_OK; i++) {
            void *ptr;
            status = vram_malloc(pool, run.sizes[i], 0, 0, &ptr);
            if (status == VRAM_OK) status = vram_free(pool, ptr, 0);
        }
        run.ns[p] = per_pair(start, run.n);
    }
    Py_END_ALLOW_THREADS if (status != VRAM_OK) {
        bench_end(&run, 0);
        return vk_raise(status);
    }
    return bench_end(&run, 1);
}

/* bench_malloc_pairs(sizes, passes) -> [ns per pair] with glibc malloc/free. */
static PyObject *bench_malloc_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sizes_obj;
    int passes;
    bench_run_t run;
    if (!PyArg_ParseTuple(args, "Oi:bench_malloc_pairs", &sizes_obj, &passes) ||
        bench_begin(&run, sizes_obj, passes) != 0)
        return NULL;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS for (int p = 0; p < run.passes && !failed; p++) {
        uint64_t start = vram__now_ns();
        for (Py_ssize_t i = 0; i < run.n && !failed; i++) {
            void *volatile ptr = malloc(run.sizes[i]); /* volatile: keep the pair from being elided */
            failed = ptr == NULL;
            free(ptr);
        }
        run.ns[p] = per_pair(start, run.n);
    }
    Py_END_ALLOW_THREADS if (failed) {
        bench_end(&run, 0);
        return PyErr_NoMemory();
    }
    return bench_end(&run, 1);
}

/* In csrc/torch/bench_glue.cpp: vramkit's torch hooks alone (mode 1) or inside the
 * bookkeeping torch's CUDAPluggableAllocator does around them (mode 2), ns per pair. */
vram_status_t vram__bench_torch_glue(const uint64_t *sizes, size_t n, int mode, double *ns_out);

/* bench_torch_glue_pairs(device, sizes, passes) -> ([direct], [hooks], [hooks + torch's
 * bookkeeping]), ns per pair per pass: what vramkit as torch's allocator costs, layer by layer,
 * with the hooks routed to `device` (a simulated device; or "cuda:0" to a real one). The three
 * loops run in turn within each pass, their order rotating. The route is set back to the real
 * devices ("cuda", the default) afterwards. */
static PyObject *bench_torch_glue_pairs(PyObject *self, PyObject *args) {
    (void)self;
    const char *device;
    PyObject *sizes_obj;
    int passes;
    vram_device_t target;
    if (!PyArg_ParseTuple(args, "sOi:bench_torch_glue_pairs", &device, &sizes_obj, &passes)) return NULL;
    if (vram_device_parse(device, &target) != VRAM_OK || (target.kind != VRAM_DEVICE_SIM && target.kind != VRAM_DEVICE_CUDA))
        return PyErr_Format(PyExc_ValueError,
                            "bench_torch_glue_pairs takes a simulated device (\"sim:N\") or \"cuda:0\"; got %R",
                            PyTuple_GET_ITEM(args, 0));
    if (target.kind == VRAM_DEVICE_CUDA && target.index != 0)
        return PyErr_Format(PyExc_ValueError, "bench_torch_glue_pairs measures cuda:0 only; got %s", device);
    /* torch asks for cuda:0 (device index 0); the route sends it to `device` */
    vram_status_t status = target.kind == VRAM_DEVICE_SIM ? vram_torch_route(device) : vram_torch_route("cuda");
    if (status != VRAM_OK) return vk_raise(status);
    vram_pool_t *pool;
    bench_run_t runs[3];
    int begun = 0;
    status = vram_alloc_pool(target, &pool);
    if (status != VRAM_OK) goto out;
    for (; begun < 3; begun++)
        if (bench_begin(&runs[begun], sizes_obj, passes) != 0) goto out;
    Py_BEGIN_ALLOW_THREADS for (int p = 0; p < runs[0].passes && status == VRAM_OK; p++) {
        for (int k = 0; k < 3 && status == VRAM_OK; k++) {
            int mode = (p + k) % 3;
            bench_run_t *r = &runs[mode];
            if (mode == 0) {
                uint64_t start = vram__now_ns();
                for (Py_ssize_t i = 0; i < r->n && status == VRAM_OK; i++) {
                    void *ptr;
                    status = vram_malloc(pool, r->sizes[i], 0, 0, &ptr);
                    if (status == VRAM_OK) status = vram_free(pool, ptr, 0);
                }
                r->ns[p] = per_pair(start, r->n);
            } else {
                status = vram__bench_torch_glue(r->sizes, (size_t)r->n, mode, &r->ns[p]);
            }
        }
    }
    Py_END_ALLOW_THREADS;
out:
    if (vram_torch_route("cuda") != VRAM_OK && status == VRAM_OK) status = VRAM_ERR_INVALID_ARG;
    if (begun < 3 || status != VRAM_OK) {
        for (int k = 0; k < begun; k++) bench_end(&runs[k], 0);
        return status != VRAM_OK ? vk_raise(status) : NULL;
    }
    PyObject *lists[3];
    for (int k = 0; k < 3; k++) lists[k] = bench_end(&runs[k], 1);
    if (!lists[0] || !lists[1] || !lists[2]) {
        for (int k = 0; k < 3; k++) Py_XDECREF(lists[k]);
        return NULL;
    }
    return Py_BuildValue("(NNN)", lists[0], lists[1], lists[2]);
}

#ifdef VRAMKIT_WITH_CUDA
/* bench_cuda_async_pairs(device_index, sizes, passes) -> [ns per cudaMallocAsync+cudaFreeAsync
 * pair] on the legacy default stream and the device's default memory pool, its release threshold
 * raised to the maximum first (as PyTorch's cudaMallocAsync backend does) so that the pool keeps
 * what is freed: the cached state, like vramkit's warm pool. Each pass ends with a stream
 * synchronize, counted in its time. */
static PyObject *bench_cuda_async_pairs(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *sizes_obj;
    int device, passes;
    bench_run_t run;
    if (!PyArg_ParseTuple(args, "iOi:bench_cuda_async_pairs", &device, &sizes_obj, &passes) ||
        bench_begin(&run, sizes_obj, passes) != 0)
        return NULL;
    cudaError_t err;
    Py_BEGIN_ALLOW_THREADS err = cudaSetDevice(device);
    cudaMemPool_t mempool;
    if (err == cudaSuccess) err = cudaDeviceGetDefaultMemPool(&mempool, device);
    uint64_t keep_all = UINT64_MAX;
    if (err == cudaSuccess) err = cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &keep_all);
    for (int p = 0; p < run.passes && err == cudaSuccess; p++) {
        uint64_t start = vram__now_ns();
        for (Py_ssize_t i = 0; i < run.n && err == cudaSuccess; i++) {
            void *ptr = NULL;
            err = cudaMallocAsync(&ptr, (size_t)run.sizes[i], 0);
            if (err == cudaSuccess) err = cudaFreeAsync(ptr, 0);
        }
        if (err == cudaSuccess) err = cudaStreamSynchronize(0);
        run.ns[p] = per_pair(start, run.n);
    }
    Py_END_ALLOW_THREADS if (err != cudaSuccess) {
        bench_end(&run, 0);
        return PyErr_Format(PyExc_RuntimeError, "bench_cuda_async_pairs: %s (%s)", cudaGetErrorName(err),
                            cudaGetErrorString(err));
    }
    return bench_end(&run, 1);
}
#endif

static PyMethodDef methods[] = {
    {"bench_pool_pairs", bench_pool_pairs, METH_VARARGS,
     "bench_pool_pairs(device, sizes_u64, passes) -> ns per malloc+free pair, per pass"},
    {"bench_malloc_pairs", bench_malloc_pairs, METH_VARARGS,
     "bench_malloc_pairs(sizes_u64, passes) -> ns per glibc malloc+free pair, per pass"},
    {"bench_torch_glue_pairs", bench_torch_glue_pairs, METH_VARARGS,
     "bench_torch_glue_pairs(device, sizes_u64, passes) -> ([direct], [torch hooks], [hooks + torch's bookkeeping]) ns "
     "per pair, per pass"},
#ifdef VRAMKIT_WITH_CUDA
    {"bench_cuda_async_pairs", bench_cuda_async_pairs, METH_VARARGS,
     "bench_cuda_async_pairs(device_index, sizes_u64, passes) -> ns per cudaMallocAsync+cudaFreeAsync pair, per pass"},
#endif
    {NULL, NULL, 0, NULL},
};

int vk_bench_init(PyObject *module) { return vk_add_methods(module, methods); }
