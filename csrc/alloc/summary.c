/* summary.c — torch.cuda.memory_summary's 75-column table, generated from the same X-macro
 * lists as the counters, so a new counter cannot be forgotten here. On a CUDA device the
 * table is PyTorch's byte for byte except the title line, so users can diff the two. On cpu
 * and sim pools the words that would be wrong there ("CUDA OOMs", "cudaMalloc retries",
 * "GPU reserved memory") name the device instead, in the same columns. */
#include "internal.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"

#define WIDTH 75

typedef struct text {
    char *buf;
    size_t len, cap;
    int failed;
} text_t;

static void add(text_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(text_t *t, const char *fmt, ...) {
    if (t->failed) return;
    for (;;) {
        va_list args;
        va_start(args, fmt);
        int n = vsnprintf(t->buf + t->len, t->cap - t->len, fmt, args);
        va_end(args);
        if (n < 0) {
            t->failed = 1;
            return;
        }
        if ((size_t)n < t->cap - t->len) {
            t->len += (size_t)n;
            return;
        }
        size_t cap = t->cap * 2 + (size_t)n;
        char *buf = realloc(t->buf, cap);
        if (!buf) {
            t->failed = 1;
            return;
        }
        t->buf = buf;
        t->cap = cap;
    }
}

/* One framed line: "|" + content + "|\n". */
static void rule(text_t *t, char c) {
    char line[WIDTH + 1];
    memset(line, c, WIDTH);
    line[WIDTH] = '\0';
    add(t, "|%s|\n", line);
}

/* _format_size: the unit steps up while the row's reference value is >= 768 KiB. */
static void format_size(char *out, size_t len, int64_t value, int64_t reference) {
    static const char *const prefixes[] = {"B  ", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double ref = (double)reference;
    int p = 0;
    while (p < 5 && !(ref < 768.0 * 1024.0)) {
        p++;
        value /= 1024;
        ref /= 1024.0;
    }
    snprintf(out, len, "%6lld %s", (long long)value, prefixes[p]);
}

/* _format_count: K and M suffixes once the reference reaches 750,000. */
static void format_count(char *out, size_t len, int64_t value, int64_t reference) {
    static const char *const prefixes[] = {" ", "K", "M"};
    double ref = (double)reference;
    int p = 0;
    while (p < 2 && !(ref < 750.0 * 1000.0)) {
        p++;
        value /= 1000;
        ref /= 1000.0;
    }
    snprintf(out, len, "%7lld %s ", (long long)value, prefixes[p]);
}

typedef void (*formatter_t)(char *, size_t, int64_t, int64_t);

static void row(text_t *t, const char *name, const vram_stat_t *s, const vram_stat_t *ref, formatter_t fmt) {
    char cur[32], peak[32], alloc[32], freed[32];
    fmt(cur, sizeof cur, s->current, ref->current);
    fmt(peak, sizeof peak, s->peak, ref->peak);
    fmt(alloc, sizeof alloc, s->allocated, ref->allocated);
    fmt(freed, sizeof freed, s->freed, ref->freed);
    add(t, "| %-21s | %s | %s | %s | %s |\n", name, cur, peak, alloc, freed);
}

/* The words PyTorch's table uses for CUDA, and what they become on other devices. */
typedef struct device_words {
    const char *memory; /* replaces "GPU" in row labels */
    const char *ooms;   /* "<ooms> OOMs" */
    const char *alloc;  /* "<alloc> retries": the backend call that is retried */
} device_words_t;

static device_words_t words_for(vram_device_kind_t kind) {
    switch (kind) {
    case VRAM_DEVICE_CPU: return (device_words_t){"CPU", "CPU", "mmap"};
    case VRAM_DEVICE_SIM: return (device_words_t){"sim", "sim", "sim alloc"};
    default: return (device_words_t){"GPU", "CUDA", "cudaMalloc"};
    }
}

/* The label with its "GPU" (if any) replaced by the device's word. */
static const char *relabel(const char *label, const device_words_t *w, char *buf, size_t len) {
    const char *gpu = strstr(label, "GPU");
    if (!gpu) return label;
    snprintf(buf, len, "%.*s%s%s", (int)(gpu - label), label, w->memory, gpu + 3);
    return buf;
}

static void array_rows(text_t *t, const char *label, const vram_stat_t *array, int is_bytes, int abbreviated) {
    formatter_t fmt = is_bytes ? format_size : format_count;
    rule(t, '-');
    row(t, label, &array[VRAM_STAT_ALL], &array[VRAM_STAT_ALL], fmt);
    if (abbreviated) return;
    row(t, "      from large pool", &array[VRAM_STAT_LARGE_POOL], &array[VRAM_STAT_ALL], fmt);
    row(t, "      from small pool", &array[VRAM_STAT_SMALL_POOL], &array[VRAM_STAT_ALL], fmt);
}

vram_status_t vram_memory_summary(vram_pool_t *pool, int abbreviated, char **out) {
    *out = NULL;
    vram_stats_t s = {.size = sizeof s};
    vram_status_t status = vram_get_stats(pool, &s);
    if (status != VRAM_OK) return status;
    text_t t = {.buf = malloc(8192), .cap = 8192};
    if (!t.buf) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for a summary");
    t.buf[0] = '\0';

    char device[32], title[WIDTH + 1];
    vram_device_format(pool->device, device, sizeof device);
    int n = snprintf(title, sizeof title, "vramkit memory summary, device %s", device);
    if (n > WIDTH) n = WIDTH;
    int left = (WIDTH - n) / 2;
    rule(&t, '=');
    add(&t, "|%*s%s%*s|\n", left, "", title, WIDTH - n - left, "");
    rule(&t, '-');
    /* PyTorch: "|  " + 9 spaces + " CUDA OOMs: " ... + 6 spaces + " cudaMalloc retries: " ...;
     * other words keep the columns by taking their width from the padding. */
    device_words_t w = words_for(pool->device.kind);
    add(&t, "|  %*s %s OOMs: %-12lld | %*s %s retries: %-8lld  |\n", 13 - (int)strlen(w.ooms), "", w.ooms,
        (long long)s.num_ooms, 16 - (int)strlen(w.alloc), "", w.alloc, (long long)s.num_alloc_retries);
    rule(&t, '=');
    add(&t, "|        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  |\n");
    char label_buf[64];
#define ARRAY_ROWS(key, label, is_bytes) \
    array_rows(&t, relabel(label, &w, label_buf, sizeof label_buf), s.key, is_bytes, abbreviated);
    VRAM_STAT_ARRAYS(ARRAY_ROWS)
#undef ARRAY_ROWS
#define SINGLE_ROW(key, label) \
    rule(&t, '-');             \
    row(&t, relabel(label, &w, label_buf, sizeof label_buf), &s.key, &s.key, format_count);
    VRAM_STAT_SINGLES(SINGLE_ROW)
#undef SINGLE_ROW
    rule(&t, '=');
    if (t.failed) {
        free(t.buf);
        return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory for a summary");
    }
    *out = t.buf;
    return VRAM_OK;
}
