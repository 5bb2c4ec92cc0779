/* history_columns.c — the history's columns: their names and types (as the binding hands them
 * to NumPy), appending a value to one, and freeing them all. */
#include <stdlib.h>
#include <string.h>

#include "../util/error.h"
#include "snapshot_history.h"

const char *const vk_history_column_names[VK_H_NCOLUMNS] = {
    "ev_kind", "ev_id", "ev_time", "a_size", "a_addr", "a_stream", "a_stack", "stack_start", "stack_frames",
    "f_file", "f_name", "f_line", "str_start", "str_data", "se_event", "se_addr", "se_size", "se_stream",
    "se_sign", "oom_event", "oom_size", "oom_free", "oom_time", "fs_addr", "fs_size", "fs_stream"};
const char vk_history_column_types[VK_H_NCOLUMNS] = {
    'B', 'I', 'q', 'Q', 'Q', 'Q', 'i', 'Q', 'I', 'I', 'I', 'q', 'Q', 'B', 'Q', 'Q', 'Q', 'Q', 'b', 'Q', 'Q', 'q',
    'q', 'Q', 'Q', 'Q'};

size_t vk_history_column_size(int col) {
    switch (vk_history_column_types[col]) {
    case 'B': case 'b': return 1;
    case 'I': case 'i': return 4;
    default: return 8;
    }
}

vram_status_t vk_history_put(vk_history_t *h, int col, uint64_t value) {
    vk_vec_t *v = &h->col[col];
    size_t es = vk_history_column_size(col);
    if (v->n == v->cap) {
        uint64_t cap = v->cap ? v->cap * 2 : 256;
        void *p = realloc(v->p, (size_t)cap * es);
        if (!p) return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory reading the snapshot's history");
        v->p = p;
        v->cap = cap;
    }
    uint8_t *at = (uint8_t *)v->p + v->n++ * es;
    if (es == 1) *at = (uint8_t)value;
    else if (es == 4) { uint32_t x = (uint32_t)value; memcpy(at, &x, 4); }
    else memcpy(at, &value, 8);
    return VRAM_OK;
}

void vk_history_free(vk_history_t *h) {
    for (int c = 0; c < VK_H_NCOLUMNS; c++) free(h->col[c].p);
    memset(h, 0, sizeof *h);
}
