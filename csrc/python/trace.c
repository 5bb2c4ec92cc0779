/* trace.c — _C.trace_replay: vram_trace_replay over NumPy columns (any object with the buffer
 * protocol), with the GIL released for the loop. Every column is checked here for dtype,
 * dimensions, contiguity, length and (for the outputs) writability, naming the argument, so
 * the C call sees only the trace's own rules. Also _C.plain_pickle_problem, the check of a snapshot
 * pickle read from a file before it is unpickled. */
#include "columns.h"
#include "module.h"

#include <string.h>

static PyObject *oom_info_dict(const vram_oom_info_t *info) {
    PyObject *allowed = info->allowed == UINT64_MAX ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(info->allowed);
    if (!allowed) return NULL;
    return Py_BuildValue("{s:i,s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:N}", "device_kind", info->device_kind, "device_index",
                         info->device_index, "requested", (unsigned long long)info->requested, "segment_size",
                         (unsigned long long)info->segment_size, "device_free",
                         (unsigned long long)info->device_free, "device_total",
                         (unsigned long long)info->device_total, "allocated", (unsigned long long)info->allocated,
                         "reserved", (unsigned long long)info->reserved, "allowed", allowed);
}

static PyObject *result_dict(const vram_replay_result_t *r) {
    return Py_BuildValue(
        "{s:K,s:K,s:L,s:K,s:K,s:L,s:K,s:K,s:L,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "events", (unsigned long long)r->events,
        "peak_allocated", (unsigned long long)r->peak_allocated, "peak_allocated_event",
        (long long)r->peak_allocated_event, "reserved_at_peak_allocated",
        (unsigned long long)r->reserved_at_peak_allocated, "peak_reserved", (unsigned long long)r->peak_reserved,
        "peak_reserved_event", (long long)r->peak_reserved_event, "allocated_at_peak_reserved",
        (unsigned long long)r->allocated_at_peak_reserved, "peak_requested", (unsigned long long)r->peak_requested,
        "oom_event", (long long)r->oom_event, "final_allocated", (unsigned long long)r->final_allocated,
        "final_reserved", (unsigned long long)r->final_reserved, "num_alloc_retries",
        (unsigned long long)r->num_alloc_retries, "num_ooms", (unsigned long long)r->num_ooms, "num_device_alloc",
        (unsigned long long)r->num_device_alloc, "num_device_free", (unsigned long long)r->num_device_free,
        "segments_at_peak_reserved", (unsigned long long)r->segments_at_peak_reserved);
}

enum { KIND, ID, SIZE, STREAM, RESERVED, ALLOCATED, ADDR, NUM_COLUMNS };

/* trace_replay(kind, id, size, stream, capacity, conf=None, reserved_out=None,
 *              allocated_out=None, addr_out=None) -> dict */
static PyObject *trace_replay(PyObject *self, PyObject *args, PyObject *kwargs) {
    (void)self;
    static char *keywords[] = {"kind", "id", "size", "stream", "capacity", "conf", "reserved_out", "allocated_out",
                               "addr_out", NULL};
    PyObject *obj[NUM_COLUMNS], *capacity_obj, *conf_obj = Py_None;
    obj[RESERVED] = obj[ALLOCATED] = obj[ADDR] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOOO|OOOO:trace_replay", keywords, &obj[KIND], &obj[ID],
                                     &obj[SIZE], &obj[STREAM], &capacity_obj, &conf_obj, &obj[RESERVED],
                                     &obj[ALLOCATED], &obj[ADDR]))
        return NULL;
    uint64_t capacity;
    if (vk_size_from_arg(capacity_obj, "capacity", &capacity) != 0) return NULL;
    const char *conf = NULL;
    if (conf_obj != Py_None) {
        if (!PyUnicode_Check(conf_obj)) {
            PyErr_Format(PyExc_TypeError, "conf must be a str in VRAMKIT_ALLOC_CONF syntax or None, got %.80s",
                         Py_TYPE(conf_obj)->tp_name);
            return NULL;
        }
        if (!(conf = PyUnicode_AsUTF8(conf_obj))) return NULL;
    }

    static const char *names[NUM_COLUMNS] = {"kind", "id", "size", "stream", "reserved_out", "allocated_out",
                                             "addr_out"};
    const column_kind_t *kinds[NUM_COLUMNS] = {&VK_UINT8, &VK_INT64, &VK_UINT64, &VK_UINT64, &VK_UINT64, &VK_UINT64, &VK_UINT64};
    column_t col[NUM_COLUMNS];
    memset(col, 0, sizeof col);
    for (int c = 0; c < NUM_COLUMNS; c++) {
        if (vk_get_column(obj[c], names[c], kinds[c], c >= STREAM, c >= RESERVED, &col[c]) != 0) {
            vk_release_columns(col, c);
            return NULL;
        }
        if (c > KIND && col[c].held && col[c].len != col[KIND].len) {
            PyErr_Format(PyExc_ValueError, "%s has %zd entries but kind has %zd: every column has one entry per event",
                         names[c], col[c].len, col[KIND].len);
            vk_release_columns(col, c + 1);
            return NULL;
        }
    }
    /* The outputs must not share memory with each other or the inputs: the loop reads a column
     * after writing another, and NumPy views make that easy to get wrong. */
    for (int c = RESERVED; c < NUM_COLUMNS; c++) {
        if (!col[c].held || col[c].len == 0) continue;
        const char *lo = col[c].view.buf, *hi = lo + col[c].view.len;
        for (int d = 0; d < NUM_COLUMNS; d++) {
            if (d == c || !col[d].held || col[d].len == 0) continue;
            const char *lo2 = col[d].view.buf, *hi2 = lo2 + col[d].view.len;
            if (lo < hi2 && lo2 < hi) {
                PyErr_Format(PyExc_ValueError, "%s shares memory with %s; give each output its own array", names[c],
                             names[d]);
                vk_release_columns(col, NUM_COLUMNS);
                return NULL;
            }
        }
    }

    size_t n = (size_t)col[KIND].len;
#define BUF(c, type) (col[c].held ? (type *)col[c].view.buf : NULL)
    vram_replay_result_t r;
    vram_status_t status;
    vram_oom_info_t oom;
    char message[2048] = "";
    Py_BEGIN_ALLOW_THREADS
    status = vram_trace_replay(BUF(KIND, const uint8_t), BUF(ID, const int64_t), BUF(SIZE, const uint64_t),
                               BUF(STREAM, const uint64_t), n, capacity, conf, BUF(RESERVED, uint64_t),
                               BUF(ALLOCATED, uint64_t), BUF(ADDR, uint64_t), &r);
    /* Copied at once, on this thread: building Python objects can run code that calls vramkit. */
    if (status != VRAM_OK || r.oom_event >= 0) snprintf(message, sizeof message, "%s", vram_last_error());
    if (status == VRAM_OK && r.oom_event >= 0) vram_last_oom(&oom);
    Py_END_ALLOW_THREADS
#undef BUF
    vk_release_columns(col, NUM_COLUMNS);
    if (status != VRAM_OK) {
        /* vk_raise reads the thread's message; it is still this call's, but restore it from the
         * copy in case releasing a buffer ran code that failed in vramkit. */
        if (status == VRAM_ERR_INVALID_ARG) PyErr_SetString(PyExc_ValueError, message);
        else if (status == VRAM_ERR_HOST_MEMORY) PyErr_SetString(PyExc_MemoryError, message);
        else return vk_raise(status);
        return NULL;
    }
    PyObject *dict = result_dict(&r);
    if (!dict || r.oom_event < 0) return dict;
    PyObject *text = PyUnicode_FromString(message);
    PyObject *info = text ? oom_info_dict(&oom) : NULL;
    if (!info || PyDict_SetItemString(dict, "oom_message", text) < 0 || PyDict_SetItemString(dict, "oom_info", info) < 0)
        Py_CLEAR(dict);
    Py_XDECREF(text);
    Py_XDECREF(info);
    return dict;
}

/* _C.plain_pickle_problem(data): None when the bytes are a plain-data pickle
 * (vram_plain_pickle_check), else (names_code, message). The walk runs without the GIL: a
 * snapshot can be gigabytes. */
static PyObject *plain_pickle_problem(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) != 0) return NULL;
    int names_code = 0;
    vram_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = vram_plain_pickle_check(view.buf, (size_t)view.len, &names_code);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (status == VRAM_OK) Py_RETURN_NONE;
    return Py_BuildValue("(Ns)", PyBool_FromLong(names_code), vram_last_error());
}

static PyMethodDef methods[] = {
    {"plain_pickle_problem", plain_pickle_problem, METH_O,
     "plain_pickle_problem(data) -> None or (names_code, message)\n\nWhy the bytes are not a pickle of plain "
     "data that is safe to unpickle (see vram_plain_pickle_check in vramkit_files.h), or None."},
    {"trace_replay", (PyCFunction)(void (*)(void))trace_replay, METH_VARARGS | METH_KEYWORDS,
     "trace_replay(kind, id, size, stream, capacity, conf=None, reserved_out=None, allocated_out=None, "
     "addr_out=None) -> dict\n\nReplay an allocation trace (NumPy columns: kind uint8 0 alloc / 1 free / other "
     "marker, id int64, size uint64, stream uint64 or None) on a private simulated pool of `capacity` bytes; "
     "see vram_trace_replay in vramkit.h. Outputs, when given, are uint64 arrays of one entry per event."},
    {NULL, NULL, 0, NULL},
};

int vk_trace_init(PyObject *module) { return vk_add_methods(module, methods); }
