/* amp_cpu.c — the CPU entry points of the loss-scaling kernels: argument checks, the choice
 * of SIMD path, and splitting a tensor list into work items for the thread pool.
 *
 * Work items are (tensor, start, length) pieces of at most VRAM_AMP_CHUNK elements. Each
 * item's sum of squares goes to its own slot and the slots are added in list order at the
 * end, so the result is the same for any thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"
#include "../util/parallel.h"
#include "amp_internal.h"

/* Lists with at most this many items keep their item table on the stack. */
#define STACK_ITEMS 64

static const vram__amp_path_t *const all_paths[] = {&vram__amp_avx512, &vram__amp_avx2, &vram__amp_portable};
static const vram__amp_path_t *active_path; /* atomic */
static int num_threads;                     /* atomic; 0 until first use */

size_t vram_dtype_size(vram_dtype_t dtype) {
    switch (dtype) {
    case VRAM_FLOAT32: return 4;
    case VRAM_FLOAT16: return 2;
    case VRAM_BFLOAT16: return 2;
    case VRAM_FLOAT64: return 8;
    }
    return 0;
}

vram_status_t vram__amp_check_list(const vram_tensor_t *tensors, size_t count) {
    if (count > 0 && !tensors) return vram__fail(VRAM_ERR_INVALID_ARG, "tensors is NULL but count is %zu", count);
    for (size_t i = 0; i < count; i++) {
        const vram_tensor_t *t = &tensors[i];
        size_t size = vram_dtype_size(t->dtype);
        if (size == 0)
            return vram__fail(VRAM_ERR_INVALID_ARG,
                              "tensor %zu: unknown dtype %d (allowed: float32, float16, bfloat16, float64)", i,
                              (int)t->dtype);
        if (t->numel < 0) return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: negative numel %lld", i, (long long)t->numel);
        if (t->numel == 0) continue;
        if ((uint64_t)t->numel >= VRAM_MAX_REQUEST / size)
            return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: numel %lld is absurdly large", i, (long long)t->numel);
        if (!t->data) return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: data is NULL", i);
        if ((uintptr_t)t->data % size)
            return vram__fail(VRAM_ERR_INVALID_ARG, "tensor %zu: data %p is not aligned to its %zu-byte elements", i,
                              t->data, size);
    }
    return VRAM_OK;
}

/* ---- SIMD path --------------------------------------------------------------------------- */

static const vram__amp_path_t *find_path(const char *name) {
    for (size_t i = 0; i < sizeof all_paths / sizeof *all_paths; i++)
        if (strcmp(all_paths[i]->name, name) == 0) return all_paths[i];
    return NULL;
}

static const vram__amp_path_t *best_path(void) {
    for (size_t i = 0; i < sizeof all_paths / sizeof *all_paths; i++)
        if (all_paths[i]->supported()) return all_paths[i];
    return &vram__amp_portable;
}

const vram__amp_path_t *vram__amp_current_path(void) {
    const vram__amp_path_t *p = __atomic_load_n(&active_path, __ATOMIC_ACQUIRE);
    if (p) return p;
    /* First use: VRAMKIT_SIMD, if it names a supported path, else the best one. Racing first
     * callers compute the same answer, so a plain store is enough. */
    const char *env = getenv("VRAMKIT_SIMD");
    p = env && *env ? find_path(env) : NULL;
    if (!p || !p->supported()) p = best_path();
    __atomic_store_n(&active_path, p, __ATOMIC_RELEASE);
    return p;
}

const char *vram_simd_path(void) { return vram__amp_current_path()->name; }

int vram_simd_supported(const char *path) {
    const vram__amp_path_t *p = path ? find_path(path) : NULL;
    return p && p->supported();
}

vram_status_t vram_set_simd_path(const char *path) {
    if (!path) return vram__fail(VRAM_ERR_INVALID_ARG, "SIMD path is NULL (allowed: auto, avx512, avx2, portable)");
    const vram__amp_path_t *p = strcmp(path, "auto") == 0 ? best_path() : find_path(path);
    if (!p)
        return vram__fail(VRAM_ERR_INVALID_ARG, "unknown SIMD path '%s' (allowed: auto, avx512, avx2, portable)", path);
    if (!p->supported()) return vram__fail(VRAM_ERR_UNAVAILABLE, "this CPU cannot run the %s path", path);
    __atomic_store_n(&active_path, p, __ATOMIC_RELEASE);
    return VRAM_OK;
}

/* ---- threads ----------------------------------------------------------------------------- */

int vram_get_num_threads(void) {
    int n = __atomic_load_n(&num_threads, __ATOMIC_RELAXED);
    if (n == 0) {
        n = vram__default_threads();
        __atomic_store_n(&num_threads, n, __ATOMIC_RELAXED);
    }
    return n;
}

vram_status_t vram_set_num_threads(int threads) {
    if (threads < 1 || threads > 1024)
        return vram__fail(VRAM_ERR_INVALID_ARG, "num_threads must be between 1 and 1024, got %d", threads);
    __atomic_store_n(&num_threads, threads, __ATOMIC_RELAXED);
    return VRAM_OK;
}

/* ---- the pass ---------------------------------------------------------------------------- */

typedef struct item {
    uint32_t tensor;
    int64_t start, length;
} item_t;

typedef struct pass {
    const vram_tensor_t *tensors;
    const item_t *items;
    size_t n_items;
    const vram__amp_path_t *path;
    float factor;
    int write;
    double *partials; /* one per item, or NULL when no sum is wanted */
    int found;        /* atomic */
} pass_t;

/* The first bytes of a later small tensor's elements, asked for now so that their cache
 * misses overlap this item's work (a large tensor's pieces stream by themselves). */
static void prefetch_item(const pass_t *p, size_t i) {
    const item_t *it = &p->items[i];
    const vram_tensor_t *t = &p->tensors[it->tensor];
    if (it->start != 0) return;
    int64_t bytes = it->length * (int64_t)vram_dtype_size(t->dtype);
    for (int64_t b = 0; b < bytes && b < VRAM_AMP_PREFETCH_BYTES; b += 64) __builtin_prefetch((char *)t->data + b, 0, 3);
}

static void run_item(void *ctx, size_t i) {
    pass_t *p = (pass_t *)ctx;
    const item_t *it = &p->items[i];
    if (i + VRAM_AMP_PREFETCH_AHEAD < p->n_items) prefetch_item(p, i + VRAM_AMP_PREFETCH_AHEAD);
    const vram_tensor_t *t = &p->tensors[it->tensor];
    char *base = (char *)t->data + (size_t)it->start * vram_dtype_size(t->dtype);
    double *slot = p->partials ? &p->partials[i] : NULL;
    if (slot) *slot = 0.0;
    if (p->path->span[t->dtype](base, it->length, p->factor, p->write, slot))
        __atomic_store_n(&p->found, 1, __ATOMIC_RELAXED);
}

static vram_status_t run_pass(const vram_tensor_t *tensors, size_t count, float factor, int write, int *found,
                              double *sumsq) {
    vram_status_t st = vram__amp_check_list(tensors, count);
    if (st != VRAM_OK) return st;
    if (count > UINT32_MAX) return vram__fail(VRAM_ERR_INVALID_ARG, "too many tensors (%zu)", count);

    size_t n_items = 0;
    int64_t total = 0;
    for (size_t i = 0; i < count; i++) {
        n_items += (size_t)((tensors[i].numel + VRAM_AMP_CHUNK - 1) / VRAM_AMP_CHUNK);
        total += tensors[i].numel;
    }
    item_t stack_items[STACK_ITEMS];
    double stack_partials[STACK_ITEMS];
    item_t *items = stack_items;
    double *partials = sumsq ? stack_partials : NULL;
    if (n_items > STACK_ITEMS) {
        items = (item_t *)malloc(n_items * sizeof *items);
        partials = sumsq ? (double *)malloc(n_items * sizeof *partials) : NULL;
        if (!items || (sumsq && !partials)) {
            free(items);
            free(partials);
            return vram__fail(VRAM_ERR_HOST_MEMORY, "no host memory for a work list of %zu items", n_items);
        }
    }
    size_t k = 0;
    for (size_t i = 0; i < count; i++)
        for (int64_t s = 0; s < tensors[i].numel; s += VRAM_AMP_CHUNK) {
            int64_t left = tensors[i].numel - s;
            items[k++] = (item_t){(uint32_t)i, s, left < VRAM_AMP_CHUNK ? left : VRAM_AMP_CHUNK};
        }

    pass_t pass = {tensors, items, n_items, vram__amp_current_path(), factor, write, partials, 0};
    int threads = total >= VRAM_AMP_PARALLEL_MIN ? vram_get_num_threads() : 1;
    vram__parallel_for(n_items, run_item, &pass, threads);

    if (sumsq) {
        double sum = 0.0;
        for (size_t i = 0; i < n_items; i++) sum += partials[i];
        *sumsq = sum;
    }
    *found = pass.found;
    if (items != stack_items) {
        free(items);
        free(partials);
    }
    return VRAM_OK;
}

vram_status_t vram_amp_unscale_check(const vram_tensor_t *tensors, size_t count, float inv_scale, float *found_inf,
                                     double *sumsq) {
    if (!found_inf) return vram__fail(VRAM_ERR_INVALID_ARG, "found_inf is NULL");
    int found = 0;
    vram_status_t st = run_pass(tensors, count, inv_scale, inv_scale != 1.0f, &found, sumsq);
    if (st == VRAM_OK && found) *found_inf = 1.0f;
    return st;
}

vram_status_t vram_amp_scale_inplace(const vram_tensor_t *tensors, size_t count, float factor) {
    if (factor == 1.0f) return vram__amp_check_list(tensors, count);
    int found = 0;
    return run_pass(tensors, count, factor, 1, &found, NULL);
}
