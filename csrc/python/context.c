/* context.c — Python stacks for the allocation history, interned to 64-bit ids.
 *
 * Capture walks the caller's frames and keeps (code object, line) pairs; identical stacks
 * share one id, so a training loop that allocates from the same lines a million times stores
 * its stack once. Frames inside the vramkit package itself are dropped from the innermost end
 * so that stacks start at the user's code.
 *
 * Capture must run before the pool lock is taken: touching frames can allocate, allocation
 * can start the garbage collector, and a finalizer may free vramkit memory on this thread. The
 * table is only touched with the GIL held. */
#include "module.h"

#include <frameobject.h>

#define MAX_FRAMES 64

typedef struct frame_ref {
    PyCodeObject *code; /* a strong reference, kept for the life of the process */
    int line;
} frame_ref_t;

typedef struct stack_entry {
    uint64_t hash;
    uint32_t count;
    frame_ref_t *frames;
} stack_entry_t;

static stack_entry_t *stacks; /* id = index + 1 */
static uint64_t num_stacks, cap_stacks;
static uint64_t *slots; /* open addressing over ids; 0 = empty */
static uint64_t num_slots;
static PyObject *hidden_prefix;  /* innermost frames from files under this path are skipped... */
static PyObject *visible_prefix; /* ...unless they are under this one (the bundled examples) */

static uint64_t hash_frames(const frame_ref_t *f, uint32_t n) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (uint32_t i = 0; i < n; i++) {
        h = (h ^ (uint64_t)(uintptr_t)f[i].code) * 0x100000001b3ull;
        h = (h ^ (uint64_t)(uint32_t)f[i].line) * 0x100000001b3ull;
    }
    return h ? h : 1;
}

static int same(const stack_entry_t *s, uint64_t hash, const frame_ref_t *f, uint32_t n) {
    if (s->hash != hash || s->count != n) return 0;
    for (uint32_t i = 0; i < n; i++)
        if (s->frames[i].code != f[i].code || s->frames[i].line != f[i].line) return 0;
    return 1;
}

static int grow_slots(void) {
    uint64_t n = num_slots ? num_slots * 2 : 1024;
    uint64_t *fresh = calloc(n, sizeof *fresh);
    if (!fresh) return -1;
    for (uint64_t id = 1; id <= num_stacks; id++) {
        uint64_t i = stacks[id - 1].hash & (n - 1);
        while (fresh[i]) i = (i + 1) & (n - 1);
        fresh[i] = id;
    }
    free(slots);
    slots = fresh;
    num_slots = n;
    return 0;
}

/* Returns the id; takes over the references in `f` when a new entry is made. */
static uint64_t intern(frame_ref_t *f, uint32_t n, int *took_refs) {
    *took_refs = 0;
    uint64_t hash = hash_frames(f, n);
    if ((num_stacks + 1) * 2 > num_slots && grow_slots() != 0) return 0;
    uint64_t i = hash & (num_slots - 1);
    for (; slots[i]; i = (i + 1) & (num_slots - 1))
        if (same(&stacks[slots[i] - 1], hash, f, n)) return slots[i];
    if (num_stacks == cap_stacks) {
        uint64_t cap = cap_stacks ? cap_stacks * 2 : 256;
        stack_entry_t *grown = realloc(stacks, cap * sizeof *grown);
        if (!grown) return 0;
        stacks = grown;
        cap_stacks = cap;
    }
    frame_ref_t *copy = malloc((n ? n : 1) * sizeof *copy);
    if (!copy) return 0;
    memcpy(copy, f, n * sizeof *copy);
    stacks[num_stacks] = (stack_entry_t){hash, n, copy};
    slots[i] = ++num_stacks;
    *took_refs = 1;
    return num_stacks;
}

static int starts_with(PyObject *text, PyObject *prefix) {
    return prefix && PyUnicode_Check(text) && PyUnicode_Tailmatch(text, prefix, 0, PY_SSIZE_T_MAX, -1) == 1;
}

static int hidden(PyCodeObject *code) {
    return starts_with(code->co_filename, hidden_prefix) && !starts_with(code->co_filename, visible_prefix);
}

uint64_t vk_capture_context(vram_pool_t *pool) {
    if (!vram_history_enabled(pool) || !PyGILState_Check()) return 0;
    frame_ref_t frames[MAX_FRAMES];
    uint32_t n = 0;
    /* Walking frames may create frame objects. With the collector off no finalizer can run in
     * the middle of this (or of NumPy's allocator, which calls it), and an exception already
     * being raised is kept as it is. */
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
    int gc_was_enabled = PyGC_Disable();
    PyFrameObject *frame = PyEval_GetFrame(); /* borrowed */
    Py_XINCREF(frame);
    while (frame && n < MAX_FRAMES) {
        PyCodeObject *code = PyFrame_GetCode(frame);
        if (n == 0 && hidden(code)) {
            Py_DECREF(code); /* still inside vramkit: start at the caller */
        } else {
            frames[n].code = code;
            frames[n].line = PyFrame_GetLineNumber(frame);
            n++;
        }
        PyFrameObject *back = PyFrame_GetBack(frame);
        Py_DECREF(frame);
        frame = back;
    }
    Py_XDECREF(frame);
    int took = 0;
    uint64_t id = intern(frames, n, &took);
    if (!took)
        for (uint32_t i = 0; i < n; i++) Py_DECREF(frames[i].code);
    if (gc_was_enabled) PyGC_Enable();
    PyErr_Clear(); /* a failed frame allocation only shortens the stack */
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return id;
}

PyObject *vk_context_frames(uint64_t context) {
    if (context == 0 || context > num_stacks) return PyList_New(0);
    /* Copy out first: building the list can run the GC, whose finalizers may intern new stacks
     * and move `stacks`. An entry's frames array itself never moves. */
    const uint32_t count = stacks[context - 1].count;
    const frame_ref_t *refs = stacks[context - 1].frames;
    PyObject *list = PyList_New(count);
    if (!list) return NULL;
    for (uint32_t i = 0; i < count; i++) {
        PyCodeObject *code = refs[i].code;
        PyObject *frame = Py_BuildValue("{s:O,s:i,s:O}", "filename", code->co_filename, "line", refs[i].line,
                                        "name", code->co_name);
        if (!frame) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, frame);
    }
    return list;
}

static PyObject *context_frames(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long id = PyLong_AsUnsignedLongLong(arg);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    return vk_context_frames(id);
}

static PyObject *set_hidden_prefix(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *hide, *show;
    if (!PyArg_ParseTuple(args, "UU:_set_hidden_prefix", &hide, &show)) return NULL;
    Py_XSETREF(hidden_prefix, Py_NewRef(hide));
    Py_XSETREF(visible_prefix, Py_NewRef(show));
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"context_frames", context_frames, METH_O, "Frames of an interned stack id, innermost first."},
    {"_set_hidden_prefix", set_hidden_prefix, METH_VARARGS,
     "_set_hidden_prefix(hide, show): drop innermost frames from files under `hide` but not under `show`."},
    {NULL, NULL, 0, NULL},
};

/* The stack of an allocation torch asks for through the pluggable allocator (vramkit_torch.h).
 * torch's bindings release the GIL around every op, so the caller holds no GIL here; it is
 * taken back, as torch's own python-stack capture does, to read this thread's frames. Only on
 * a thread Python already knows (autograd's engine threads that never ran Python have no
 * frames to read) and never while the interpreter is finalizing. No vramkit or torch lock is
 * held at this point: torch calls alloc_fn outside its allocator mutex, and the pool lock is
 * taken after this returns. */
static uint64_t capture_for_torch(vram_pool_t *pool) {
    if (!vram_history_enabled(pool)) return 0;
    if (PyGILState_Check()) return vk_capture_context(pool);
    if (!Py_IsInitialized() || PyGILState_GetThisThreadState() == NULL) return 0;
#if PY_VERSION_HEX >= 0x030D0000
    if (Py_IsFinalizing()) return 0;
#else
    if (_Py_IsFinalizing()) return 0;
#endif
    PyGILState_STATE gil = PyGILState_Ensure();
    uint64_t id = vk_capture_context(pool);
    PyGILState_Release(gil);
    return id;
}

int vk_context_init(PyObject *module) {
    vram_torch_set_context_hook(capture_for_torch);
    return vk_add_methods(module, methods);
}
