/* snapshot.c — PyTorch's _snapshot() dict: {"segments": [...], "device_traces": [[...]]},
 * which pytorch.org/memory_viz renders once pickled (protocol 4). The viewer computes block
 * addresses by walking each segment's blocks in order, so every block, free ones included,
 * is listed in address order; it draws the state "active_pending_free" (PyTorch's C++ name). */
#include "module.h"

#include <time.h>

#include "../util/clock.h"

static const char *const block_states[] = {"inactive", "active_allocated", "active_pending_free"};
static const char *const trace_actions[] = {"alloc",        "free_requested", "free_completed", "segment_alloc",
                                            "segment_free", "oom",            "snapshot",       "segment_map",
                                            "segment_unmap"};
#define NUM_TRACE_ACTIONS (sizeof trace_actions / sizeof *trace_actions)

/* Frames lists are shared between entries with the same context, so the pickle memoizes them. */
static PyObject *frames_for(PyObject *cache, uint64_t context) {
    PyObject *key = PyLong_FromUnsignedLongLong(context);
    if (!key) return NULL;
    PyObject *frames = PyDict_GetItemWithError(cache, key);
    if (frames) {
        Py_DECREF(key);
        return Py_NewRef(frames);
    }
    if (PyErr_Occurred() || !(frames = vk_context_frames(context)) || PyDict_SetItem(cache, key, frames) != 0) {
        Py_DECREF(key);
        Py_XDECREF(frames);
        return NULL;
    }
    Py_DECREF(key);
    return frames;
}

static PyObject *block_dict(const vram_snapshot_block_t *b, PyObject *cache) {
    PyObject *frames = frames_for(cache, b->context);
    if (!frames) return NULL;
    return Py_BuildValue("{s:K,s:K,s:K,s:s,s:N}", "address", (unsigned long long)b->address, "size",
                         (unsigned long long)b->size, "requested_size", (unsigned long long)b->requested_size,
                         "state", block_states[b->state < 3 ? b->state : 0], "frames", frames);
}

static PyObject *segment_dict(const vram_snapshot_t *snap, const vram_snapshot_segment_t *s, int device_index,
                              PyObject *cache) {
    PyObject *blocks = PyList_New((Py_ssize_t)s->num_blocks);
    if (!blocks) return NULL;
    for (uint64_t i = 0; i < s->num_blocks; i++) {
        PyObject *b = block_dict(&snap->blocks[s->first_block + i], cache);
        if (!b) {
            Py_DECREF(blocks);
            return NULL;
        }
        PyList_SET_ITEM(blocks, (Py_ssize_t)i, b);
    }
    PyObject *frames = PyList_New(0);
    if (!frames) {
        Py_DECREF(blocks);
        return NULL;
    }
    return Py_BuildValue("{s:i,s:K,s:K,s:K,s:s,s:(ii),s:K,s:K,s:K,s:O,s:N,s:N}", "device", device_index, "address",
                         (unsigned long long)s->address, "total_size", (unsigned long long)s->total_size, "stream",
                         (unsigned long long)s->stream, "segment_type", s->is_small ? "small" : "large",
                         "segment_pool_id", 0, 0, "allocated_size", (unsigned long long)s->allocated_size,
                         "active_size", (unsigned long long)s->active_size, "requested_size",
                         (unsigned long long)s->requested_size, "is_expandable", s->is_expandable ? Py_True : Py_False, "frames", frames,
                         "blocks", blocks);
}

/* Microseconds since the Unix epoch, like PyTorch's time_us, from the monotonic stamps. */
static int64_t epoch_offset_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t real_us = (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
    return real_us - (int64_t)(vram__now_ns() / 1000);
}

static PyObject *trace_dict(const vram_trace_entry_t *e, PyObject *cache, int64_t offset_us) {
    PyObject *frames = frames_for(cache, e->context);
    if (!frames) return NULL;
    const char *action = trace_actions[e->action < NUM_TRACE_ACTIONS ? e->action : 0];
    long long time_us = (long long)(e->time_ns / 1000) + offset_us;
    if (e->action == VRAM_TRACE_OOM)
        return Py_BuildValue("{s:s,s:K,s:K,s:L,s:N,s:K,s:(ii)}", "action", action, "size", (unsigned long long)e->size,
                             "stream", (unsigned long long)e->stream, "time_us", time_us, "frames", frames,
                             "device_free", (unsigned long long)e->device_free, "pool_id", 0, 0);
    return Py_BuildValue("{s:s,s:K,s:K,s:K,s:L,s:N,s:(ii)}", "action", action, "addr", (unsigned long long)e->addr,
                         "size", (unsigned long long)e->size, "stream", (unsigned long long)e->stream, "time_us",
                         time_us, "frames", frames, "pool_id", 0, 0);
}

static PyObject *build(const vram_snapshot_t *snap) {
    /* The viewer offers device i when device_traces has an entry at i: use the CUDA or sim
     * ordinal, and 0 for cpu. */
    int device_index = snap->device.kind == VRAM_DEVICE_CPU ? 0 : snap->device.index;
    PyObject *cache = PyDict_New(), *segments = NULL, *traces = NULL, *trace = NULL, *result = NULL;
    if (!cache || !(segments = PyList_New((Py_ssize_t)snap->num_segments))) goto done;
    for (uint64_t i = 0; i < snap->num_segments; i++) {
        PyObject *s = segment_dict(snap, &snap->segments[i], device_index, cache);
        if (!s) goto done;
        PyList_SET_ITEM(segments, (Py_ssize_t)i, s);
    }
    if (!(trace = PyList_New((Py_ssize_t)snap->num_trace))) goto done;
    int64_t offset = epoch_offset_us();
    for (uint64_t i = 0; i < snap->num_trace; i++) {
        PyObject *t = trace_dict(&snap->trace[i], cache, offset);
        if (!t) goto done;
        PyList_SET_ITEM(trace, (Py_ssize_t)i, t);
    }
    if (!(traces = PyList_New(device_index + 1))) goto done;
    for (int i = 0; i < device_index; i++) {
        PyObject *empty = PyList_New(0);
        if (!empty) goto done;
        PyList_SET_ITEM(traces, i, empty);
    }
    PyList_SET_ITEM(traces, device_index, trace);
    trace = NULL;
    PyObject *name = vk_device_name(snap->device);
    if (name)
        result = Py_BuildValue("{s:O,s:O,s:N}", "segments", segments, "device_traces", traces, "vramkit_device", name);
done:
    Py_XDECREF(cache);
    Py_XDECREF(segments);
    Py_XDECREF(traces);
    Py_XDECREF(trace);
    return result;
}

static PyObject *memory_snapshot(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *kwlist[] = {"device", NULL};
    PyObject *device = Py_None;
    vram_pool_t *pool;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:memory_snapshot", kwlist, &device) ||
        vk_pool_from_arg(device, &pool) != 0)
        return NULL;
    vram_snapshot_t *snap = NULL;
    vram_status_t status = vram_pool_snapshot(pool, &snap);
    if (status != VRAM_OK) return vk_raise(status);
    PyObject *result = build(snap);
    vram_snapshot_free(snap);
    return result;
}

static PyMethodDef methods[] = {
    {"memory_snapshot", (PyCFunction)(void (*)(void))memory_snapshot, METH_VARARGS | METH_KEYWORDS,
     "memory_snapshot(device=None) -> dict in the schema of torch.cuda.memory._snapshot()"},
    {NULL, NULL, 0, NULL},
};

int vk_snapshot_init(PyObject *module) { return vk_add_methods(module, methods); }
