/* amp_spans.h — the loss-scaling kernels' spans, as the C walks over a list of arrays build
 * them (amp_torch.c for torch tensors, amp_numpy.c for NumPy arrays) and the kernel bindings
 * (amp.c) take them, in a capsule, in place of a Python tuple per tensor. */
#ifndef VRAMKIT_AMP_SPANS_H
#define VRAMKIT_AMP_SPANS_H

#include "module.h"

typedef struct vk_spans {
    Py_ssize_t count; /* dense tensors, in items */
    vram_tensor_t *items;
    Py_ssize_t strided_count; /* the rest (CPU only), with their shapes and strides in dims */
    vram_strided_tensor_t *strided;
    int64_t *dims;
    Py_ssize_t capacity;               /* items and strided hold this many */
    Py_ssize_t dims_used, dims_capacity; /* (while building: dims may move) */
} vk_spans_t;

/* Bytes per element, by vram_dtype_t. */
extern const size_t vk_itemsize[4];

/* Room for `capacity` tensors; NULL with MemoryError set. */
vk_spans_t *vk_spans_new(Py_ssize_t capacity);
void vk_spans_release(vk_spans_t *s);

static inline void vk_spans_add_dense(vk_spans_t *s, void *ptr, int64_t numel, vram_dtype_t dtype) {
    s->items[s->count++] = (vram_tensor_t){ptr, numel, dtype};
}

/* Append a strided tensor (dims: its shape, then its strides in elements; copied): 0, or -1
 * with MemoryError set. */
int vk_spans_add_strided(vk_spans_t *s, void *ptr, vram_dtype_t dtype, int nd, const int64_t *dims);

/* 1 when the kernels take a strided layout as it is: every stride positive under a dimension of
 * more than one element (an expanded tensor would be unscaled twice over, and the walks leave
 * negative strides to the general walk) and no two dimensions overlapping (sorted by stride,
 * each stride reaching past the elements the smaller ones address); else 0. */
int vk_spans_layout_ok(const int64_t *dims, int nd);

/* Done adding: 1 with s ready, 0 when two tensors share a byte (s released: the general walk
 * decides and raises), -1 out of memory (s released, exception set). */
int vk_spans_finish(vk_spans_t *s);

/* A capsule that owns s (released with it); NULL with an exception, s released. */
PyObject *vk_spans_capsule(vk_spans_t *s);

/* The CPU unscale of the spans, dense then strided (the strided layouts were checked while
 * walking, so they are not refused once the dense ones are written), run without the GIL; s
 * is released. *found is set to 1 when an inf/NaN is met (never reset); *sumsq, when not
 * NULL, is the sum of squares of the results. 0, or -1 with the kernel's error raised. */
int vk_spans_unscale(vk_spans_t *s, float inv_scale, float *found, double *sumsq);

#endif
