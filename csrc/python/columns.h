/* columns.h — 1-D C-contiguous columns for the bindings that hand NumPy arrays to C loops. */
#ifndef VK_PYTHON_COLUMNS_H
#define VK_PYTHON_COLUMNS_H

#include "module.h"

typedef struct column_kind {
    const char *dtype;
    const char *formats;
    Py_ssize_t itemsize;
} column_kind_t;

extern const column_kind_t VK_UINT8, VK_INT8, VK_UINT32, VK_INT32, VK_INT64, VK_UINT64;

typedef struct column {
    Py_buffer view;
    int held;
    Py_ssize_t len;
} column_t;

/* Fill *col from obj: a TypeError/ValueError naming `name` (and -1) unless it is a 1-D
 * C-contiguous buffer of `kind` (None allowed when optional: col->held stays 0), writable
 * when asked. */
int vk_get_column(PyObject *obj, const char *name, const column_kind_t *kind, int optional, int writable,
                  column_t *col);
void vk_release_columns(column_t *cols, int count);

#endif
