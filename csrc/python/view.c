/* view.c — the viewer's C work for Python: _C.view_read_snapshot (a snapshot pickle's bytes into
 * one device's history columns, csrc/view/snapshot_history.c) and the timeline queries over those
 * columns (csrc/view/timeline_query.c). Columns go out as bytes (NumPy reads them with
 * frombuffer) and come back in as NumPy arrays checked here; the loops run without the GIL. */
#include <string.h>

#include "../view/snapshot_history.h"
#include "../view/timeline_query.h"
#include "columns.h"
#include "module.h"

static PyObject *read_snapshot(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    int device;
    if (!PyArg_ParseTuple(args, "y*i:view_read_snapshot", &data, &device)) return NULL;
    vk_history_t h;
    vram_status_t s;
    Py_BEGIN_ALLOW_THREADS
    s = vk_history_read(data.buf, (size_t)data.len, device < 0 ? -1 : device, &h);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (s != VRAM_OK) return vk_raise(s);
    PyObject *columns = PyDict_New(), *result = NULL;
    for (int c = 0; columns && c < VK_H_NCOLUMNS; c++) {
        char type[2] = {vk_history_column_types[c], 0};
        size_t es = vk_history_column_size(c);
        PyObject *bytes = PyBytes_FromStringAndSize(h.col[c].p ? h.col[c].p : "", (Py_ssize_t)(h.col[c].n * es));
        PyObject *pair = bytes ? Py_BuildValue("(sN)", type, bytes) : NULL;
        if (!pair || PyDict_SetItemString(columns, vk_history_column_names[c], pair)) Py_CLEAR(columns);
        Py_XDECREF(pair);
    }
    if (columns)
        result = Py_BuildValue("{s:N,s:i,s:O,s:K,s:K,s:K}", "columns", columns, "device", h.device, "block_sizes",
                               h.block_sizes ? Py_True : Py_False, "entries", (unsigned long long)h.entries,
                               "initial_allocations", (unsigned long long)h.initial_allocations, "unfinished_frees",
                               (unsigned long long)h.unfinished_frees);
    vk_history_free(&h);
    return result;
}

/* The event columns every query takes: kind, id, size, group, and the number of groups. */
enum { KIND, ID, SIZE, GROUP, NCOL };

static int get_events(PyObject *const *objs, unsigned long groups, column_t *col, vk_events_t *ev) {
    static const char *names[NCOL] = {"kind", "id", "size", "group"};
    const column_kind_t *kinds[NCOL] = {&VK_UINT8, &VK_UINT32, &VK_UINT64, &VK_INT32};
    for (int c = 0; c < NCOL; c++)
        if (vk_get_column(objs[c], names[c], kinds[c], 0, 0, &col[c])) {
            vk_release_columns(col, c);
            return -1;
        }
    if (col[KIND].len != col[ID].len || col[SIZE].len != col[GROUP].len || groups == 0 || groups > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "kind and id need one entry per event, size and group one per allocation, "
                        "and groups must be at least 1");
        vk_release_columns(col, NCOL);
        return -1;
    }
    *ev = (vk_events_t){col[KIND].view.buf, col[ID].view.buf, (uint64_t)col[KIND].len, col[SIZE].view.buf,
                        col[GROUP].view.buf, (uint64_t)col[SIZE].len, (uint32_t)groups};
    return 0;
}

static PyObject *checkpoints(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objs[NCOL];
    unsigned long groups;
    unsigned long long every;
    if (!PyArg_ParseTuple(args, "OOOOkK:view_checkpoints", &objs[0], &objs[1], &objs[2], &objs[3], &groups, &every))
        return NULL;
    column_t col[NCOL];
    vk_events_t ev;
    if (get_events(objs, groups, col, &ev)) return NULL;
    if (every == 0) {
        vk_release_columns(col, NCOL);
        PyErr_SetString(PyExc_ValueError, "every must be at least 1");
        return NULL;
    }
    uint64_t rows = ev.n / every + 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(rows * ev.groups * sizeof(int64_t)));
    vram_status_t s = VRAM_OK;
    if (out) {
        int64_t *ckpt = (int64_t *)PyBytes_AS_STRING(out);
        Py_BEGIN_ALLOW_THREADS
        s = vk_timeline_checkpoints(&ev, every, ckpt);
        Py_END_ALLOW_THREADS
    }
    vk_release_columns(col, NCOL);
    if (s != VRAM_OK) {
        Py_XDECREF(out);
        return vk_raise(s);
    }
    return out;
}

/* view_groups_at(kind, id, size, group, groups, ckpt, every, at) and
 * view_group_peaks(kind, id, size, group, groups, ckpt, every, edges, track) */
static PyObject *query(PyObject *args, int peaks) {
    PyObject *objs[NCOL], *ckpt_obj, *points_obj;
    unsigned long groups, track = 0;
    unsigned long long every;
    if (peaks ? !PyArg_ParseTuple(args, "OOOOkOKOk:view_group_peaks", &objs[0], &objs[1], &objs[2], &objs[3], &groups,
                                  &ckpt_obj, &every, &points_obj, &track)
              : !PyArg_ParseTuple(args, "OOOOkOKO:view_groups_at", &objs[0], &objs[1], &objs[2], &objs[3], &groups,
                                  &ckpt_obj, &every, &points_obj))
        return NULL;
    column_t col[NCOL], extra[2];
    vk_events_t ev;
    if (get_events(objs, groups, col, &ev)) return NULL;
    if (vk_get_column(ckpt_obj, "ckpt", &VK_INT64, 0, 0, &extra[0])) {
        vk_release_columns(col, NCOL);
        return NULL;
    }
    if (vk_get_column(points_obj, peaks ? "edges" : "at", &VK_UINT64, 0, 0, &extra[1])) {
        vk_release_columns(col, NCOL);
        vk_release_columns(extra, 1);
        return NULL;
    }
    const uint64_t *p = extra[1].view.buf;
    uint64_t count = (uint64_t)extra[1].len;
    const char *problem = NULL;
    if (every == 0 || (uint64_t)extra[0].len != (ev.n / (every ? every : 1) + 1) * ev.groups)
        problem = "ckpt must be view_checkpoints' result for these columns and this every";
    for (uint64_t i = 0; !problem && i < count; i++)
        if (p[i] > ev.n || (!peaks && p[i] >= ev.n) || (i && (peaks ? p[i] <= p[i - 1] : p[i] < p[i - 1])))
            problem = peaks ? "edges must increase strictly and end at most at the number of events"
                            : "at must be sorted event indices below the number of events";
    if (!problem && peaks && (count < 2 || groups > VK_PEAK_MAX_GROUPS || track >= groups))
        problem = "edges needs at least 2 entries, groups at most 256 and track one of them";
    if (problem) {
        vk_release_columns(col, NCOL);
        vk_release_columns(extra, 2);
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    uint64_t cells = peaks ? count - 1 : count * ev.groups;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(cells * sizeof(int64_t)));
    vram_status_t s = VRAM_OK;
    if (out) {
        int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
        const int64_t *ckpt = extra[0].view.buf;
        Py_BEGIN_ALLOW_THREADS
        s = peaks ? vk_timeline_group_peaks(&ev, ckpt, every, p, count - 1, (uint32_t)track, dst)
                  : vk_timeline_groups_at(&ev, ckpt, every, p, count, dst);
        Py_END_ALLOW_THREADS
    }
    vk_release_columns(col, NCOL);
    vk_release_columns(extra, 2);
    if (s != VRAM_OK) {
        Py_XDECREF(out);
        return vk_raise(s);
    }
    return out;
}

static PyObject *groups_at(PyObject *self, PyObject *args) {
    (void)self;
    return query(args, 0);
}

static PyObject *group_peaks(PyObject *self, PyObject *args) {
    (void)self;
    return query(args, 1);
}

static PyMethodDef methods[] = {
    {"view_read_snapshot", read_snapshot, METH_VARARGS,
     "view_read_snapshot(data, device) -> dict\n\nOne device's history from a snapshot pickle's bytes (device -1: the "
     "only one with entries): {'columns': {name: (numpy type char, bytes)}, 'device', 'block_sizes', 'entries', "
     "'initial_allocations', 'unfinished_frees'}."},
    {"view_checkpoints", checkpoints, METH_VARARGS,
     "view_checkpoints(kind, id, size, group, groups, every) -> bytes\n\nint64 [n // every + 1, groups]: each "
     "group's live bytes before every every-th event."},
    {"view_groups_at", groups_at, METH_VARARGS,
     "view_groups_at(kind, id, size, group, groups, ckpt, every, at) -> bytes\n\nint64 [len(at), groups]: each "
     "group's live bytes just after each event of the sorted indices at."},
    {"view_group_peaks", group_peaks, METH_VARARGS,
     "view_group_peaks(kind, id, size, group, groups, ckpt, every, edges, track) -> bytes\n\nint64 [len(edges) - 1]: "
     "the most group track held after any event of each bucket [edges[b], edges[b + 1])."},
    {NULL, NULL, 0, NULL}};

int vk_view_init(PyObject *module) { return vk_add_methods(module, methods); }
