/* oom_queue.c — hands every out-of-memory of a vramkit pool to a Python observer
 * (vramkit.survive.oom's post-mortem), whichever way the allocation came: vramkit's own API,
 * NumPy's data-memory handler, or torch's pluggable allocator on a thread without the GIL.
 *
 * The core calls on_oom with the pool's lock held, possibly inside NumPy's allocation of an
 * array (where no Python code may run) or on a thread that does not hold the GIL. So on_oom
 * only copies the figures into a small queue and asks the interpreter, with Py_AddPendingCall
 * (callable from any thread, without the GIL), to run drain() on the main thread at its next
 * safe point: moments later, while the exception is still unwinding or being handled. The
 * pool's allocation history (the 'oom' event) keeps what was live at the failure, so the
 * post-mortem built then still describes the moment of the failure. */
#include "module.h"

#include <string.h>

#include "../util/lock.h"

#define QUEUE_SIZE 8     /* OOMs waiting for the interpreter; more in between are counted, not kept */
#define MESSAGE_SIZE 1024

typedef struct queued_oom {
    vram_oom_info_t info;
    char message[MESSAGE_SIZE];
} queued_oom_t;

static vram__mutex_t queue_lock;
static queued_oom_t queue[QUEUE_SIZE];
static int queued;                  /* entries in queue */
static unsigned long long dropped;  /* OOMs that found the queue full since the last drain */
static int drain_scheduled;         /* a pending call is on its way */
static PyObject *observer;          /* the Python callable; touched only with the GIL */

static int drain(void *unused);

static void on_oom(const vram_oom_info_t *info, const char *message) {
    vram__lock(&queue_lock);
    if (queued < QUEUE_SIZE) {
        queue[queued].info = *info;
        snprintf(queue[queued].message, MESSAGE_SIZE, "%s", message ? message : "");
        queued++;
    } else {
        dropped++;
    }
    int schedule = !drain_scheduled;
    drain_scheduled = 1;
    vram__unlock(&queue_lock);
    /* Py_AddPendingCall fails only when the interpreter's own queue is full: the next OOM retries. */
    if (schedule && Py_AddPendingCall(drain, NULL) != 0) {
        vram__lock(&queue_lock);
        drain_scheduled = 0;
        vram__unlock(&queue_lock);
    }
}

static PyObject *as_dict(const queued_oom_t *q, unsigned long long dropped_before) {
    PyObject *device = vk_device_name((vram_device_t){(vram_device_kind_t)q->info.device_kind,
                                                      q->info.device_index, 0});
    if (!device) return NULL;
    PyObject *allowed = q->info.allowed == UINT64_MAX ? Py_NewRef(Py_None)
                                                      : PyLong_FromUnsignedLongLong(q->info.allowed);
    PyObject *d = allowed ? Py_BuildValue("{s:O,s:K,s:K,s:K,s:K,s:K,s:K,s:O,s:s,s:K}", "device", device,
                                          "requested", (unsigned long long)q->info.requested,
                                          "segment_size", (unsigned long long)q->info.segment_size,
                                          "free", (unsigned long long)q->info.device_free,
                                          "total", (unsigned long long)q->info.device_total,
                                          "allocated", (unsigned long long)q->info.allocated,
                                          "reserved", (unsigned long long)q->info.reserved,
                                          "allowed", allowed, "message", q->message,
                                          "dropped_before", dropped_before)
                          : NULL;
    Py_XDECREF(allowed);
    Py_DECREF(device);
    return d;
}

/* On the main thread with the GIL. An exception from the observer is dropped (it must not
 * replace the OOM the program is handling), except KeyboardInterrupt and SystemExit. */
static int drain(void *unused) {
    (void)unused;
    queued_oom_t taken[QUEUE_SIZE];
    vram__lock(&queue_lock);
    int n = queued;
    unsigned long long lost = dropped;
    memcpy(taken, queue, (size_t)n * sizeof taken[0]);
    queued = 0;
    dropped = 0;
    drain_scheduled = 0;
    vram__unlock(&queue_lock);
    if (!observer) return 0;
    PyObject *fn = Py_NewRef(observer); /* the observer may replace itself */
    int status = 0;
    for (int i = 0; i < n && status == 0; i++) {
        PyObject *d = as_dict(&taken[i], i == 0 ? lost : 0);
        PyObject *r = d ? PyObject_CallOneArg(fn, d) : NULL;
        Py_XDECREF(d);
        if (r) {
            Py_DECREF(r);
        } else if (PyErr_ExceptionMatches(PyExc_Exception)) {
            PyErr_Clear();
        } else {
            status = -1; /* KeyboardInterrupt, SystemExit: raised in the main thread */
        }
    }
    Py_DECREF(fn);
    return status;
}

static PyObject *set_oom_observer(PyObject *self, PyObject *fn) {
    (void)self;
    if (fn != Py_None && !PyCallable_Check(fn)) {
        PyErr_Format(PyExc_TypeError, "_set_oom_observer() takes a callable or None, not %.80s", Py_TYPE(fn)->tp_name);
        return NULL;
    }
    PyObject *old = observer;
    observer = fn == Py_None ? NULL : Py_NewRef(fn);
    vram_set_oom_callback(observer ? on_oom : NULL);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

static PyObject *drain_oom_queue(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    if (drain(NULL) != 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"_set_oom_observer", set_oom_observer, METH_O,
     "_set_oom_observer(fn or None): fn(dict) is called on the main thread, moments after each out-of-memory "
     "of a vramkit pool, with its figures (device, requested, free, total, allocated, reserved, allowed, message)."},
    {"_drain_oom_queue", drain_oom_queue, METH_NOARGS,
     "_drain_oom_queue(): hand the queued out-of-memory reports to the observer now (tests; the interpreter "
     "does it at its next safe point anyway)."},
    {NULL, NULL, 0, NULL},
};

int vk_oom_queue_init(PyObject *module) {
    if (vram__mutex_init(&queue_lock) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "could not create the out-of-memory queue's lock");
        return -1;
    }
    return vk_add_methods(module, methods);
}
