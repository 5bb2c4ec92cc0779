/* amp_spans.c — building, checking and handing over the spans of amp_spans.h. */
#include "amp_spans.h"

#include <string.h>

#define SPANS_CAPSULE "vramkit.amp_spans"

const size_t vk_itemsize[4] = {[VRAM_FLOAT32] = 4, [VRAM_FLOAT16] = 2, [VRAM_BFLOAT16] = 2, [VRAM_FLOAT64] = 8};

vk_spans_t *vk_spans_new(Py_ssize_t capacity) {
    vk_spans_t *s = PyMem_Calloc(1, sizeof(vk_spans_t));
    if (!s || !(s->items = PyMem_New(vram_tensor_t, (size_t)(capacity ? capacity : 1)))) {
        vk_spans_release(s);
        PyErr_NoMemory();
        return NULL;
    }
    s->capacity = capacity;
    return s;
}

void vk_spans_release(vk_spans_t *s) {
    if (!s) return;
    PyMem_Free(s->items);
    PyMem_Free(s->strided);
    PyMem_Free(s->dims);
    PyMem_Free(s);
}

int vk_spans_add_strided(vk_spans_t *s, void *ptr, vram_dtype_t dtype, int nd, const int64_t *dims) {
    if (!s->strided && !(s->strided = PyMem_New(vram_strided_tensor_t, (size_t)s->capacity))) goto nomem;
    if (s->dims_used + 2 * nd > s->dims_capacity) {
        /* (room for this many dimensions in each tensor still to come: one allocation for a
         * list of like tensors) */
        Py_ssize_t grown = 2 * s->dims_capacity + 2 * nd * (s->capacity - s->count - s->strided_count);
        int64_t *bigger = PyMem_Realloc(s->dims, (size_t)grown * sizeof(int64_t));
        if (!bigger) goto nomem;
        s->dims = bigger;
        s->dims_capacity = grown;
    }
    memcpy(s->dims + s->dims_used, dims, 2 * (size_t)nd * sizeof(int64_t));
    /* (the shape and strides pointers are set by vk_spans_finish: dims may move until then) */
    s->strided[s->strided_count++] = (vram_strided_tensor_t){ptr, dtype, nd, (const int64_t *)(intptr_t)s->dims_used,
                                                            NULL};
    s->dims_used += 2 * nd;
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

int vk_spans_layout_ok(const int64_t *dims, int nd) {
    for (int d = 0; d < nd; d++)
        if (dims[d] > 1 && dims[nd + d] <= 0) return 0;
    int order[VRAM_AMP_MAX_DIMS]; /* dimensions by stride (insertion sort: at most 64) */
    for (int d = 0; d < nd; d++) {
        int k = d;
        while (k > 0 && dims[nd + order[k - 1]] > dims[nd + d]) {
            order[k] = order[k - 1];
            k--;
        }
        order[k] = d;
    }
    int64_t reach = 0; /* the largest offset the dimensions so far address */
    for (int k = 0; k < nd; k++) {
        int d = order[k];
        if (dims[d] <= 1) continue;
        if (dims[nd + d] <= reach) return 0;
        reach += dims[nd + d] * (dims[d] - 1);
    }
    return 1;
}

typedef struct span_order {
    uintptr_t start, end;
} span_order_t;

/* Sort by start, bottom-up merge sort through `tmp` (qsort's comparator calls were a tenth of
 * the walk); returns the array that holds the result. */
static span_order_t *sort_by_start(span_order_t *a, span_order_t *tmp, Py_ssize_t n) {
    for (Py_ssize_t width = 1; width < n; width *= 2) {
        for (Py_ssize_t lo = 0; lo < n; lo += 2 * width) {
            Py_ssize_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            Py_ssize_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = a[j].start < a[i].start ? a[j++] : a[i++];
            while (i < mid) tmp[k++] = a[i++];
            while (j < hi) tmp[k++] = a[j++];
        }
        span_order_t *swap = a;
        a = tmp;
        tmp = swap;
    }
    return a;
}

/* The byte range [start, end) a strided tensor's elements lie in (strides are positive here). */
static span_order_t strided_range(const vram_strided_tensor_t *t) {
    uintptr_t high = 0;
    for (int32_t d = 0; d < t->ndim; d++) high += (uintptr_t)(t->strides[d] * (t->shape[d] - 1));
    uintptr_t start = (uintptr_t)t->data;
    return (span_order_t){start, start + (high + 1) * vk_itemsize[t->dtype]};
}

/* 1 if two tensors share a byte (an element would be unscaled twice), else 0; -1 out of memory.
 * A strided tensor counts as the whole range it spans, as the general walk counts it. */
static int any_overlap(const vk_spans_t *s) {
    Py_ssize_t total = s->count + s->strided_count;
    span_order_t *o = PyMem_New(span_order_t, 2 * (size_t)total + 1);
    if (!o) return -1;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < s->count; i++) {
        const vram_tensor_t *t = &s->items[i];
        if (t->numel <= 0) continue;
        uintptr_t start = (uintptr_t)t->data;
        o[n++] = (span_order_t){start, start + (uintptr_t)t->numel * vk_itemsize[t->dtype]};
    }
    for (Py_ssize_t i = 0; i < s->strided_count; i++) o[n++] = strided_range(&s->strided[i]);
    /* A model's gradients usually come in address order, ascending or (allocated during the
     * backward, last layer first) descending: then one pass decides, else sort. */
    int ascending = 1, descending = 1;
    for (Py_ssize_t i = 1; i < n && (ascending || descending); i++) {
        ascending = ascending && o[i].start >= o[i - 1].end;
        descending = descending && o[i].end <= o[i - 1].start;
    }
    if (ascending || descending) {
        PyMem_Free(o);
        return 0;
    }
    const span_order_t *sorted = sort_by_start(o, o + total, n);
    int overlap = 0;
    for (Py_ssize_t i = 1; i < n && !overlap; i++) overlap = sorted[i].start < sorted[i - 1].end;
    PyMem_Free(o);
    return overlap;
}

int vk_spans_finish(vk_spans_t *s) {
    for (Py_ssize_t i = 0; i < s->strided_count; i++) { /* dims stays where it is from here on */
        vram_strided_tensor_t *st = &s->strided[i];
        Py_ssize_t at = (Py_ssize_t)(intptr_t)st->shape;
        st->shape = s->dims + at;
        st->strides = s->dims + at + st->ndim;
    }
    int overlap = any_overlap(s);
    if (overlap == 0) return 1;
    vk_spans_release(s);
    if (overlap > 0) return 0;
    PyErr_NoMemory();
    return -1;
}

static void spans_free(PyObject *capsule) { vk_spans_release(PyCapsule_GetPointer(capsule, SPANS_CAPSULE)); }

PyObject *vk_spans_capsule(vk_spans_t *s) {
    PyObject *capsule = PyCapsule_New(s, SPANS_CAPSULE, spans_free);
    if (!capsule) vk_spans_release(s);
    return capsule;
}

/* The dense spans a capsule of spans holds, or NULL (no exception) if `obj` is not one;
 * *strided_count says how many strided tensors it holds besides (vk_amp_strided_spans). */
const vram_tensor_t *vk_amp_spans(PyObject *obj, Py_ssize_t *count, Py_ssize_t *strided_count) {
    if (!PyCapsule_IsValid(obj, SPANS_CAPSULE)) return NULL;
    vk_spans_t *s = PyCapsule_GetPointer(obj, SPANS_CAPSULE);
    *count = s->count;
    *strided_count = s->strided_count;
    return s->items;
}

const vram_strided_tensor_t *vk_amp_strided_spans(PyObject *obj, Py_ssize_t *count) {
    if (!PyCapsule_IsValid(obj, SPANS_CAPSULE)) return NULL;
    vk_spans_t *s = PyCapsule_GetPointer(obj, SPANS_CAPSULE);
    *count = s->strided_count;
    return s->strided;
}

int vk_spans_unscale(vk_spans_t *s, float inv_scale, float *found, double *sumsq) {
    vram_status_t st;
    Py_BEGIN_ALLOW_THREADS
    double strided_sumsq = 0.0;
    st = vram_amp_unscale_check(s->items, (size_t)s->count, inv_scale, found, sumsq);
    if (st == VRAM_OK && s->strided_count) {
        st = vram_amp_unscale_check_strided(s->strided, (size_t)s->strided_count, inv_scale, found,
                                            sumsq ? &strided_sumsq : NULL);
        if (sumsq) *sumsq += strided_sumsq;
    }
    Py_END_ALLOW_THREADS
    vk_spans_release(s);
    if (st == VRAM_OK) return 0;
    vk_raise(st);
    return -1;
}
