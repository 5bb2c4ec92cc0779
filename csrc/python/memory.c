/* memory.c — raw allocation, counters, limits, settings and the summary, as Python functions.
 * raw_alloc/raw_free use vectorcall-style argument parsing: they are the hot path from
 * Python, and PyArg_ParseTupleAndKeywords alone would cost more than the allocation. */
#include "module.h"

#include <stdlib.h>

static int stream_from_arg(PyObject *obj, vram_stream_t *out) {
    if (!obj || obj == Py_None) {
        *out = 0;
        return 0;
    }
    PyObject *handle = NULL;
    /* torch.cuda.Stream has .cuda_stream, cupy's Stream has .ptr: take the raw handle. */
    if (!PyIndex_Check(obj)) {
        if (PyObject_HasAttrString(obj, "cuda_stream")) handle = PyObject_GetAttrString(obj, "cuda_stream");
        else if (PyObject_HasAttrString(obj, "ptr")) handle = PyObject_GetAttrString(obj, "ptr");
        if (!handle) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_TypeError, "stream must be an int handle, a torch/cupy stream or None; got %.80s",
                             Py_TYPE(obj)->tp_name);
            return -1;
        }
        obj = handle;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    Py_XDECREF(handle);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "stream must be a non-negative integer handle below 2**64");
        return -1;
    }
    *out = v;
    return 0;
}

static int ptr_from_arg(PyObject *obj, uintptr_t *out) {
    if (PyBool_Check(obj) || !PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "ptr must be an int address returned by raw_alloc, got %.80s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_ValueError, "ptr must be a non-negative address below 2**64");
        return -1;
    }
    *out = (uintptr_t)v;
    return 0;
}

/* Positional-or-keyword arguments from a vectorcall, in `names` order. */
static int fast_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, const char *fn,
                     const char *const *names, int total, int required, PyObject **out) {
    if (!kwnames && nargs >= required && nargs <= total) { /* positional only: the usual call */
        for (int i = 0; i < total; i++) out[i] = i < nargs ? args[i] : NULL;
        return 0;
    }
    if (nargs > total) {
        PyErr_Format(PyExc_TypeError, "%s() takes at most %d arguments (%zd given)", fn, total, nargs);
        return -1;
    }
    for (int i = 0; i < total; i++) out[i] = i < nargs ? args[i] : NULL;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        const char *key = PyUnicode_AsUTF8(PyTuple_GET_ITEM(kwnames, k));
        if (!key) return -1;
        int found = -1;
        for (int i = 0; i < total; i++)
            if (!strcmp(key, names[i])) found = i;
        if (found < 0) {
            PyErr_Format(PyExc_TypeError, "%s() got an unexpected keyword argument '%s'", fn, key);
            return -1;
        }
        if (out[found]) {
            PyErr_Format(PyExc_TypeError, "%s() got multiple values for argument '%s'", fn, key);
            return -1;
        }
        out[found] = args[nargs + k];
    }
    for (int i = 0; i < required; i++)
        if (!out[i]) {
            PyErr_Format(PyExc_TypeError, "%s() missing required argument '%s'", fn, names[i]);
            return -1;
        }
    return 0;
}

static PyObject *raw_alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    static const char *const names[] = {"nbytes", "device", "stream"};
    PyObject *a[3];
    uint64_t nbytes;
    vram_stream_t stream;
    vram_pool_t *pool;
    if (fast_args(args, nargs, kwnames, "raw_alloc", names, 3, 1, a) != 0 ||
        vk_size_from_arg(a[0], "nbytes", &nbytes) != 0 || vk_alloc_pool_from_arg(a[1], &pool) != 0 ||
        stream_from_arg(a[2], &stream) != 0)
        return NULL;
    uint64_t context = vk_capture_context(pool);
    void *ptr = NULL;
    vram_status_t status = vram_malloc(pool, nbytes, stream, context, &ptr);
    if (status != VRAM_OK) return vk_raise(status);
    return PyLong_FromVoidPtr(ptr);
}

static PyObject *raw_free(PyObject *self, PyObject *arg) {
    (void)self;
    uintptr_t ptr;
    vram_pool_t *pool;
    int freed = 0;
    if (ptr_from_arg(arg, &ptr) != 0) return NULL;
    if (ptr == 0) Py_RETURN_NONE; /* raw_alloc(0) returned 0 */
    /* Most memory comes from the default device: try its pool before searching them all. */
    if (vk_pool_from_arg(Py_None, &pool) != 0) return NULL;
    vram_status_t status = vram_try_free(pool, (void *)ptr, vk_capture_context(pool), &freed);
    if (status == VRAM_OK && !freed) {
        if (vram_find_pool((void *)ptr, &pool) != VRAM_OK) return vk_raise(VRAM_ERR_INVALID_ARG);
        status = vram_free(pool, (void *)ptr, vk_capture_context(pool));
    }
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *record_stream(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ptr_obj, *stream_obj;
    uintptr_t ptr;
    vram_stream_t stream;
    vram_pool_t *pool;
    if (!PyArg_ParseTuple(args, "OO:record_stream", &ptr_obj, &stream_obj) || ptr_from_arg(ptr_obj, &ptr) != 0 ||
        stream_from_arg(stream_obj, &stream) != 0)
        return NULL;
    if (vram_find_pool((void *)ptr, &pool) != VRAM_OK) return vk_raise(VRAM_ERR_INVALID_ARG);
    vram_status_t status = vram_record_stream(pool, (void *)ptr, stream);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *block_info(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ptr_obj;
    uintptr_t ptr;
    vram_pool_t *pool;
    if (!PyArg_ParseTuple(args, "O:block_info", &ptr_obj) || ptr_from_arg(ptr_obj, &ptr) != 0) return NULL;
    if (vram_find_pool((void *)ptr, &pool) != VRAM_OK) return vk_raise(VRAM_ERR_INVALID_ARG);
    vram_block_info_t info;
    vram_status_t status = vram_block_query(pool, (void *)ptr, &info);
    if (status != VRAM_OK) return vk_raise(status);
    PyObject *device = vk_device_name(vram_pool_device(pool));
    if (!device) return NULL;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:s,s:N}", "address", (unsigned long long)info.address, "size",
                         (unsigned long long)info.size, "requested_size", (unsigned long long)info.requested_size,
                         "stream", (unsigned long long)info.stream, "segment_address",
                         (unsigned long long)info.segment_address, "segment_size",
                         (unsigned long long)info.segment_size, "pool", info.is_small_pool ? "small" : "large",
                         "device", device);
}

/* Parse "(device=None)" style arguments shared by many functions. */
static int pool_only(PyObject *args, PyObject *kwargs, const char *format, vram_pool_t **pool) {
    static char *kwlist[] = {"device", NULL};
    PyObject *device = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, kwlist, &device)) return -1;
    return vk_pool_from_arg(device, pool);
}

static PyObject *synchronize(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"device", "stream", NULL};
    PyObject *device = Py_None, *stream_obj = Py_None;
    vram_pool_t *pool;
    vram_stream_t stream = VRAM_ALL_STREAMS;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|OO:synchronize", kwlist, &device, &stream_obj) ||
        vk_pool_from_arg(device, &pool) != 0)
        return NULL;
    if (stream_obj != Py_None && stream_from_arg(stream_obj, &stream) != 0) return NULL;
    vram_status_t status;
    Py_BEGIN_ALLOW_THREADS status = vram_pool_synchronize(pool, stream);
    Py_END_ALLOW_THREADS if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *empty_cache(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_pool_t *pool;
    if (pool_only(args, kwargs, "|O:empty_cache", &pool) != 0) return NULL;
    uint64_t released = 0;
    vram_status_t status = vram_empty_cache(pool, &released);
    if (status != VRAM_OK) return vk_raise(status);
    return PyLong_FromUnsignedLongLong(released);
}

static PyObject *set_caching_enabled(PyObject *self, PyObject *arg) {
    (void)self;
    int enabled = PyObject_IsTrue(arg);
    if (enabled < 0) return NULL;
    vram_set_caching_enabled(enabled);
    Py_RETURN_NONE;
}

static PyObject *caching_enabled(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(vram_caching_enabled());
}

static PyObject *caching_disable_enter(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    vram_status_t status = vram_caching_disable_enter();
    if (status != VRAM_OK) return PyErr_Format(PyExc_RuntimeError, "%s", vram_last_error());
    Py_RETURN_NONE;
}

/* An exit without an enter is a misuse of the API, not bad data: RuntimeError, as Python's
 * own lock.release() raises for an unlocked lock. */
static PyObject *caching_disable_exit(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    vram_status_t status = vram_caching_disable_exit();
    if (status != VRAM_OK) return PyErr_Format(PyExc_RuntimeError, "%s", vram_last_error());
    Py_RETURN_NONE;
}

static PyObject *caching_disabled_blocks(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(vram_caching_disabled_blocks());
}

static PyObject *mem_get_info(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_pool_t *pool;
    if (pool_only(args, kwargs, "|O:mem_get_info", &pool) != 0) return NULL;
    uint64_t free_bytes = 0, total = 0;
    vram_status_t status = vram_mem_get_info(pool, &free_bytes, &total);
    if (status != VRAM_OK) return vk_raise(status);
    return Py_BuildValue("(KK)", (unsigned long long)free_bytes, (unsigned long long)total);
}

static PyObject *set_memory_fraction(PyObject *self, PyObject *args) {
    (void)self;
    double fraction;
    PyObject *device = Py_None;
    vram_pool_t *pool;
    if (!PyArg_ParseTuple(args, "dO:set_memory_fraction", &fraction, &device) || vk_pool_from_arg(device, &pool) != 0)
        return NULL;
    vram_status_t status = vram_set_memory_fraction(pool, fraction);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *set_memory_limit(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *limit_obj, *device = Py_None;
    vram_pool_t *pool;
    uint64_t limit = VRAM_NO_LIMIT;
    if (!PyArg_ParseTuple(args, "OO:set_memory_limit", &limit_obj, &device)) return NULL;
    if (limit_obj != Py_None && vk_size_from_arg(limit_obj, "nbytes", &limit) != 0) return NULL;
    if (vk_pool_from_arg(device, &pool) != 0) return NULL;
    vram_status_t status = vram_set_memory_limit(pool, limit);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    const char *conf;
    PyObject *device = Py_None;
    vram_pool_t *pool;
    if (!PyArg_ParseTuple(args, "sO:configure", &conf, &device) || vk_pool_from_arg(device, &pool) != 0) return NULL;
    vram_status_t status = vram_configure(pool, conf);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *bytes_or_none(uint64_t v) {
    return v == UINT64_MAX ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(v);
}

static PyObject *get_settings(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_pool_t *pool;
    if (pool_only(args, kwargs, "|O:get_settings", &pool) != 0) return NULL;
    vram_settings_t s;
    vram_status_t status = vram_get_settings(pool, &s);
    if (status != VRAM_OK) return vk_raise(status);
    PyObject *divisions = PyList_New(16);
    if (!divisions) return NULL;
    for (int i = 0; i < 16; i++) {
        PyObject *d = PyLong_FromUnsignedLong(s.roundup_power2_divisions[i]);
        if (!d) {
            Py_DECREF(divisions);
            return NULL;
        }
        PyList_SET_ITEM(divisions, i, d);
    }
    PyObject *d = Py_BuildValue("{s:N,s:K,s:N,s:d,s:d,s:N,s:N,s:O,s:K}", "max_split_size",
                                bytes_or_none(s.max_split_size), "max_non_split_rounding",
                                (unsigned long long)s.max_non_split_rounding, "roundup_power2_divisions", divisions,
                                "garbage_collection_threshold", s.garbage_collection_threshold, "memory_fraction",
                                s.memory_fraction, "memory_limit", bytes_or_none(s.memory_limit), "allowed_bytes",
                                bytes_or_none(s.allowed_bytes), "expandable_segments",
                                s.expandable_segments ? Py_True : Py_False, "expandable_page_size",
                                (unsigned long long)s.expandable_page_size);
    if (!d || !vram_pool_is_host(pool)) return d;
    PyObject *fraction = s.host_cache_limit_fraction < 0 ? Py_NewRef(Py_None)
                                                         : PyFloat_FromDouble(s.host_cache_limit_fraction);
    PyObject *host = Py_BuildValue("{s:O,s:O,s:K,s:N,s:N,s:N,s:N}", "host_memory_check",
                                   s.host_memory_check ? Py_True : Py_False, "host_lazy_free",
                                   s.host_lazy_free ? Py_True : Py_False, "host_reserve",
                                   (unsigned long long)s.host_reserve, "host_page_release",
                                   bytes_or_none(s.host_page_release), "host_cache_limit_bytes",
                                   bytes_or_none(s.host_cache_limit_bytes), "host_cache_limit_fraction", fraction,
                                   "host_cache_limit", bytes_or_none(s.host_cache_limit));
    if (!host || PyDict_Update(d, host) != 0) {
        Py_XDECREF(host);
        Py_DECREF(d);
        return NULL;
    }
    Py_DECREF(host);
    return d;
}

/* host_memory_info() -> dict of vram_host_memory_t: what the cpu pool's check sees. */
static PyObject *host_memory_info(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    vram_host_memory_t h;
    vram_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = vram_host_memory(&h);
    Py_END_ALLOW_THREADS
    if (status != VRAM_OK) return vk_raise(status);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:N,s:K,s:K,s:i,s:s}", "total", (unsigned long long)h.total,
                         "available", (unsigned long long)h.available, "ram_total", (unsigned long long)h.ram_total,
                         "mem_available", (unsigned long long)h.mem_available, "swap_free",
                         (unsigned long long)h.swap_free, "cgroup_limit", bytes_or_none(h.cgroup_limit),
                         "cgroup_usage", (unsigned long long)h.cgroup_usage, "cgroup_reclaimable",
                         (unsigned long long)h.cgroup_reclaimable, "cgroup_version", h.cgroup_version, "cgroup_path",
                         h.cgroup_path);
}

static PyObject *pool_check(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_pool_t *pool;
    if (pool_only(args, kwargs, "|O:pool_check", &pool) != 0) return NULL;
    vram_status_t status = vram_pool_check(pool);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static int get_stats(PyObject *args, PyObject *kwargs, const char *format, vram_stats_t *s, vram_pool_t **out) {
    vram_pool_t *pool;
    if (pool_only(args, kwargs, format, &pool) != 0) return -1;
    if (out) *out = pool;
    s->size = sizeof *s;
    vram_status_t status = vram_get_stats(pool, s);
    if (status != VRAM_OK) {
        vk_raise(status);
        return -1;
    }
    return 0;
}

static int put(PyObject *dict, const char *key, int64_t value) {
    PyObject *v = PyLong_FromLongLong(value);
    if (!v) return -1;
    int rc = PyDict_SetItemString(dict, key, v);
    Py_DECREF(v);
    return rc;
}

static int put_stat(PyObject *dict, const char *prefix, const vram_stat_t *s) {
    char key[96];
    snprintf(key, sizeof key, "%s.current", prefix);
    if (put(dict, key, s->current)) return -1;
    snprintf(key, sizeof key, "%s.peak", prefix);
    if (put(dict, key, s->peak)) return -1;
    snprintf(key, sizeof key, "%s.allocated", prefix);
    if (put(dict, key, s->allocated)) return -1;
    snprintf(key, sizeof key, "%s.freed", prefix);
    return put(dict, key, s->freed);
}

/* The flat dict of torch.cuda.memory_stats, keys generated from the X-macro lists. */
static PyObject *memory_stats(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_stats_t s;
    vram_pool_t *pool;
    if (get_stats(args, kwargs, "|O:memory_stats", &s, &pool) != 0) return NULL;
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    static const char *const types[VRAM_STAT_TYPES] = {"all", "small_pool", "large_pool"};
    char prefix[64];
#define ADD_ARRAY(key, label, is_bytes)                                    \
    for (int t = 0; t < VRAM_STAT_TYPES; t++) {                            \
        snprintf(prefix, sizeof prefix, "%s.%s", #key, types[t]);          \
        if (put_stat(d, prefix, &s.key[t])) goto fail;                     \
    }
    VRAM_STAT_ARRAYS(ADD_ARRAY)
#undef ADD_ARRAY
#define ADD_SINGLE(key, label) \
    if (put_stat(d, #key, &s.key)) goto fail;
    VRAM_STAT_SINGLES(ADD_SINGLE)
#undef ADD_SINGLE
#define ADD_COUNTER(key) \
    if (put(d, #key, s.key)) goto fail;
    VRAM_STAT_COUNTERS(ADD_COUNTER)
#undef ADD_COUNTER
    if (put(d, "max_split_size", s.max_split_size)) goto fail;
    if (s.version >= 2 && vram_pool_is_host(pool)) { /* host pools add their own keys */
        if (put(d, "host_cache_limit", s.host_cache_limit) || put(d, "host_reclaimable_bytes", s.host_reclaimable_bytes) ||
            put(d, "host_lazy_reused_bytes", s.host_lazy_reused_bytes) ||
            put(d, "host_untouched_bytes", s.host_untouched_bytes))
            goto fail;
#define ADD_HOST_COUNTER(key) \
    if (put(d, #key, s.key)) goto fail;
        VRAM_HOST_COUNTERS(ADD_HOST_COUNTER)
#undef ADD_HOST_COUNTER
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

/* (allocated, max allocated, reserved, max reserved): the getters users call in loops. */
static PyObject *memory_counters(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_stats_t s;
    if (get_stats(args, kwargs, "|O:memory_counters", &s, NULL) != 0) return NULL;
    return Py_BuildValue("(LLLL)", (long long)s.allocated_bytes[VRAM_STAT_ALL].current,
                         (long long)s.allocated_bytes[VRAM_STAT_ALL].peak,
                         (long long)s.reserved_bytes[VRAM_STAT_ALL].current,
                         (long long)s.reserved_bytes[VRAM_STAT_ALL].peak);
}

static PyObject *reset_peak(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_pool_t *pool;
    if (pool_only(args, kwargs, "|O:reset_peak_memory_stats", &pool) != 0) return NULL;
    vram_reset_peak(pool);
    Py_RETURN_NONE;
}

static PyObject *reset_accumulated(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_pool_t *pool;
    if (pool_only(args, kwargs, "|O:reset_accumulated_memory_stats", &pool) != 0) return NULL;
    vram_reset_accumulated(pool);
    Py_RETURN_NONE;
}

static PyObject *memory_summary(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"device", "abbreviated", NULL};
    PyObject *device = Py_None;
    int abbreviated = 0;
    vram_pool_t *pool;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|Op:memory_summary", kwlist, &device, &abbreviated) ||
        vk_pool_from_arg(device, &pool) != 0)
        return NULL;
    char *text = NULL;
    vram_status_t status = vram_memory_summary(pool, abbreviated, &text);
    if (status != VRAM_OK) return vk_raise(status);
    PyObject *result = PyUnicode_FromString(text);
    free(text);
    return result;
}

static PyObject *history_enable(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *device, *max_obj;
    uint64_t max_entries;
    vram_pool_t *pool;
    if (!PyArg_ParseTuple(args, "OO:history_enable", &device, &max_obj) ||
        vk_size_from_arg(max_obj, "max_entries", &max_entries) != 0 || vk_pool_from_arg(device, &pool) != 0)
        return NULL;
    vram_status_t status = vram_history_enable(pool, max_entries);
    if (status != VRAM_OK) return vk_raise(status);
    Py_RETURN_NONE;
}

static PyObject *history_enabled(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    vram_pool_t *pool;
    if (pool_only(args, kwargs, "|O:history_enabled", &pool) != 0) return NULL;
    return PyBool_FromLong(vram_history_enabled(pool));
}

#define KW (METH_VARARGS | METH_KEYWORDS)
static PyMethodDef methods[] = {
    {"raw_alloc", (PyCFunction)(void (*)(void))raw_alloc, METH_FASTCALL | METH_KEYWORDS,
     "raw_alloc(nbytes, device=None, stream=0) -> int\n\nAllocate nbytes from the device's cache and return the "
     "address (0 for nbytes == 0). Free it with raw_free."},
    {"raw_free", raw_free, METH_O, "raw_free(ptr)\n\nReturn an address from raw_alloc to its cache (0 is a no-op)."},
    {"record_stream", record_stream, METH_VARARGS,
     "record_stream(ptr, stream)\n\nMark a live allocation as used on `stream`: after it is freed it is not reused "
     "until the work queued on that stream has finished."},
    {"block_info", block_info, METH_VARARGS, "block_info(ptr) -> dict describing a live allocation."},
    {"synchronize", (PyCFunction)(void (*)(void))synchronize, KW,
     "synchronize(device=None, stream=None)\n\nWait for a stream (or all) and return blocks whose events finished."},
    {"empty_cache", (PyCFunction)(void (*)(void))empty_cache, KW, "empty_cache(device=None) -> bytes released"},
    {"mem_get_info", (PyCFunction)(void (*)(void))mem_get_info, KW, "mem_get_info(device=None) -> (free, total)"},
    {"host_memory_info", host_memory_info, METH_NOARGS, "host_memory_info() -> dict: the host memory the cpu pool checks"},
    {"set_memory_fraction", set_memory_fraction, METH_VARARGS, "set_memory_fraction(fraction, device)"},
    {"set_memory_limit", set_memory_limit, METH_VARARGS, "set_memory_limit(nbytes_or_None, device)"},
    {"configure", configure, METH_VARARGS, "configure(conf_string, device): VRAMKIT_ALLOC_CONF syntax"},
    {"get_settings", (PyCFunction)(void (*)(void))get_settings, KW, "get_settings(device=None) -> dict"},
    {"pool_check", (PyCFunction)(void (*)(void))pool_check, KW,
     "pool_check(device=None)\n\nVerify every allocator invariant; raises VramkitError naming the first violation."},
    {"memory_stats", (PyCFunction)(void (*)(void))memory_stats, KW, "memory_stats(device=None) -> dict"},
    {"memory_counters", (PyCFunction)(void (*)(void))memory_counters, KW,
     "memory_counters(device=None) -> (allocated, max_allocated, reserved, max_reserved)"},
    {"reset_peak_memory_stats", (PyCFunction)(void (*)(void))reset_peak, KW, "peak = current for every counter"},
    {"reset_accumulated_memory_stats", (PyCFunction)(void (*)(void))reset_accumulated, KW,
     "zero the allocated/freed totals and the event counters"},
    {"set_caching_enabled", set_caching_enabled, METH_O,
     "set_caching_enabled(enabled) -> caching on or off for every pool (off: freed segments go back at once)"},
    {"caching_enabled", caching_enabled, METH_NOARGS,
     "caching_enabled() -> whether pools keep freed memory cached now (the flag, and no caching-disabled block active)"},
    {"caching_disable_enter", caching_disable_enter, METH_NOARGS,
     "caching_disable_enter()\n\nStart a caching-disabled block: caching is off while any block is active."},
    {"caching_disable_exit", caching_disable_exit, METH_NOARGS,
     "caching_disable_exit()\n\nEnd a caching-disabled block; RuntimeError if none is active."},
    {"caching_disabled_blocks", caching_disabled_blocks, METH_NOARGS,
     "caching_disabled_blocks() -> the number of caching-disabled blocks active, on all threads"},
    {"memory_summary", (PyCFunction)(void (*)(void))memory_summary, KW,
     "memory_summary(device=None, abbreviated=False) -> PyTorch's 75-column table"},
    {"history_enable", history_enable, METH_VARARGS, "history_enable(device, max_entries); 0 stops recording"},
    {"history_enabled", (PyCFunction)(void (*)(void))history_enabled, KW, "history_enabled(device=None) -> bool"},
    {NULL, NULL, 0, NULL},
};

int vk_memory_init(PyObject *module) { return vk_add_methods(module, methods); }
