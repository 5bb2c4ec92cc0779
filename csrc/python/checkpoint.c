/* checkpoint.c — bindings of the checkpoint planner. Stages (and the loss, one more stage)
 * arrive as (fwd_time, bwd_time, input_bytes, saved_bytes, fwd_tmp, bwd_tmp, fwd_all_tmp) tuples from
 * vramkit/checkpoint.py, which checks them first; ops travel as (kind, stage) tuples. */
#include "module.h"

#define STAGE_FORMAT \
    "ddKKKKK;a stage is (fwd_time, bwd_time, input_bytes, saved_bytes, fwd_tmp, bwd_tmp, fwd_all_tmp)"

static int parse_stage(PyObject *t, vram_ckpt_stage_t *s) {
    unsigned long long in, saved, ft, bt, fat;
    if (!PyArg_ParseTuple(t, STAGE_FORMAT, &s->fwd_time, &s->bwd_time, &in, &saved, &ft, &bt, &fat)) return -1;
    s->input_bytes = in, s->saved_bytes = saved, s->fwd_tmp = ft, s->bwd_tmp = bt, s->fwd_all_tmp = fat;
    return 0;
}

static int parse_stages(PyObject *obj, vram_ckpt_stage_t **out, size_t *count) {
    PyObject *seq = PySequence_Fast(obj, "stages must be a sequence of 7-tuples");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    vram_ckpt_stage_t *s = PyMem_New(vram_ckpt_stage_t, n ? (size_t)n : 1);
    if (!s) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_stage(PySequence_Fast_GET_ITEM(seq, i), &s[i]) < 0) {
            PyMem_Free(s);
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    *out = s;
    *count = (size_t)n;
    return 0;
}

/* _C.ckpt_plan(stages, loss, budget, algorithm, segments, slots), loss a stage tuple
 *   -> (ops, predicted_time, predicted_peak), or (None, min_budget, message) when it does not fit. */
static PyObject *ckpt_plan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj, *loss_obj;
    unsigned long long budget;
    int algorithm, segments, slots;
    if (!PyArg_ParseTuple(args, "OOKiii:ckpt_plan", &obj, &loss_obj, &budget, &algorithm, &segments, &slots))
        return NULL;
    vram_ckpt_stage_t loss, *stages;
    if (parse_stage(loss_obj, &loss) < 0) return NULL;
    size_t count;
    if (parse_stages(obj, &stages, &count) < 0) return NULL;
    vram_ckpt_schedule_t *sched = NULL;
    uint64_t least = 0;
    vram_status_t st;
    Py_BEGIN_ALLOW_THREADS st = vram_ckpt_plan(stages, count, &loss, budget, (vram_ckpt_algorithm_t)algorithm,
                                                segments, slots, &sched, &least);
    Py_END_ALLOW_THREADS PyMem_Free(stages);
    if (st == VRAM_ERR_INFEASIBLE) return Py_BuildValue("(OKs)", Py_None, (unsigned long long)least, vram_last_error());
    if (st != VRAM_OK) return vk_raise(st);
    PyObject *ops = PyList_New((Py_ssize_t)sched->num_ops);
    for (size_t k = 0; ops && k < sched->num_ops; k++) {
        PyObject *op = Py_BuildValue("(II)", sched->ops[k].kind, sched->ops[k].stage);
        if (!op) {
            Py_CLEAR(ops);
            break;
        }
        PyList_SET_ITEM(ops, (Py_ssize_t)k, op);
    }
    PyObject *result = ops ? Py_BuildValue("(NdK)", ops, sched->predicted_time,
                                           (unsigned long long)sched->predicted_peak) : NULL;
    vram_ckpt_schedule_free(sched);
    return result;
}

/* _C.ckpt_simulate(stages, loss, ops) -> (time, peak); ValueError naming the op. */
static PyObject *ckpt_simulate(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj, *loss_obj, *ops_obj;
    if (!PyArg_ParseTuple(args, "OOO:ckpt_simulate", &obj, &loss_obj, &ops_obj)) return NULL;
    vram_ckpt_stage_t loss;
    if (parse_stage(loss_obj, &loss) < 0) return NULL;
    PyObject *seq = PySequence_Fast(ops_obj, "ops must be a sequence of (kind, stage) tuples");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    vram_ckpt_op_t *ops = PyMem_New(vram_ckpt_op_t, n ? (size_t)n : 1);
    vram_ckpt_stage_t *stages = NULL;
    size_t count;
    PyObject *result = NULL;
    if (!ops) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        unsigned int kind, stage;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "II;an op is (kind, stage)", &kind, &stage)) goto done;
        ops[k] = (vram_ckpt_op_t){kind, stage};
    }
    if (parse_stages(obj, &stages, &count) < 0) goto done;
    double time;
    uint64_t peak;
    vram_status_t st = vram_ckpt_simulate(stages, count, &loss, ops, (size_t)n, &time, &peak);
    if (st != VRAM_OK) {
        vk_raise(st);
        goto done;
    }
    result = Py_BuildValue("(dK)", time, (unsigned long long)peak);
done:
    PyMem_Free(ops);
    PyMem_Free(stages);
    Py_DECREF(seq);
    return result;
}

/* _C.ckpt_min_budget(stages, loss) -> the least bytes any schedule needs. */
static PyObject *ckpt_min_budget(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *obj, *loss_obj;
    if (!PyArg_ParseTuple(args, "OO:ckpt_min_budget", &obj, &loss_obj)) return NULL;
    vram_ckpt_stage_t loss, *stages;
    if (parse_stage(loss_obj, &loss) < 0) return NULL;
    size_t count;
    if (parse_stages(obj, &stages, &count) < 0) return NULL;
    uint64_t least;
    vram_status_t st = vram_ckpt_min_budget(stages, count, &loss, &least);
    PyMem_Free(stages);
    if (st != VRAM_OK) return vk_raise(st);
    return PyLong_FromUnsignedLongLong(least);
}

static PyMethodDef methods[] = {
    {"ckpt_plan", ckpt_plan, METH_VARARGS,
     "ckpt_plan(stages, loss, budget, algorithm, segments, slots) -> (ops, time, peak) | (None, min_budget, msg)"},
    {"ckpt_simulate", ckpt_simulate, METH_VARARGS, "ckpt_simulate(stages, loss, ops) -> (time, peak)"},
    {"ckpt_min_budget", ckpt_min_budget, METH_VARARGS, "ckpt_min_budget(stages, loss) -> bytes"},
    {NULL, NULL, 0, NULL},
};

int vk_checkpoint_init(PyObject *module) { return vk_add_methods(module, methods); }
