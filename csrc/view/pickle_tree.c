/* pickle_tree.c — vk_ptree_build: run a plain-data pickle's opcodes into a compact tree.
 *
 * The opcodes and their arguments are pickle's own (Lib/pickletools.py); vram_plain_pickle_check
 * (csrc/util/plain_pickle.c) has already refused every opcode that is not plain data and every
 * length or memo index the data cannot back, so this walk trusts argument lengths but checks the
 * stack structure itself (what the unpickler would refuse: a POP of an empty stack, SETITEMS on
 * a list). */
#include "pickle_tree.h"

#include <stdlib.h>
#include <string.h>

#include "../util/error.h"
#include "vramkit_files.h"

typedef struct vm {
    vk_ptree_t *t;
    size_t pos;
    uint32_t *stack;
    uint64_t n_stack, cap_stack;
    uint64_t *marks;
    uint64_t n_marks, cap_marks;
    uint32_t *memo;
    uint64_t n_memo, cap_memo;
} vm_t;

static vram_status_t no_memory(void) {
    return vram__fail(VRAM_ERR_HOST_MEMORY, "out of host memory reading the pickle into a tree");
}

/* Grow *arr (elements of `size` bytes) to hold `need`; doubling, so appends are amortized O(1). */
static int grow(void **arr, uint64_t *cap, uint64_t need, size_t size) {
    if (need <= *cap) return 0;
    uint64_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *p = realloc(*arr, (size_t)(c * size));
    if (!p) return -1;
    *arr = p;
    *cap = c;
    return 0;
}

static vram_status_t bad(vm_t *m, const char *opcode, const char *what) {
    return vram__fail(VRAM_ERR_INVALID_ARG, "malformed pickle: %s at byte %zu %s", opcode, m->pos, what);
}

static vram_status_t new_node(vm_t *m, uint8_t type, uint32_t n, uint64_t v, uint32_t *out) {
    vk_ptree_t *t = m->t;
    if (t->n_nodes >= UINT32_MAX - 1)
        return vram__fail(VRAM_ERR_INVALID_ARG,
                          "the pickle holds more than 4 billion values; vramkit reads at most that");
    if (grow((void **)&t->nodes, &t->cap_nodes, t->n_nodes + 1, sizeof *t->nodes)) return no_memory();
    t->nodes[t->n_nodes] = (vk_pt_node_t){.type = type, .n = n, .v = v};
    *out = (uint32_t)t->n_nodes++;
    return VRAM_OK;
}

static vram_status_t push(vm_t *m, uint32_t node) {
    if (grow((void **)&m->stack, &m->cap_stack, m->n_stack + 1, sizeof *m->stack)) return no_memory();
    m->stack[m->n_stack++] = node;
    return VRAM_OK;
}

static vram_status_t push_new(vm_t *m, uint8_t type, uint32_t n, uint64_t v) {
    uint32_t id;
    vram_status_t s = new_node(m, type, n, v, &id);
    return s != VRAM_OK ? s : push(m, id);
}

static vram_status_t push_container(vm_t *m, uint8_t type) {
    return push_new(m, type, 0, (uint64_t)VK_PT_NO_SEG | ((uint64_t)VK_PT_NO_SEG << 32));
}

/* Append stack[from, n_stack) to container `c` as one batch, then drop them from the stack. */
static vram_status_t append_run(vm_t *m, uint32_t c, uint64_t from) {
    vk_ptree_t *t = m->t;
    uint64_t count = m->n_stack - from;
    if (count == 0) return VRAM_OK;
    vk_pt_node_t *node = &t->nodes[c];
    if ((uint64_t)node->n + count > UINT32_MAX)
        return vram__fail(VRAM_ERR_INVALID_ARG, "a list or dict in the pickle holds more than 4 billion items");
    if (grow((void **)&t->kids, &t->cap_kids, t->n_kids + count, sizeof *t->kids)) return no_memory();
    if (t->n_segs >= UINT32_MAX - 1) return vram__fail(VRAM_ERR_INVALID_ARG, "the pickle has too many item batches");
    if (grow((void **)&t->segs, &t->cap_segs, t->n_segs + 1, sizeof *t->segs)) return no_memory();
    memcpy(t->kids + t->n_kids, m->stack + from, (size_t)count * sizeof *t->kids);
    uint32_t seg = (uint32_t)t->n_segs++;
    t->segs[seg] = (vk_pt_seg_t){.start = t->n_kids, .count = (uint32_t)count, .next = VK_PT_NO_SEG};
    t->n_kids += count;
    node = &t->nodes[c]; /* nodes did not move, but read it again after the grows for clarity */
    uint32_t first = (uint32_t)node->v, last = (uint32_t)(node->v >> 32);
    if (first == VK_PT_NO_SEG) first = seg;
    else t->segs[last].next = seg;
    node->v = (uint64_t)first | ((uint64_t)seg << 32);
    node->n += (uint32_t)count;
    m->n_stack = from;
    return VRAM_OK;
}

static vram_status_t pop_mark(vm_t *m, const char *opcode, uint64_t *from) {
    if (m->n_marks == 0) return bad(m, opcode, "has no MARK before it");
    *from = m->marks[--m->n_marks];
    return VRAM_OK;
}

/* APPENDS, SETITEMS, ADDITEMS: the container sits just below the mark. */
static vram_status_t add_marked(vm_t *m, const char *opcode, uint8_t want, int pairs) {
    uint64_t from;
    vram_status_t s = pop_mark(m, opcode, &from);
    if (s != VRAM_OK) return s;
    if (from == 0) return bad(m, opcode, "has no container below its MARK");
    uint32_t c = m->stack[from - 1];
    uint8_t type = m->t->nodes[c].type;
    if (type != want && !(want == VK_PT_LIST && type == VK_PT_SET))
        return bad(m, opcode, "adds items to a value that is not the right kind of container");
    if (pairs && (m->n_stack - from) % 2) return bad(m, opcode, "has a key without a value");
    return append_run(m, c, from);
}

/* APPEND, SETITEM: one item (or key and value) on top of the container. */
static vram_status_t add_top(vm_t *m, const char *opcode, uint8_t want, uint64_t items) {
    if (m->n_stack < items + 1 || (m->n_marks && m->marks[m->n_marks - 1] > m->n_stack - items - 1))
        return bad(m, opcode, "has no container below its items");
    uint32_t c = m->stack[m->n_stack - items - 1];
    if (m->t->nodes[c].type != want)
        return bad(m, opcode, "adds items to a value that is not the right kind of container");
    return append_run(m, c, m->n_stack - items);
}

/* LIST, TUPLE, DICT, FROZENSET: a new container of everything since the mark. */
static vram_status_t build_marked(vm_t *m, const char *opcode, uint8_t type) {
    uint64_t from;
    vram_status_t s = pop_mark(m, opcode, &from);
    if (s != VRAM_OK) return s;
    if (type == VK_PT_DICT && (m->n_stack - from) % 2) return bad(m, opcode, "has a key without a value");
    uint32_t c;
    if ((s = new_node(m, type, 0, (uint64_t)VK_PT_NO_SEG | ((uint64_t)VK_PT_NO_SEG << 32), &c)) != VRAM_OK) return s;
    if ((s = append_run(m, c, from)) != VRAM_OK) return s;
    return push(m, c);
}

/* TUPLE1/2/3 */
static vram_status_t build_tuple(vm_t *m, const char *opcode, uint64_t items) {
    if (m->n_stack < items || (m->n_marks && m->marks[m->n_marks - 1] > m->n_stack - items))
        return bad(m, opcode, "needs more values on the stack");
    uint32_t c;
    vram_status_t s = new_node(m, VK_PT_TUPLE, 0, (uint64_t)VK_PT_NO_SEG | ((uint64_t)VK_PT_NO_SEG << 32), &c);
    if (s != VRAM_OK) return s;
    if ((s = append_run(m, c, m->n_stack - items)) != VRAM_OK) return s;
    return push(m, c);
}

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* LONG1/LONG4: n bytes of little-endian two's complement. Beyond 64 bits it is a BIGINT
 * (vramkit never needs the value: a size or address that large is refused by the reader). */
static vram_status_t push_long(vm_t *m, const uint8_t *p, uint64_t n) {
    if (n == 0) return push_new(m, VK_PT_INT, 0, 0);
    int negative = p[n - 1] >> 7;
    uint64_t sig = n; /* drop high bytes that only extend the sign */
    while (sig > 1 && p[sig - 1] == (negative ? 0xff : 0x00) && ((p[sig - 2] >> 7) == negative)) sig--;
    if (sig > 8 && !(sig == 9 && !negative && p[8] == 0)) return push_new(m, VK_PT_BIGINT, 0, 0);
    uint64_t v = le(p, (int)(sig > 8 ? 8 : sig));
    if (negative && sig < 8) v |= ~UINT64_C(0) << (8 * sig);
    if (!negative && (v >> 63)) return push_new(m, VK_PT_UINT, 0, v);
    return push_new(m, VK_PT_INT, 0, v);
}

/* Protocol-0 INT/LONG text ("01"/"00" are True/False in protocol 0, an optional L suffix). */
static vram_status_t push_int_text(vm_t *m, const char *opcode, const uint8_t *p, size_t n) {
    if (n && p[n - 1] == 'L') n--;
    if (n == 2 && p[0] == '0' && (p[1] == '0' || p[1] == '1')) return push_new(m, VK_PT_BOOL, 0, p[1] == '1');
    size_t i = 0;
    int negative = 0;
    if (i < n && (p[i] == '-' || p[i] == '+')) negative = p[i++] == '-';
    if (i == n) return bad(m, opcode, "has no digits");
    uint64_t v = 0;
    int big = 0;
    for (; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return bad(m, opcode, "has a character that is not a digit");
        if (v > (UINT64_MAX - 9) / 10) big = 1;
        else v = v * 10 + (uint64_t)(p[i] - '0');
    }
    if (big || (negative && v > (UINT64_C(1) << 63))) return push_new(m, VK_PT_BIGINT, 0, 0);
    if (negative) return push_new(m, VK_PT_INT, 0, (uint64_t)0 - v);
    return push_new(m, (v >> 63) ? VK_PT_UINT : VK_PT_INT, 0, v);
}

static vram_status_t push_float_text(vm_t *m, const uint8_t *p, size_t n) {
    char buf[64];
    if (n >= sizeof buf) return bad(m, "FLOAT", "has a number too long to be a float");
    memcpy(buf, p, n);
    buf[n] = '\0';
    char *end = NULL;
    double d = strtod(buf, &end);
    if (end == buf) return bad(m, "FLOAT", "is not a number");
    uint64_t bits;
    memcpy(&bits, &d, sizeof bits);
    return push_new(m, VK_PT_FLOAT, 0, bits);
}

static vram_status_t heap_put(vm_t *m, uint8_t byte) {
    vk_ptree_t *t = m->t;
    if (grow((void **)&t->heap, &t->heap_cap, t->heap_len + 1, 1)) return no_memory();
    t->heap[t->heap_len++] = byte;
    return VRAM_OK;
}

static vram_status_t heap_utf8(vm_t *m, uint32_t cp) {
    vram_status_t s = VRAM_OK;
    if (cp < 0x80) return heap_put(m, (uint8_t)cp);
    if (cp < 0x800) {
        if ((s = heap_put(m, (uint8_t)(0xc0 | (cp >> 6)))) != VRAM_OK) return s;
    } else if (cp < 0x10000) {
        if ((s = heap_put(m, (uint8_t)(0xe0 | (cp >> 12)))) != VRAM_OK) return s;
        if ((s = heap_put(m, (uint8_t)(0x80 | ((cp >> 6) & 0x3f)))) != VRAM_OK) return s;
    } else {
        if ((s = heap_put(m, (uint8_t)(0xf0 | (cp >> 18)))) != VRAM_OK) return s;
        if ((s = heap_put(m, (uint8_t)(0x80 | ((cp >> 12) & 0x3f)))) != VRAM_OK) return s;
        if ((s = heap_put(m, (uint8_t)(0x80 | ((cp >> 6) & 0x3f)))) != VRAM_OK) return s;
    }
    return heap_put(m, (uint8_t)(0x80 | (cp & 0x3f)));
}

static int hex_value(uint8_t c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int hex_run(const uint8_t *p, size_t n, uint32_t *out) {
    uint32_t v = 0;
    for (size_t i = 0; i < n; i++) {
        int h = hex_value(p[i]);
        if (h < 0) return -1;
        v = (v << 4) | (uint32_t)h;
    }
    *out = v;
    return 0;
}

/* UNICODE (protocol 0): raw-unicode-escape, i.e. latin-1 bytes with \uXXXX and \UXXXXXXXX. */
static vram_status_t push_raw_unicode(vm_t *m, const uint8_t *p, size_t n) {
    uint64_t start = m->t->heap_len;
    vram_status_t s = VRAM_OK;
    for (size_t i = 0; i < n && s == VRAM_OK; i++) {
        uint32_t cp = p[i];
        size_t digits = (p[i] == '\\' && i + 1 < n) ? (p[i + 1] == 'u' ? 4 : p[i + 1] == 'U' ? 8 : 0) : 0;
        if (digits) {
            if (i + 2 + digits > n || hex_run(p + i + 2, digits, &cp) || cp > 0x10ffff)
                return bad(m, "UNICODE", "has a malformed \\u or \\U escape");
            i += 1 + digits;
        }
        s = heap_utf8(m, cp);
    }
    if (s != VRAM_OK) return s;
    if (m->t->heap_len - start > UINT32_MAX) return bad(m, "UNICODE", "is longer than 4 GiB");
    uint32_t id;
    if ((s = new_node(m, VK_PT_STR, (uint32_t)(m->t->heap_len - start), start, &id)) != VRAM_OK) return s;
    m->t->nodes[id].flags = VK_PT_HEAP;
    return push(m, id);
}

/* STRING (protocol 0): a quoted Python bytes literal, escapes decoded as codecs.escape_decode does. */
static vram_status_t push_quoted(vm_t *m, const uint8_t *p, size_t n) {
    if (n < 2 || (p[0] != '\'' && p[0] != '"') || p[n - 1] != p[0])
        return bad(m, "STRING", "is not a quoted string");
    uint64_t start = m->t->heap_len;
    vram_status_t s = VRAM_OK;
    for (size_t i = 1; i + 1 < n && s == VRAM_OK; i++) {
        uint32_t c = p[i];
        if (c == '\\' && i + 2 < n) {
            uint8_t e = p[++i];
            static const char from[] = "abfnrtv\\'\"", to[] = "\a\b\f\n\r\t\v\\'\"";
            const char *k = memchr(from, e, sizeof from - 1);
            if (k) c = (uint8_t)to[k - from];
            else if (e == 'x' && i + 2 < n && hex_run(p + i + 1, 2, &c) == 0) i += 2;
            else if (e >= '0' && e <= '7') {
                c = (uint32_t)(e - '0');
                for (int d = 0; d < 2 && i + 2 < n && p[i + 1] >= '0' && p[i + 1] <= '7'; d++)
                    c = c * 8 + (uint32_t)(p[++i] - '0');
                c &= 0xff;
            } else if (e == '\n') continue;
            else {
                if ((s = heap_put(m, '\\')) != VRAM_OK) return s;
                c = e;
            }
        }
        s = heap_put(m, (uint8_t)c);
    }
    if (s != VRAM_OK) return s;
    uint32_t id;
    if ((s = new_node(m, VK_PT_STR, (uint32_t)(m->t->heap_len - start), start, &id)) != VRAM_OK) return s;
    m->t->nodes[id].flags = VK_PT_HEAP;
    return push(m, id);
}

static vram_status_t memo_put(vm_t *m, uint64_t index) {
    if (m->n_stack == 0) return bad(m, "a memo store", "has an empty stack");
    if (index > m->n_memo) return bad(m, "a memo store", "skips memo indices");
    if (index == m->n_memo) {
        if (grow((void **)&m->memo, &m->cap_memo, m->n_memo + 1, sizeof *m->memo)) return no_memory();
        m->n_memo++;
    }
    m->memo[index] = m->stack[m->n_stack - 1];
    return VRAM_OK;
}

static vram_status_t memo_get(vm_t *m, uint64_t index) {
    if (index >= m->n_memo) return bad(m, "a memo read", "reads a memo entry never stored");
    return push(m, m->memo[index]);
}

static size_t line_end(const vk_ptree_t *t, size_t from) {
    const uint8_t *nl = memchr(t->data + from, '\n', t->len - from);
    return (size_t)(nl - t->data); /* the check found the newline */
}

static uint64_t decimal(const uint8_t *p, size_t n) {
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) v = v * 10 + (uint64_t)(p[i] - '0');
    return v;
}

/* One opcode at m->pos; *arg is set to the size of its argument, *stop when it was STOP. */
static vram_status_t step(vm_t *m, size_t *arg, int *stop) {
    vk_ptree_t *t = m->t;
    const uint8_t *d = t->data + m->pos + 1;
    uint8_t op = t->data[m->pos];
    size_t end;
    switch (op) {
    case '.':
        *stop = 1;
        return VRAM_OK;
    case 0x80: *arg = 1; return VRAM_OK;  /* PROTO */
    case 0x95: *arg = 8; return VRAM_OK;  /* FRAME: a hint for buffered readers */
    case '(':
        if (grow((void **)&m->marks, &m->cap_marks, m->n_marks + 1, sizeof *m->marks)) return no_memory();
        m->marks[m->n_marks++] = m->n_stack;
        return VRAM_OK;
    case '0': /* POP (of the mark, if the mark is on top, as the unpickler does) */
        if (m->n_marks && m->marks[m->n_marks - 1] == m->n_stack) { m->n_marks--; return VRAM_OK; }
        if (m->n_stack == 0) return bad(m, "POP", "pops an empty stack");
        m->n_stack--;
        return VRAM_OK;
    case '1': { uint64_t from; vram_status_t s = pop_mark(m, "POP_MARK", &from); m->n_stack = from; return s; }
    case '2':
        if (m->n_stack == 0) return bad(m, "DUP", "duplicates an empty stack");
        return push(m, m->stack[m->n_stack - 1]);
    case 'N': return push_new(m, VK_PT_NONE, 0, 0);
    case 0x88: return push_new(m, VK_PT_BOOL, 0, 1);
    case 0x89: return push_new(m, VK_PT_BOOL, 0, 0);
    case 'K': *arg = 1; return push_new(m, VK_PT_INT, 0, d[0]);
    case 'M': *arg = 2; return push_new(m, VK_PT_INT, 0, le(d, 2));
    case 'J': *arg = 4; return push_new(m, VK_PT_INT, 0, (uint64_t)(int64_t)(int32_t)(uint32_t)le(d, 4));
    case 'G': { /* BINFLOAT: big-endian */
        uint64_t bits = 0;
        for (int i = 0; i < 8; i++) bits = (bits << 8) | d[i];
        *arg = 8;
        return push_new(m, VK_PT_FLOAT, 0, bits);
    }
    case 0x8a: *arg = 1 + (size_t)d[0]; return push_long(m, d + 1, d[0]);
    case 0x8b: *arg = 4 + (size_t)le(d, 4); return push_long(m, d + 4, le(d, 4));
    case 0x8c: case 'U': case 'C': { /* SHORT_BINUNICODE, SHORT_BINSTRING, SHORT_BINBYTES */
        *arg = 1 + (size_t)d[0];
        return push_new(m, op == 'C' ? VK_PT_BYTES : VK_PT_STR, d[0], (uint64_t)(m->pos + 2));
    }
    case 'X': case 'T': case 'B': case 0x8d: case 0x8e: case 0x96: { /* 4- and 8-byte lengths */
        int width = (op == 0x8d || op == 0x8e || op == 0x96) ? 8 : 4;
        uint64_t n = le(d, width);
        if (n > UINT32_MAX) return bad(m, "a string or bytes opcode", "holds more than 4 GiB");
        *arg = (size_t)width + (size_t)n;
        return push_new(m, (op == 'X' || op == 'T' || op == 0x8d) ? VK_PT_STR : VK_PT_BYTES, (uint32_t)n,
                        (uint64_t)(m->pos + 1 + (size_t)width));
    }
    case 'I': case 'L': case 'F': case 'S': case 'V': {
        end = line_end(t, m->pos + 1);
        *arg = end - m->pos;
        size_t n = end - m->pos - 1;
        if (op == 'F') return push_float_text(m, d, n);
        if (op == 'S') return push_quoted(m, d, n);
        if (op == 'V') return push_raw_unicode(m, d, n);
        return push_int_text(m, op == 'I' ? "INT" : "LONG", d, n);
    }
    case ')': return push_container(m, VK_PT_TUPLE);
    case ']': return push_container(m, VK_PT_LIST);
    case '}': return push_container(m, VK_PT_DICT);
    case 0x8f: return push_container(m, VK_PT_SET);
    case 0x85: return build_tuple(m, "TUPLE1", 1);
    case 0x86: return build_tuple(m, "TUPLE2", 2);
    case 0x87: return build_tuple(m, "TUPLE3", 3);
    case 't': return build_marked(m, "TUPLE", VK_PT_TUPLE);
    case 'l': return build_marked(m, "LIST", VK_PT_LIST);
    case 'd': return build_marked(m, "DICT", VK_PT_DICT);
    case 0x91: return build_marked(m, "FROZENSET", VK_PT_SET);
    case 'a': return add_top(m, "APPEND", VK_PT_LIST, 1);
    case 's': return add_top(m, "SETITEM", VK_PT_DICT, 2);
    case 'e': return add_marked(m, "APPENDS", VK_PT_LIST, 0);
    case 'u': return add_marked(m, "SETITEMS", VK_PT_DICT, 1);
    case 0x90: return add_marked(m, "ADDITEMS", VK_PT_SET, 0);
    case 0x94: return memo_put(m, m->n_memo);
    case 'q': *arg = 1; return memo_put(m, d[0]);
    case 'r': *arg = 4; return memo_put(m, le(d, 4));
    case 'h': *arg = 1; return memo_get(m, d[0]);
    case 'j': *arg = 4; return memo_get(m, le(d, 4));
    case 'p': case 'g':
        end = line_end(t, m->pos + 1);
        *arg = end - m->pos;
        return op == 'p' ? memo_put(m, decimal(d, end - m->pos - 1)) : memo_get(m, decimal(d, end - m->pos - 1));
    default: /* the check refused every other opcode */
        return bad(m, "an opcode", "is not plain data");
    }
}

vram_status_t vk_ptree_build(vk_ptree_t *tree, const void *data, size_t len) {
    memset(tree, 0, sizeof *tree);
    if (!data && len) return vram__fail(VRAM_ERR_INVALID_ARG, "data is NULL");
    vram_status_t s = vram_plain_pickle_check(data, len, NULL);
    if (s != VRAM_OK) return s;
    tree->data = data;
    tree->len = len;
    vm_t m = {.t = tree};
    int stop = 0;
    while (!stop && s == VRAM_OK) { /* the check guarantees a STOP within the data */
        size_t arg = 0;
        s = step(&m, &arg, &stop);
        if (!stop) m.pos += 1 + arg;
    }
    if (s == VRAM_OK && m.n_stack != 1) s = bad(&m, "STOP", "leaves the stack without exactly one value");
    if (s == VRAM_OK && m.n_marks) s = bad(&m, "STOP", "leaves a MARK unclosed");
    if (s == VRAM_OK) tree->root = m.stack[0];
    free(m.stack);
    free(m.marks);
    free(m.memo);
    if (s != VRAM_OK) vk_ptree_free(tree);
    return s;
}

void vk_ptree_free(vk_ptree_t *tree) {
    free(tree->nodes);
    free(tree->segs);
    free(tree->kids);
    free(tree->heap);
    memset(tree, 0, sizeof *tree);
}

vk_pt_iter_t vk_pt_iter(const vk_ptree_t *t, uint32_t container) {
    const vk_pt_node_t *n = &t->nodes[container];
    int has_kids = n->type >= VK_PT_LIST && n->n;
    return (vk_pt_iter_t){.t = t, .seg = has_kids ? (uint32_t)n->v : VK_PT_NO_SEG, .at = 0};
}

int vk_pt_next(vk_pt_iter_t *it, uint32_t *kid) {
    while (it->seg != VK_PT_NO_SEG) {
        const vk_pt_seg_t *seg = &it->t->segs[it->seg];
        if (it->at < seg->count) {
            *kid = it->t->kids[seg->start + it->at++];
            return 1;
        }
        it->seg = seg->next;
        it->at = 0;
    }
    return 0;
}

int vk_pt_str_is(const vk_ptree_t *t, uint32_t node, const char *s) {
    const vk_pt_node_t *n = &t->nodes[node];
    size_t len = strlen(s);
    return n->type == VK_PT_STR && n->n == len && memcmp(vk_pt_bytes(t, n), s, len) == 0;
}

uint32_t vk_pt_get(const vk_ptree_t *t, uint32_t dict, const char *key) {
    if (t->nodes[dict].type != VK_PT_DICT) return UINT32_MAX;
    uint32_t found = UINT32_MAX, k, v;
    vk_pt_iter_t it = vk_pt_iter(t, dict);
    while (vk_pt_next(&it, &k) && vk_pt_next(&it, &v))
        if (vk_pt_str_is(t, k, key)) found = v;
    return found;
}
