/* columns.c — NumPy columns (any object with the buffer protocol) checked for dtype, dimensions,
 * contiguity and writability before C reads them, naming the argument in the error. */
#include "columns.h"

#include <string.h>

/* What a column must hold: its name in messages, the PEP 3118 format characters accepted
 * (NumPy writes int64 as 'l' on LP64 Linux, and 'q' is the same type), and the item size. */

const column_kind_t VK_UINT8 = {"uint8", "B", 1};
const column_kind_t VK_INT8 = {"int8", "b", 1};
const column_kind_t VK_UINT32 = {"uint32", "I", 4};
const column_kind_t VK_INT32 = {"int32", "i", 4};
const column_kind_t VK_INT64 = {"int64", "lq", 8};
const column_kind_t VK_UINT64 = {"uint64", "LQ", 8};


void vk_release_columns(column_t *cols, int count) {
    for (int i = 0; i < count; i++)
        if (cols[i].held) {
            PyBuffer_Release(&cols[i].view);
            cols[i].held = 0;
        }
}

/* The format without a byte-order prefix that means this machine's order ('@', '=', and '<' on
 * a little-endian machine), or NULL for a foreign byte order. */
static const char *native_format(const char *format) {
    if (!format) return "B"; /* PEP 3118: no format means unsigned bytes */
    if (*format == '@' || *format == '=') return format + 1;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (*format == '<') return format + 1;
#else
    if (*format == '>' || *format == '!') return format + 1;
#endif
    if (*format == '<' || *format == '>' || *format == '!') return NULL;
    return format;
}

int vk_get_column(PyObject *obj, const char *name, const column_kind_t *kind, int optional, int writable,
                      column_t *col) {
    col->held = 0;
    col->len = 0;
    if (obj == Py_None && optional) return 0;
    const char *none_ok = optional ? " or None" : "";
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D C-contiguous %s NumPy array%s, got %.80s", name, kind->dtype,
                     none_ok, Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (PyObject_GetBuffer(obj, &col->view, PyBUF_RECORDS_RO) != 0) return -1;
    col->held = 1;
    const char *format = native_format(col->view.format);
    if (!format || strlen(format) != 1 || !strchr(kind->formats, *format) || col->view.itemsize != kind->itemsize) {
        PyErr_Format(PyExc_TypeError, "%s must be an array of %s (native byte order)%s; got buffer format '%s' with "
                     "%zd-byte items", name, kind->dtype, none_ok, col->view.format ? col->view.format : "B",
                     col->view.itemsize);
        goto fail;
    }
    if (col->view.ndim != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be one-dimensional; got %d dimensions", name, col->view.ndim);
        goto fail;
    }
    if (!PyBuffer_IsContiguous(&col->view, 'C')) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous (use np.ascontiguousarray)", name);
        goto fail;
    }
    if (writable && col->view.readonly) {
        PyErr_Format(PyExc_ValueError, "%s must be writable; got a read-only buffer", name);
        goto fail;
    }
    if ((uintptr_t)col->view.buf % (uintptr_t)kind->itemsize) { /* C reads whole items */
        PyErr_Format(PyExc_ValueError, "%s must be aligned to its %zd-byte items (a view at an odd offset; copy it "
                     "with np.ascontiguousarray(..., copy=True))", name, kind->itemsize);
        goto fail;
    }
    col->len = col->view.shape[0];
    return 0;
fail:
    vk_release_columns(col, 1);
    return -1;
}

