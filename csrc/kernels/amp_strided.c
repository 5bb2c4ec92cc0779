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
    /* The most elements (and the farthest reach, in elements) a request may span: compared by
     * multiplication below, not division, which was most of this function's time. */
    const uint64_t limit = VRAM_MAX_REQUEST >> __builtin_ctzll(esize); /* (esize is 2, 4 or 8) */
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
        if (__builtin_mul_overflow(out->numel, n, &out->numel) || (uint64_t)out->numel >= limit)
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
        int64_t span;
        if (__builtin_mul_overflow(s, n, &span) || (uint64_t)span > limit)
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

/* A canonical layout of at most COMPACT_DIMS dimensions (nearly every gradient, once merged)
 * kept per tensor between the check and the run, so that it is worked out once a call; a
 * whole layout_t is a kilobyte, and thousands of them would page in megabytes every call. */
#define COMPACT_DIMS 4
typedef struct compact {
    char *data;
    int nd; /* -1: more dimensions than fit here; run_item works the layout out again */
    int64_t shape[COMPACT_DIMS], stride[COMPACT_DIMS];
} compact_t;

static void compact_from(const layout_t *L, compact_t *c) {
    c->data = L->data;
    c->nd = L->nd <= COMPACT_DIMS ? L->nd : -1;
    for (int k = 0; k < L->nd && k < COMPACT_DIMS; k++) {
        c->shape[k] = L->shape[k];
        c->stride[k] = L->stride[k];
    }
}

typedef struct item {
    size_t tensor;
    int64_t start, length; /* in canonical element order */
} item_t;

typedef struct pass {
    const item_t *items;
    size_t n_items;
    const compact_t *compacts; /* one per tensor */
    vram__amp_span_fn const *span; /* the current path's table, indexed by dtype */
    const vram_strided_tensor_t *tensors;
    float factor;
    int write;
    double *partials; /* one per item, or NULL */
    int found;        /* atomic */
} pass_t;

/* Elements go through a buffer of one tile, so the dense path's tiling applies to them. */
typedef union tile {
    double f64[VRAM_AMP_TILE];
    uint32_t u32[VRAM_AMP_TILE];
    uint16_t u16[VRAM_AMP_TILE];
    uint64_t u64[VRAM_AMP_TILE];
} tile_t;

/* A position in canonical order: the column in the innermost row, the row's element offset,
 * and the row's index per outer dimension (an odometer: each further row costs a few adds). */
typedef struct cursor {
    int64_t col, offset;
    int64_t idx[VRAM_AMP_MAX_DIMS];
} cursor_t;

static void cursor_at(const layout_t *L, int64_t start, cursor_t *c) {
    if (start == 0) { /* (every small tensor: no divisions) */
        c->col = c->offset = 0;
        for (int k = 1; k < L->nd; k++) c->idx[k] = 0;
        return;
    }
    const int64_t inner = L->nd ? L->shape[0] : 1;
    int64_t row = start / inner;
    c->col = start % inner;
    c->offset = 0;
    for (int k = 1; k < L->nd; k++) {
        c->idx[k] = row % L->shape[k];
        row /= L->shape[k];
        c->offset += c->idx[k] * L->stride[k];
    }
}

/* *to = *from, copying only the indices in use (the whole struct is half a kilobyte). */
static void cursor_copy(const layout_t *L, cursor_t *to, const cursor_t *from) {
    to->col = from->col;
    to->offset = from->offset;
    for (int k = 1; k < L->nd; k++) to->idx[k] = from->idx[k];
}

static void next_row(const layout_t *L, cursor_t *c) {
    c->col = 0;
    for (int k = 1; k < L->nd; k++) {
        c->offset += L->stride[k];
        if (++c->idx[k] < L->shape[k]) return;
        c->offset -= c->idx[k] * L->stride[k];
        c->idx[k] = 0;
    }
}

/* Copy the `m` elements from the cursor on between the tensor and buf (into buf when
 * `gather`, else back out of it), across as many rows as they span; the cursor moves past them.
 * One copy per element size, so the row loops hold no switch: on a list of small gradients
 * each row is a handful of elements, and the per-row work is what this costs. */
#define VRAM__MOVE_TILE(NAME, T)                                                                       \
    static void NAME(const layout_t *L, cursor_t *c, T *buf, int64_t m, int gather) {                 \
        const int64_t inner = L->nd ? L->shape[0] : 1, step = L->nd ? L->stride[0] : 1;               \
        T *const base = (T *)(void *)L->data;                                                          \
        for (int64_t done = 0; done < m;) {                                                            \
            int64_t n = inner - c->col < m - done ? inner - c->col : m - done;                         \
            T *at = base + c->offset + c->col * step, *b = buf + done;                                 \
            if (gather) {                                                                              \
                for (int64_t j = 0; j < n; j++) b[j] = at[j * step];                                   \
            } else {                                                                                   \
                for (int64_t j = 0; j < n; j++) at[j * step] = b[j];                                   \
            }                                                                                          \
            done += n;                                                                                 \
            c->col += n;                                                                               \
            if (c->col < inner) continue;                                                              \
            if (L->nd == 2) { /* the common case: one outer dimension, no carry to propagate */         \
                c->col = 0;                                                                            \
                c->offset += L->stride[1];                                                             \
            } else {                                                                                   \
                next_row(L, c);                                                                        \
            }                                                                                          \
        }                                                                                              \
    }
VRAM__MOVE_TILE(move_tile16, uint16_t)
VRAM__MOVE_TILE(move_tile32, uint32_t)
VRAM__MOVE_TILE(move_tile64, uint64_t)

static void move_tile(const layout_t *L, cursor_t *c, tile_t *buf, int64_t m, int gather) {
    switch (L->esize) {
    case 8: move_tile64(L, c, buf->u64, m, gather); break;
    case 4: move_tile32(L, c, buf->u32, m, gather); break;
    default: move_tile16(L, c, buf->u16, m, gather); break;
    }
}

/* Ask for the first bytes of a later item's elements now, so that their cache misses overlap
 * this item's work: on a list of thousands of small gradients written a while ago, waiting
 * for memory is most of the kernel's time. */
static void prefetch_item(const pass_t *p, size_t i) {
    const item_t *it = &p->items[i];
    const compact_t *cl = &p->compacts[it->tensor];
    if (it->start != 0 || cl->nd < 0) return; /* (a large tensor's later pieces stream by themselves) */
    int64_t reach = 1;
    for (int k = 0; k < cl->nd; k++) reach += cl->stride[k] * (cl->shape[k] - 1);
    int64_t bytes = reach * (int64_t)vram_dtype_size(p->tensors[it->tensor].dtype);
    for (int64_t b = 0; b < bytes && b < VRAM_AMP_PREFETCH_BYTES; b += 64) __builtin_prefetch(cl->data + b, 0, 3);
}

static void run_item(void *ctx, size_t i) {
    pass_t *p = (pass_t *)ctx;
    const item_t *it = &p->items[i];
    if (i + VRAM_AMP_PREFETCH_AHEAD < p->n_items) prefetch_item(p, i + VRAM_AMP_PREFETCH_AHEAD);
    const compact_t *cl = &p->compacts[it->tensor];
    layout_t L;
    if (cl->nd < 0) {
        (void)make_layout(&p->tensors[it->tensor], it->tensor, &L); /* (checked before any item ran) */
    } else {
        L.data = cl->data;
        L.esize = vram_dtype_size(p->tensors[it->tensor].dtype);
        L.nd = cl->nd;
        for (int k = 0; k < cl->nd; k++) {
            L.shape[k] = cl->shape[k];
            L.stride[k] = cl->stride[k];
        }
    }
    vram__amp_span_fn span = p->span[p->tensors[it->tensor].dtype];
    double *slot = p->partials ? &p->partials[i] : NULL;
    if (slot) *slot = 0.0;
    const int64_t inner = L.nd ? L.shape[0] : 1, inner_stride = L.nd ? L.stride[0] : 1;
    cursor_t c;
    cursor_at(&L, it->start, &c);
    int bad = 0;
    if (inner_stride == 1 && inner % VRAM_AMP_TILE == 0) {
        /* Rows of whole tiles (a slice of full rows of a wider matrix): run them in place. Items
         * start at multiples of VRAM_AMP_CHUNK, so each row here starts on a tile boundary. */
        for (int64_t left = it->length; left > 0;) {
            int64_t n = inner - c.col < left ? inner - c.col : left;
            bad |= span(L.data + (c.offset + c.col) * (int64_t)L.esize, n, p->factor, p->write, slot);
            left -= n;
            next_row(&L, &c);
        }
    } else {
        /* Short or strided rows: gather whole tiles across rows, so a tensor of many short rows
         * costs one span call per tile rather than one per row, then scatter them back. */
        tile_t buf;
        for (int64_t left = it->length; left > 0;) {
            int64_t m = left < VRAM_AMP_TILE ? left : VRAM_AMP_TILE;
            cursor_t from;
            cursor_copy(&L, &from, &c);
            move_tile(&L, &c, &buf, m, 1);
            bad |= span(&buf, m, p->factor, p->write, slot);
            if (p->write) move_tile(&L, &from, &buf, m, 0);
            left -= m;
        }
    }
    if (bad) __atomic_store_n(&p->found, 1, __ATOMIC_RELAXED);
}

static vram_status_t strided_pass(const vram_strided_tensor_t *tensors, size_t count, float factor, int write,
                                  int *found, double *sumsq) {
    if (count > 0 && !tensors) return vram__fail(VRAM_ERR_INVALID_ARG, "tensors is NULL but count is %zu", count);
    if (sumsq) *sumsq = 0.0;
    if (count == 0) return VRAM_OK;
    compact_t *compacts = (compact_t *)malloc(count * sizeof *compacts);
    if (!compacts) return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for %zu tensor layouts", count);
    /* Every layout is checked before anything is written, so a bad list changes nothing. */
    vram_status_t st = VRAM_OK;
    size_t n_items = 0;
    int64_t total = 0;
    item_t *items = NULL;
    double *partials = NULL;
    for (size_t i = 0; i < count && st == VRAM_OK; i++) {
        layout_t L;
        st = make_layout(&tensors[i], i, &L);
        if (st != VRAM_OK) break;
        compact_from(&L, &compacts[i]);
        n_items += (size_t)((L.numel + VRAM_AMP_CHUNK - 1) / VRAM_AMP_CHUNK);
        total += L.numel;
    }
    /* With factor 1 and no check wanted (scale_inplace), there is nothing else to do. */
    if (st != VRAM_OK || n_items == 0 || (!write && !found)) goto done;
    items = (item_t *)malloc(n_items * sizeof *items);
    partials = sumsq ? (double *)malloc(n_items * sizeof *partials) : NULL;
    if (!items || (sumsq && !partials)) {
        st = vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for a work list of %zu items", n_items);
        goto done;
    }
    size_t k = 0;
    for (size_t i = 0; i < count; i++) {
        int64_t numel = 1;
        for (int d = 0; d < tensors[i].ndim; d++) numel *= tensors[i].shape[d]; /* (bounded by make_layout) */
        for (int64_t s = 0; s < numel; s += VRAM_AMP_CHUNK) {
            int64_t left = numel - s;
            items[k++] = (item_t){i, s, left < VRAM_AMP_CHUNK ? left : VRAM_AMP_CHUNK};
        }
    }
    pass_t pass = {items, n_items, compacts, vram__amp_current_path()->span, tensors, factor, write, partials, 0};
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
    free(compacts);
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
