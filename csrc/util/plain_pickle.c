/* plain_pickle.c — vram_plain_pickle_check: walk a pickle's opcodes once and refuse anything
 * that is not plain data, before Python's unpickler (which trusts its input) reads it.
 *
 * The opcode table is pickle's own (Lib/pickletools.py documents each one's argument); what
 * is checked is why this exists (vramkit_files.h): no object may be named, called or built,
 * no length may reach past the data, and memo indices stay dense, so neither code nor a
 * declared size in the file decides what the reader does. The walk stops at STOP, as the
 * unpickler does. */
#include <stdio.h>
#include <string.h>

#include "error.h"
#include "vramkit_files.h"

typedef struct walk {
    const uint8_t *data;
    size_t len;
    size_t pos;         /* the offset of the opcode being read */
    uint64_t memo_len;  /* one past the highest memo index stored */
    int *names_code;
    /* The arguments of the last two string opcodes (memo operations in between skipped), to
     * name the class a STACK_GLOBAL would load: pickle writes module and name just before it. */
    size_t str_at[2], str_len[2];
    int strings; /* how many of those are valid (0..2) */
} walk_t;

static vram_status_t malformed(walk_t *w, const char *opcode, const char *what) {
    return vram__fail(VRAM_ERR_INVALID_ARG, "malformed pickle: %s at byte %zu %s", opcode, w->pos, what);
}

/* Printable ASCII of data[at, at + n), at most `cap` characters, for a message. */
static void printable(const uint8_t *data, size_t at, size_t n, char *out, size_t cap) {
    size_t k = 0;
    for (size_t i = 0; i < n && k + 1 < cap; i++) {
        uint8_t c = data[at + i];
        out[k++] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
    }
    out[k] = '\0';
}

static vram_status_t names_object(walk_t *w, const char *what) {
    if (w->names_code) *w->names_code = 1;
    return vram__fail(VRAM_ERR_INVALID_ARG,
                      "this snapshot pickle contains %s; vramkit reads only plain data (dicts, lists, strings, "
                      "numbers) from a file: refusing", what);
}

static vram_status_t class_reference(walk_t *w, size_t mod_at, size_t mod_len, size_t name_at, size_t name_len) {
    char mod[64], name[64], what[160];
    printable(w->data, mod_at, mod_len, mod, sizeof mod);
    printable(w->data, name_at, name_len, name, sizeof name);
    snprintf(what, sizeof what, "a class reference (%s.%s)", mod, name);
    return names_object(w, what);
}

/* n little-endian bytes at data[at]; the caller has checked they are there. */
static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* The bytes an argument of `n` bytes needs past the opcode: fails if the data ends first. */
static vram_status_t need(walk_t *w, const char *opcode, uint64_t n) {
    if (n > w->len - w->pos - 1)
        return malformed(w, opcode, "needs more bytes than the data has left (truncated, or a length that is not)");
    return VRAM_OK;
}

/* A protocol-0 argument: text up to a newline. *end is the offset of the newline. */
static vram_status_t line(walk_t *w, const char *opcode, size_t from, size_t *end) {
    const uint8_t *nl = memchr(w->data + from, '\n', w->len - from);
    if (!nl) return malformed(w, opcode, "has no newline ending its argument");
    *end = (size_t)(nl - w->data);
    return VRAM_OK;
}

/* A decimal memo index on a protocol-0 line (PUT, GET). */
static vram_status_t decimal(walk_t *w, const char *opcode, size_t from, size_t end, uint64_t *out) {
    uint64_t v = 0;
    if (from == end) return malformed(w, opcode, "has no index");
    for (size_t i = from; i < end; i++) {
        uint8_t c = w->data[i];
        if (c < '0' || c > '9' || v > (UINT64_MAX - 9) / 10) return malformed(w, opcode, "has a bad index");
        v = v * 10 + (uint64_t)(c - '0');
    }
    *out = v;
    return VRAM_OK;
}

/* The unpickler grows its memo table to twice the index stored: an index past the entries
 * stored so far would make it allocate (and zero) far more than the file holds. */
static vram_status_t memo_put(walk_t *w, const char *opcode, uint64_t index) {
    if (index > w->memo_len)
        return malformed(w, opcode, "stores memo entry far past those stored so far (memo indices are dense)");
    if (index == w->memo_len) w->memo_len++;
    return VRAM_OK;
}

static vram_status_t memo_get(walk_t *w, const char *opcode, uint64_t index) {
    return index < w->memo_len ? VRAM_OK : malformed(w, opcode, "reads a memo entry never stored");
}

static void note_string(walk_t *w, size_t at, size_t n) {
    w->str_at[0] = w->str_at[1];
    w->str_len[0] = w->str_len[1];
    w->str_at[1] = at;
    w->str_len[1] = n;
    if (w->strings < 2) w->strings++;
}

enum { PLAIN = 0, SIGNED = 1, STRING = 2 }; /* how a length-prefixed argument is read */

/* A length-prefixed argument: `width` bytes of length, then that many bytes. Returns the size
 * of the whole argument in *arg. */
static vram_status_t counted(walk_t *w, const char *opcode, int width, int how, size_t *arg) {
    vram_status_t s = need(w, opcode, (uint64_t)width);
    if (s != VRAM_OK) return s;
    uint64_t n = le(w->data + w->pos + 1, width);
    if ((how & SIGNED) && (n & 0x80000000u)) return malformed(w, opcode, "has a negative length");
    if (n > (uint64_t)(w->len - w->pos - 1 - (size_t)width))
        return malformed(w, opcode, "declares a length past the end of the data");
    if (how & STRING) note_string(w, w->pos + 1 + (size_t)width, (size_t)n);
    *arg = (size_t)width + (size_t)n;
    return VRAM_OK;
}

vram_status_t vram_plain_pickle_check(const void *data, size_t len, int *names_code) {
    if (names_code) *names_code = 0;
    if (!data && len) return vram__fail(VRAM_ERR_INVALID_ARG, "data is NULL");
    walk_t w = {.data = data, .len = len, .names_code = names_code};
    while (w.pos < w.len) {
        uint8_t op = w.data[w.pos];
        size_t arg = 0, end = 0;
        uint64_t v = 0;
        vram_status_t s = VRAM_OK;
        int keeps_strings = 0; /* memo operations between a string and STACK_GLOBAL */
        switch (op) {
        /* plain data, no argument */
        case '(': case '0': case '1': case '2': case 'N': case 0x88: case 0x89: case ']': case 'a': case 'e':
        case 'l': case ')': case 't': case 0x85: case 0x86: case 0x87: case '}': case 'd': case 's': case 'u':
        case 0x8f: case 0x90: case 0x91:
            break;
        case '.': /* STOP: the unpickler reads no further */
            return VRAM_OK;
        case 0x94: /* MEMOIZE */
            keeps_strings = 1;
            w.memo_len++;
            break;
        /* fixed-size arguments */
        case 'K': arg = 1; break; /* BININT1 */
        case 'M': arg = 2; break; /* BININT2 */
        case 'J': arg = 4; break; /* BININT */
        case 'G': arg = 8; break; /* BINFLOAT */
        case 0x80: /* PROTO */
            if ((s = need(&w, "PROTO", 1)) != VRAM_OK) return s;
            if (w.data[w.pos + 1] > 5) return malformed(&w, "PROTO", "names a protocol above 5");
            arg = 1;
            break;
        case 0x95: /* FRAME: the length of the opcodes that follow, read whole by the unpickler */
            if ((s = need(&w, "FRAME", 8)) != VRAM_OK) return s;
            if (le(w.data + w.pos + 1, 8) > (uint64_t)(w.len - w.pos - 9))
                return malformed(&w, "FRAME", "is longer than the data left");
            arg = 8;
            break;
        /* memo */
        case 'q': case 'r': /* BINPUT, LONG_BINPUT */
            keeps_strings = 1;
            arg = op == 'q' ? 1 : 4;
            if ((s = need(&w, op == 'q' ? "BINPUT" : "LONG_BINPUT", arg)) != VRAM_OK) return s;
            s = memo_put(&w, op == 'q' ? "BINPUT" : "LONG_BINPUT", le(w.data + w.pos + 1, (int)arg));
            break;
        case 'h': case 'j': /* BINGET, LONG_BINGET (they push a value: the strings noted no longer lead) */
            arg = op == 'h' ? 1 : 4;
            if ((s = need(&w, op == 'h' ? "BINGET" : "LONG_BINGET", arg)) != VRAM_OK) return s;
            s = memo_get(&w, op == 'h' ? "BINGET" : "LONG_BINGET", le(w.data + w.pos + 1, (int)arg));
            break;
        case 'p': case 'g': /* PUT, GET (protocol 0) */
            keeps_strings = op == 'p';
            if ((s = line(&w, op == 'p' ? "PUT" : "GET", w.pos + 1, &end)) != VRAM_OK) return s;
            if ((s = decimal(&w, op == 'p' ? "PUT" : "GET", w.pos + 1, end, &v)) != VRAM_OK) return s;
            s = op == 'p' ? memo_put(&w, "PUT", v) : memo_get(&w, "GET", v);
            arg = end - w.pos;
            break;
        /* length-prefixed arguments */
        case 'U': s = counted(&w, "SHORT_BINSTRING", 1, PLAIN, &arg); break;
        case 'C': s = counted(&w, "SHORT_BINBYTES", 1, PLAIN, &arg); break;
        case 0x8c: s = counted(&w, "SHORT_BINUNICODE", 1, STRING, &arg); break;
        case 0x8a: s = counted(&w, "LONG1", 1, PLAIN, &arg); break;
        case 'T': s = counted(&w, "BINSTRING", 4, SIGNED, &arg); break;
        case 'B': s = counted(&w, "BINBYTES", 4, PLAIN, &arg); break;
        case 'X': s = counted(&w, "BINUNICODE", 4, STRING, &arg); break;
        case 0x8b: s = counted(&w, "LONG4", 4, SIGNED, &arg); break;
        case 0x8d: s = counted(&w, "BINUNICODE8", 8, STRING, &arg); break;
        case 0x8e: s = counted(&w, "BINBYTES8", 8, PLAIN, &arg); break;
        case 0x96: s = counted(&w, "BYTEARRAY8", 8, PLAIN, &arg); break;
        /* protocol-0 text arguments */
        case 'I': case 'L': case 'F': case 'S': case 'V':
            if ((s = line(&w, "a text opcode (INT, LONG, FLOAT, STRING, UNICODE)", w.pos + 1, &end)) != VRAM_OK)
                return s;
            arg = end - w.pos;
            break;
        /* objects named, called or built: the ways a pickle runs code */
        case 'c': case 'i': { /* GLOBAL, INST: "module\nname\n" */
            size_t mod_end = 0, name_end = 0;
            const char *opname = op == 'c' ? "GLOBAL" : "INST";
            if ((s = line(&w, opname, w.pos + 1, &mod_end)) != VRAM_OK) return s;
            if ((s = line(&w, opname, mod_end + 1, &name_end)) != VRAM_OK) return s;
            return class_reference(&w, w.pos + 1, mod_end - w.pos - 1, mod_end + 1, name_end - mod_end - 1);
        }
        case 0x93: { /* STACK_GLOBAL */
            if (w.strings == 2) return class_reference(&w, w.str_at[0], w.str_len[0], w.str_at[1], w.str_len[1]);
            char what[96];
            snprintf(what, sizeof what, "a class reference (STACK_GLOBAL at byte %zu)", w.pos);
            return names_object(&w, what);
        }
        case 0x82: case 0x83: case 0x84: { /* EXT1, EXT2, EXT4 */
            char what[96];
            snprintf(what, sizeof what, "a class reference (copyreg extension code, EXT at byte %zu)", w.pos);
            return names_object(&w, what);
        }
        case 'R': case 'b': case 'o': case 0x81: case 0x92: {
            const char *opname = op == 'R' ? "REDUCE" : op == 'b' ? "BUILD" : op == 'o' ? "OBJ"
                               : op == 0x81 ? "NEWOBJ" : "NEWOBJ_EX";
            char what[96];
            snprintf(what, sizeof what, "an object call or construction (%s at byte %zu)", opname, w.pos);
            return names_object(&w, what);
        }
        case 'P': case 'Q':
            return names_object(&w, "a persistent id (an object the reader must supply)");
        case 0x97: case 0x98:
            return names_object(&w, "an out-of-band buffer (an object the reader must supply)");
        default: {
            char opname[32];
            snprintf(opname, sizeof opname, "opcode 0x%02x", op);
            return malformed(&w, opname, "is not a pickle opcode");
        }
        }
        if (s != VRAM_OK) return s;
        if (arg > w.len - w.pos - 1) return need(&w, "an opcode", arg); /* fixed-size arguments */
        if (!keeps_strings && !(op == 0x8c || op == 'X' || op == 0x8d)) w.strings = 0;
        w.pos += 1 + arg;
    }
    return vram__fail(VRAM_ERR_INVALID_ARG, "malformed pickle: the data ends at byte %zu without a STOP opcode "
                      "(truncated)", w.len);
}
