/* amp_strided.c — the CPU loss-scaling kernels for tensors that are not dense (x[:, ::2], a
 * slice of a wider buffer). PyTorch unscales such gradients in place, so copying them into a
 * dense buffer and back from Python would not do: the caller's tensor must change.
 *
 * Each tensor is first brought to a canonical layout (size-1 dimensions dropped, negative
 * strides flipped, dimensions sorted by stride and merged where they are contiguous), then
 * walked row by row along its smallest stride. A row with unit stride goes straight to the
 * SIMD span function of the dense path; any other row is gathered into a small buffer, run
 * through the same span function and scattered back. Either way every element meets exactly
 * the arithmetic of the dense kernels, so results agree bit for bit. Work items are pieces of
 * at most VRAM_AMP_CHUNK elements in canonical order, handed to the same thread pool. */
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"
#include "../util/parallel.h"
#include "amp_internal.h"

typedef struct layout {
    char *data;   /* element (0, ..., 0) after flipping negative strides */
    size_t esize; /* bytes per element */
    int nd;       /* dimensions left after canonicalising; dim 0 has the smallest stride */
    int64_t shape[VRAM_AMP_MAX_DIMS];
    int64_t stride[VRAM_AMP_MAX_DIMS]; /* elements, > 0 */
    int64_t numel;
} layout_t;

/* Canonicalise tensor `i` into *out, or fail naming what is wrong with it. */
static vram_status_t make_layout(const vram_strided_tensor_t *t, size_t i, layout_t *out) {
    size_t esize = vram_dtype_size(t->dtype);
    if (esize == 0)
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "tensor %zu: unknown dtype %d (allowed: float32, float16, bfloat16, float64)", i,
                          (int)t->dtype);
    if (t->ndim < 0 || t->ndim > VRAM_AMP_MAX_DIMS)
        return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: ndim %d is out of range (allowed: 0 to %d)", i,
                          (int)t->ndim, VRAM_AMP_MAX_DIMS);
    if (t->ndim > 0 && (!t->shape || !t->strides))
        return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: shape or strides is NULL but ndim is %d", i,
                          (int)t->ndim);
    out->esize = esize;
    out->nd = 0;
    out->numel = 1;
    char *data = (char *)t->data;
    for (int k = 0; k < t->ndim; k++) {
        int64_t n = t->shape[k];
        if (n < 0) return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: negative size %lld in dimension %d", i,
                                     (long long)n, k);
        if (n == 0) {
            out->numel = 0;
            out->nd = 0;
            out->data = data;
            return VRAM_OK; /* nothing to touch; strides do not matter */
        }
        if (__builtin_mul_overflow(out->numel, n, &out->numel) || (uint64_t)out->numel >= VRAM_MAX_REQUEST / esize)
            return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: its shape holds an absurd number of elements", i);
    }
    if (!data) return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: data is NULL", i);
    for (int k = 0; k < t->ndim; k++) {
        int64_t n = t->shape[k], s = t->strides[k];
        if (n == 1) continue; /* a size-1 dimension's stride is never used */
        if (s < 0) {
            /* The set of elements is what matters, not their order: walk the dimension forwards. */
            data += (n - 1) * s * (int64_t)esize;
            s = -s;
        }
        if (s > (int64_t)(VRAM_MAX_REQUEST / esize) / n)
            return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: stride %lld in dimension %d reaches absurdly far", i,
                              (long long)t->strides[k], k);
        /* Insertion sort by stride: at most 64 dimensions. */
        int j = out->nd++;
        while (j > 0 && out->stride[j - 1] > s) {
            out->stride[j] = out->stride[j - 1];
            out->shape[j] = out->shape[j - 1];
            j--;
        }
        out->stride[j] = s;
        out->shape[j] = n;
    }
    if ((uintptr_t)data % esize)
        return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: data %p is not aligned to its %zu-byte elements", i,
                          (void *)data, esize);
    /* Each dimension must step past everything the smaller ones reach, or two indices could name
     * one element and it would be unscaled twice. (This refuses a few exotic layouts that do
     * not overlap, such as interleaved strides; PyTorch's own overlap test is also partial.) */
    int64_t reach = 1;
    for (int k = 0; k < out->nd; k++) {
        if (out->stride[k] < reach)
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "tensor %zu: elements overlap in memory (a stride-0 or expanded view, sizes and "
                              "strides do not give every index its own element); an in-place unscale would update "
                              "them more than once: pass a tensor whose elements are distinct, e.g. a clone()", i);
        reach += out->stride[k] * (out->shape[k] - 1);
    }
    /* Merge a dimension into the one below when it continues it exactly. */
    int m = 0;
    for (int k = 1; k < out->nd; k++) {
        if (out->stride[k] == out->stride[m] * out->shape[m]) {
            out->shape[m] *= out->shape[k];
        } else {
            m++;
            out->shape[m] = out->shape[k];
            out->stride[m] = out->stride[k];
        }
    }
    if (out->nd > 0) out->nd = m + 1;
    out->data = data;
    return VRAM_OK;
}

typedef struct item {
    size_t tensor;
    int64_t start, length; /* in canonical element order */
} item_t;

typedef struct pass {
    const layout_t *layouts;
    const item_t *items;
    vram__amp_span_fn const *span; /* the current path's table, indexed by dtype */
    const vram_strided_tensor_t *tensors;
    float factor;
    int write;
    double *partials; /* one per item, or NULL */
    int found;        /* atomic */
} pass_t;

/* Gathered rows go through a buffer of one tile, so the dense path's tiling applies to it. */
typedef union tile {
    double f64[VRAM_AMP_TILE];
    uint32_t u32[VRAM_AMP_TILE];
    uint16_t u16[VRAM_AMP_TILE];
} tile_t;

static void gather(tile_t *buf, const char *p, int64_t n, int64_t step, size_t esize) {
    switch (esize) {
    case 8: for (int64_t j = 0; j < n; j++) memcpy(&buf->f64[j], p + j * step, 8); break;
    case 4: for (int64_t j = 0; j < n; j++) memcpy(&buf->u32[j], p + j * step, 4); break;
    default: for (int64_t j = 0; j < n; j++) memcpy(&buf->u16[j], p + j * step, 2); break;
    }
}

static void scatter(const tile_t *buf, char *p, int64_t n, int64_t step, size_t esize) {
    switch (esize) {
    case 8: for (int64_t j = 0; j < n; j++) memcpy(p + j * step, &buf->f64[j], 8); break;
    case 4: for (int64_t j = 0; j < n; j++) memcpy(p + j * step, &buf->u32[j], 4); break;
    default: for (int64_t j = 0; j < n; j++) memcpy(p + j * step, &buf->u16[j], 2); break;
    }
}

/* `n` elements of one row from `p`, `stride` elements apart. */
static int run_row(const pass_t *p, vram__amp_span_fn span, char *row, int64_t n, int64_t stride, size_t esize,
                   double *slot) {
    if (stride == 1) return span(row, n, p->factor, p->write, slot);
    tile_t buf;
    int bad = 0;
    const int64_t step = stride * (int64_t)esize;
    for (int64_t j = 0; j < n; j += VRAM_AMP_TILE) {
        int64_t m = n - j < VRAM_AMP_TILE ? n - j : VRAM_AMP_TILE;
        char *at = row + j * step;
        gather(&buf, at, m, step, esize);
        bad |= span(&buf, m, p->factor, p->write, slot);
        if (p->write) scatter(&buf, at, m, step, esize);
    }
    return bad;
}

static void run_item(void *ctx, size_t i) {
    pass_t *p = (pass_t *)ctx;
    const item_t *it = &p->items[i];
    const layout_t *L = &p->layouts[it->tensor];
    vram__amp_span_fn span = p->span[p->tensors[it->tensor].dtype];
    double *slot = p->partials ? &p->partials[i] : NULL;
    if (slot) *slot = 0.0;
    const int64_t inner = L->nd ? L->shape[0] : 1, inner_stride = L->nd ? L->stride[0] : 1;
    /* Decode the first element's (row index per outer dimension, column), then walk rows with
     * an odometer so each further row costs a few additions. */
    int64_t idx[VRAM_AMP_MAX_DIMS];
    int64_t row = it->start / inner, col = it->start % inner, offset = 0;
    for (int k = 1; k < L->nd; k++) {
        idx[k] = row % L->shape[k];
        row /= L->shape[k];
        offset += idx[k] * L->stride[k];
    }
    int bad = 0;
    for (int64_t left = it->length; left > 0;) {
        int64_t n = inner - col < left ? inner - col : left;
        char *at = L->data + (offset + col * inner_stride) * (int64_t)L->esize;
        bad |= run_row(p, span, at, n, inner_stride, L->esize, slot);
        left -= n;
        col = 0;
        for (int k = 1; k < L->nd; k++) { /* next row */
            offset += L->stride[k];
            if (++idx[k] < L->shape[k]) break;
            offset -= idx[k] * L->stride[k];
            idx[k] = 0;
        }
    }
    if (bad) __atomic_store_n(&p->found, 1, __ATOMIC_RELAXED);
}

static vram_status_t strided_pass(const vram_strided_tensor_t *tensors, size_t count, float factor, int write,
                                  int *found, double *sumsq) {
    if (count > 0 && !tensors) return vram__fail(VRAM_ERR_INVALID_ARG, "tensors is NULL but count is %zu", count);
    if (sumsq) *sumsq = 0.0;
    if (count == 0) return VRAM_OK;
    layout_t *layouts = (layout_t *)malloc(count * sizeof *layouts);
    if (!layouts) return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for %zu tensor layouts", count);
    vram_status_t st = VRAM_OK;
    size_t n_items = 0;
    int64_t total = 0;
    for (size_t i = 0; i < count && st == VRAM_OK; i++) {
        st = make_layout(&tensors[i], i, &layouts[i]);
        if (st == VRAM_OK) {
            n_items += (size_t)((layouts[i].numel + VRAM_AMP_CHUNK - 1) / VRAM_AMP_CHUNK);
            total += layouts[i].numel;
        }
    }
    item_t *items = NULL;
    double *partials = NULL;
    if (st != VRAM_OK || n_items == 0) goto done;
    /* Validated before anything is written, so a bad list changes nothing. With factor 1 and
     * no check wanted (scale_inplace), there is nothing else to do. */
    if (!write && !found) goto done;
    items = (item_t *)malloc(n_items * sizeof *items);
    partials = sumsq ? (double *)malloc(n_items * sizeof *partials) : NULL;
    if (!items || (sumsq && !partials)) {
        st = vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for a work list of %zu items", n_items);
        goto done;
    }
    size_t k = 0;
    for (size_t i = 0; i < count; i++)
        for (int64_t s = 0; s < layouts[i].numel; s += VRAM_AMP_CHUNK) {
            int64_t left = layouts[i].numel - s;
            items[k++] = (item_t){i, s, left < VRAM_AMP_CHUNK ? left : VRAM_AMP_CHUNK};
        }
    pass_t pass = {layouts, items, vram__amp_current_path()->span, tensors, factor, write, partials, 0};
    vram__parallel_for(n_items, run_item, &pass, total >= VRAM_AMP_PARALLEL_MIN ? vram_get_num_threads() : 1);
    if (sumsq) {
        double sum = 0.0;
        for (size_t j = 0; j < n_items; j++) sum += partials[j];
        *sumsq = sum;
    }
    if (found) *found = pass.found;
done:
    free(items);
    free(partials);
    free(layouts);
    return st;
}

vram_status_t vram_amp_unscale_check_strided(const vram_strided_tensor_t *tensors, size_t count, float inv_scale,
                                             float *found_inf, double *sumsq) {
    if (!found_inf) return vram__fail(VRAM_ERR_INVALID_ARG, "found_inf is NULL");
    int found = 0;
    /* As in the dense path: a factor of exactly 1 changes no value, so only check. */
    vram_status_t st = strided_pass(tensors, count, inv_scale, inv_scale != 1.0f, &found, sumsq);
    if (st == VRAM_OK && found) *found_inf = 1.0f;
    return st;
}

vram_status_t vram_amp_scale_inplace_strided(const vram_strided_tensor_t *tensors, size_t count, float factor) {
    return strided_pass(tensors, count, factor, factor != 1.0f, NULL, NULL);
}
