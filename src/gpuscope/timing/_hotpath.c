/* The timer's hot path in C: the same steps as hot.py's PyHotPath and PySequenceBase, without the
 * Python frames, the ctypes argument conversion and the NamedTuple constructor that kept a region
 * well above the cost of two raw event records in context (docs/design.md, "The hot path in C").
 *
 * It links nothing from CUDA: the route hands over the address of cudaEventRecord in the libcudart
 * torch already loaded (routes.py), so a CPU-only machine builds and tests this file with the host
 * route, whose record is a Python callable. Everything rare (a new device's pool, graph capture,
 * a failed record) calls back into the Python methods that handle it there.
 *
 * Every function here runs with the GIL held, as the Python version does; the hot path takes no
 * lock and does no I/O. The exceptions: the recycler's thread (below), which never holds the GIL,
 * and Resolve.run, the resolver's inner loop where no recycler runs (resolver.py), which releases
 * the GIL while it asks CUDA whether pairs finished and how long they took.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

typedef int (*record_fn_t)(void *event, void *stream);
typedef int (*query_fn_t)(void *event);
typedef int (*elapsed_fn_t)(float *ms, void *start, void *end);
typedef int (*last_error_fn_t)(void);

#define CUDA_ERROR_NOT_READY 600

static PyObject *s_add_device, *s_record_failed, *s_record_captured, *s_op_state, *s_split_captured, *s_end,
    *s_pool_empty, *s_ring_full, *s_append, *one, *s_error, *s_seq, *s_split;

static int is_none(PyObject *o) { return o == NULL || o == Py_None; }

/* The object fields of each type, listed once: GC_FUNCTIONS writes the garbage collector's traverse
 * and clear, and the dealloc, from the list. */
#define VISIT_FIELD(field) Py_VISIT(self->field);
#define CLEAR_FIELD(field) Py_CLEAR(self->field);
#define GC_TRAVERSE_CLEAR(Type, OBJECTS)                                                         \
    static int Type##_traverse(Type *self, visitproc visit, void *arg) {                         \
        OBJECTS(VISIT_FIELD)                                                                     \
        return 0;                                                                                \
    }                                                                                            \
    static int Type##_clear(Type *self) {                                                        \
        OBJECTS(CLEAR_FIELD)                                                                     \
        return 0;                                                                                \
    }
#define GC_FUNCTIONS(Type, OBJECTS)                                                              \
    GC_TRAVERSE_CLEAR(Type, OBJECTS)                                                             \
    static void Type##_dealloc(Type *self) {                                                     \
        PyObject_GC_UnTrack(self);                                                               \
        Type##_clear(self);                                                                      \
        Py_TYPE(self)->tp_free((PyObject *)self);                                                \
    }

/* ------------------------------------------------------------------------------------------------ */
/* The timer's data model: BucketHistogram and OpState. histogram.py holds their Python twins, which */
/* say what each field is for; the loops below update them through these structs, never by name.    */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;                 /* bounds; the buckets are n + 1, +Inf last */
    double *bounds;               /* ascending upper bounds, inclusive */
    unsigned long long *counts;   /* per bucket, not cumulative */
    PyObject **exemplars;         /* per bucket: (trace id, value, unix time), or NULL */
    double sum;
    unsigned long long count;
    PyObject *bounds_tuple;       /* the bounds as floats, for Python readers */
    PyObject *les;                /* each bucket's ``le`` label: repr of its bound, "+Inf" last */
} BucketHistogram;

static PyTypeObject BucketHistogramType, OpStateType;

/* A histogram over ``bounds`` (a sequence of ascending numbers): a new reference, or NULL. */
static PyObject *histogram_new(PyObject *bounds) {
    PyObject *seq = PySequence_Fast(bounds, "histogram bounds must be a sequence of numbers");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    BucketHistogram *h = (BucketHistogram *)BucketHistogramType.tp_alloc(&BucketHistogramType, 0);
    if (h == NULL) goto fail;
    h->n = n;
    h->bounds = PyMem_Calloc(n > 0 ? n : 1, sizeof(double));
    h->counts = PyMem_Calloc(n + 1, sizeof(unsigned long long));
    h->exemplars = PyMem_Calloc(n + 1, sizeof(PyObject *));
    h->bounds_tuple = PyTuple_New(n);
    h->les = PyTuple_New(n + 1);
    if (h->bounds_tuple == NULL || h->les == NULL) goto fail;
    if (h->bounds == NULL || h->counts == NULL || h->exemplars == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        double bound = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (bound == -1.0 && PyErr_Occurred()) goto fail;
        if (isnan(bound) || (i > 0 && !(h->bounds[i - 1] < bound))) {
            PyErr_SetString(PyExc_ValueError, "histogram bounds must be ascending numbers");
            goto fail;
        }
        h->bounds[i] = bound;
        PyObject *value = PyFloat_FromDouble(bound), *le = value == NULL ? NULL : PyObject_Repr(value);
        if (le == NULL) {
            Py_XDECREF(value);
            goto fail;
        }
        PyTuple_SET_ITEM(h->bounds_tuple, i, value);
        PyTuple_SET_ITEM(h->les, i, le);
    }
    PyObject *inf = PyUnicode_FromString("+Inf");
    if (inf == NULL) goto fail;
    PyTuple_SET_ITEM(h->les, n, inf);
    Py_DECREF(seq);
    return (PyObject *)h;
fail:
    Py_XDECREF(h);
    Py_DECREF(seq);
    return NULL;
}

/* One duration into ``h``, as BucketHistogram.observe does: 1, 0 when refused (NaN), or -1 with a
 * Python error. */
static int histogram_observe(BucketHistogram *h, double value, PyObject *trace) {
    if (isnan(value)) return 0;
    if (value < 0.0) value = 0.0;
    Py_ssize_t lo = 0, hi = h->n;  /* bisect_left: the first bound >= value */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (h->bounds[mid] < value) lo = mid + 1; else hi = mid;
    }
    int keep = trace == NULL ? 0 : PyObject_IsTrue(trace);
    if (keep < 0) return -1;
    h->counts[lo]++;
    h->sum += value;
    h->count++;
    if (keep) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        PyObject *exemplar = Py_BuildValue("(Odd)", trace, value, (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec);
        if (exemplar == NULL) return -1;
        Py_XSETREF(h->exemplars[lo], exemplar);
    }
    return 1;
}

static PyObject *BucketHistogram_new(PyTypeObject *Py_UNUSED(type), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"bounds", NULL};
    PyObject *bounds;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O", kwlist, &bounds)) return NULL;
    return histogram_new(bounds);
}

static int BucketHistogram_traverse(BucketHistogram *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; self->exemplars != NULL && i <= self->n; i++) Py_VISIT(self->exemplars[i]);
    Py_VISIT(self->bounds_tuple);
    Py_VISIT(self->les);
    return 0;
}

static int BucketHistogram_clear(BucketHistogram *self) {
    for (Py_ssize_t i = 0; self->exemplars != NULL && i <= self->n; i++) Py_CLEAR(self->exemplars[i]);
    Py_CLEAR(self->bounds_tuple);
    Py_CLEAR(self->les);
    return 0;
}

static void BucketHistogram_dealloc(BucketHistogram *self) {
    PyObject_GC_UnTrack(self);
    BucketHistogram_clear(self);
    PyMem_Free(self->bounds);
    PyMem_Free(self->counts);
    PyMem_Free(self->exemplars);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *BucketHistogram_observe(BucketHistogram *h, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "observe(value, trace_id=None)");
        return NULL;
    }
    double value = PyFloat_AsDouble(args[0]);
    if (value == -1.0 && PyErr_Occurred()) return NULL;
    int rc = histogram_observe(h, value, nargs == 2 ? args[1] : NULL);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

static PyObject *BucketHistogram_cumulative(BucketHistogram *h, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(h->n + 1);
    if (out == NULL) return NULL;
    unsigned long long running = 0;
    for (Py_ssize_t i = 0; i <= h->n; i++) {
        running += h->counts[i];
        PyObject *exemplar = h->exemplars[i] != NULL ? h->exemplars[i] : Py_None;
        PyObject *row = Py_BuildValue("(OKO)", PyTuple_GET_ITEM(h->les, i), running, exemplar);
        if (row == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, row);
    }
    return out;
}

static PyObject *BucketHistogram_quantile(BucketHistogram *h, PyObject *arg) {
    double q = PyFloat_AsDouble(arg);
    if (q == -1.0 && PyErr_Occurred()) return NULL;
    double target = q * (double)h->count;
    unsigned long long running = 0;
    for (Py_ssize_t i = 0; i <= h->n; i++) {
        running += h->counts[i];
        if ((double)running >= target && h->counts[i]) return PyFloat_FromDouble(i < h->n ? h->bounds[i] : INFINITY);
    }
    return PyFloat_FromDouble(NAN);
}

static PyObject *BucketHistogram_get_counts(BucketHistogram *h, void *Py_UNUSED(closure)) {
    PyObject *out = PyList_New(h->n + 1);
    for (Py_ssize_t i = 0; out != NULL && i <= h->n; i++) {
        PyObject *n = PyLong_FromUnsignedLongLong(h->counts[i]);
        if (n == NULL) Py_CLEAR(out); else PyList_SET_ITEM(out, i, n);
    }
    return out;
}

static PyObject *BucketHistogram_get_exemplars(BucketHistogram *h, void *Py_UNUSED(closure)) {
    PyObject *out = PyList_New(h->n + 1);
    for (Py_ssize_t i = 0; out != NULL && i <= h->n; i++)
        PyList_SET_ITEM(out, i, Py_NewRef(h->exemplars[i] != NULL ? h->exemplars[i] : Py_None));
    return out;
}

static PyObject *BucketHistogram_get_bounds(BucketHistogram *h, void *Py_UNUSED(closure)) {
    return Py_NewRef(h->bounds_tuple);
}

static PyObject *BucketHistogram_get_sum(BucketHistogram *h, void *Py_UNUSED(closure)) {
    return PyFloat_FromDouble(h->sum);
}

static PyObject *BucketHistogram_get_count(BucketHistogram *h, void *Py_UNUSED(closure)) {
    return PyLong_FromUnsignedLongLong(h->count);
}

static PyGetSetDef BucketHistogram_getset[] = {
    {"bounds", (getter)BucketHistogram_get_bounds, NULL, "the buckets' upper bounds (floats), +Inf left out", NULL},
    {"counts", (getter)BucketHistogram_get_counts, NULL, "per-bucket (not cumulative) counts, +Inf last: a copy", NULL},
    {"exemplars", (getter)BucketHistogram_get_exemplars, NULL, "the last exemplar of each bucket: a copy", NULL},
    {"sum", (getter)BucketHistogram_get_sum, NULL, "the sum of the values counted", NULL},
    {"count", (getter)BucketHistogram_get_count, NULL, "the values counted", NULL},
    {NULL}};

static PyMethodDef BucketHistogram_methods[] = {
    {"observe", (PyCFunction)(void (*)(void))BucketHistogram_observe, METH_FASTCALL,
     "observe(value, trace_id=None) -> bool: count a duration; False if refused (NaN)."},
    {"cumulative", (PyCFunction)BucketHistogram_cumulative, METH_NOARGS,
     "[(le, cumulative count, exemplar), ...] ending with +Inf, as exposition wants."},
    {"quantile", (PyCFunction)BucketHistogram_quantile, METH_O,
     "quantile(q): upper bound of the bucket holding quantile q; NaN when empty."},
    {NULL}};

static PyTypeObject BucketHistogramType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.BucketHistogram",
    .tp_doc = "BucketHistogram(bounds): C version of histogram.BucketHistogram.",
    .tp_basicsize = sizeof(BucketHistogram),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = BucketHistogram_new,
    .tp_traverse = (traverseproc)BucketHistogram_traverse,
    .tp_clear = (inquiry)BucketHistogram_clear,
    .tp_dealloc = (destructor)BucketHistogram_dealloc,
    .tp_methods = BucketHistogram_methods,
    .tp_getset = BucketHistogram_getset,
};

/* The sampling fields are Python objects (T_OBJECT_EX members) rather than C integers: the hot path's
 * Python code reads and writes them on every region, and CPython (3.11+) specialises attribute access
 * for object members as for a __slots__ attribute but not for integer members, which cost more per
 * ``op.entered += 1`` (docs/design.md, "The op state and histograms in C"). */
typedef struct {
    PyObject_HEAD
    PyObject *name, *owner, *period, *countdown, *entered, *always, *fixed;
    PyObject *bounds;  /* tuple: the bounds of the op's histograms */
    PyObject *hists;   /* dict: device -> BucketHistogram */
} OpState;

static PyObject *OpState_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"name", "period", "fixed", "bounds", NULL};
    PyObject *name, *period, *fixed, *bounds;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO", kwlist, &name, &period, &fixed, &bounds)) return NULL;
    OpState *op = (OpState *)type->tp_alloc(type, 0);
    if (op == NULL) return NULL;
    op->name = Py_NewRef(name);
    op->owner = Py_NewRef(Py_None);
    op->period = Py_NewRef(period);
    op->countdown = PyLong_FromLong(0);  /* the first region of every op is timed */
    op->entered = PyLong_FromLong(0);
    op->always = PyLong_FromLong(0);
    op->fixed = Py_NewRef(fixed);
    op->bounds = PySequence_Tuple(bounds);
    op->hists = PyDict_New();
    if (op->countdown == NULL || op->entered == NULL || op->always == NULL || op->bounds == NULL || op->hists == NULL) {
        Py_DECREF(op);
        return NULL;
    }
    return (PyObject *)op;
}

/* The histogram of ``device``, made on first use: a new reference, or NULL. */
static BucketHistogram *opstate_histogram(OpState *op, PyObject *device) {
    PyObject *hist = PyDict_GetItemWithError(op->hists, device);
    if (hist != NULL) {
        if (!Py_IS_TYPE(hist, &BucketHistogramType)) {
            PyErr_SetString(PyExc_TypeError, "OpState.hists holds something other than a BucketHistogram");
            return NULL;
        }
        return (BucketHistogram *)Py_NewRef(hist);
    }
    if (PyErr_Occurred() || (hist = histogram_new(op->bounds)) == NULL) return NULL;
    if (PyDict_SetItem(op->hists, device, hist) < 0) Py_CLEAR(hist);
    return (BucketHistogram *)hist;
}

/* One region's seconds on ``device`` into the op's histogram, as OpState.observe does: 1, 0 when
 * refused (NaN), or -1 with a Python error. The one place every C loop observes through. */
static int opstate_observe(OpState *op, PyObject *device, double seconds, PyObject *trace) {
    BucketHistogram *h = opstate_histogram(op, device);
    if (h == NULL) return -1;
    int rc = histogram_observe(h, seconds, trace);
    Py_DECREF(h);
    return rc;
}

/* op.entered += 1, as the Python hot path writes it. */
static int count_entered(OpState *op) {
    if (op->entered == NULL) {
        PyErr_SetString(PyExc_AttributeError, "OpState.entered was deleted");
        return -1;
    }
    PyObject *more = PyNumber_Add(op->entered, one);
    if (more == NULL) return -1;
    Py_SETREF(op->entered, more);
    return 0;
}

/* ``op`` if it is an OpState, else NULL with a TypeError naming ``where``. */
static OpState *as_op_state(PyObject *op, const char *where) {
    if (Py_IS_TYPE(op, &OpStateType)) return (OpState *)op;
    PyErr_Format(PyExc_TypeError, "%s: op must be the timer's OpState, not %.100s", where, Py_TYPE(op)->tp_name);
    return NULL;
}

static PyObject *OpState_histogram(OpState *op, PyObject *device) {
    return (PyObject *)opstate_histogram(op, device);
}

static PyObject *OpState_observe(OpState *op, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "observe(device, seconds, trace_id=None)");
        return NULL;
    }
    double seconds = PyFloat_AsDouble(args[1]);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    int rc = opstate_observe(op, args[0], seconds, nargs == 3 ? args[2] : NULL);
    return rc < 0 ? NULL : PyBool_FromLong(rc);
}

#define OP_STATE_OBJECTS(X) X(name) X(owner) X(period) X(countdown) X(entered) X(always) X(fixed) X(bounds) X(hists)
GC_FUNCTIONS(OpState, OP_STATE_OBJECTS)

static PyMethodDef OpState_methods[] = {
    {"histogram", (PyCFunction)OpState_histogram, METH_O,
     "histogram(device): the device's histogram (made on first use)."},
    {"observe", (PyCFunction)(void (*)(void))OpState_observe, METH_FASTCALL,
     "observe(device, seconds, trace_id=None) -> bool: one region's GPU seconds; False if refused (NaN)."},
    {NULL}};

static PyMemberDef OpState_members[] = {
    {"name", T_OBJECT_EX, offsetof(OpState, name), READONLY, NULL},
    {"owner", T_OBJECT_EX, offsetof(OpState, owner), 0,
     "the Instrumentation whose sampled passes count this op, if any"},
    {"period", T_OBJECT_EX, offsetof(OpState, period), 0, NULL},
    {"countdown", T_OBJECT_EX, offsetof(OpState, countdown), 0, NULL},
    {"entered", T_OBJECT_EX, offsetof(OpState, entered), 0, NULL},
    {"always", T_OBJECT_EX, offsetof(OpState, always), 0, "regions started with on_elapsed: timed every time"},
    {"fixed", T_OBJECT_EX, offsetof(OpState, fixed), 0, NULL},
    {"bounds", T_OBJECT_EX, offsetof(OpState, bounds), READONLY, NULL},
    {"hists", T_OBJECT_EX, offsetof(OpState, hists), READONLY, "device -> BucketHistogram"},
    {NULL}};

static PyTypeObject OpStateType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.OpState",
    .tp_doc = "OpState(name, period, fixed, bounds): C version of histogram.OpState.",
    .tp_basicsize = sizeof(OpState),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = OpState_new,
    .tp_traverse = (traverseproc)OpState_traverse,
    .tp_clear = (inquiry)OpState_clear,
    .tp_dealloc = (destructor)OpState_dealloc,
    .tp_methods = OpState_methods,
    .tp_members = OpState_members,
};


/* ------------------------------------------------------------------------------------------------ */
/* Recycler: a thread of its own, never holding the GIL, that reads finished pairs and gives their   */
/* events back every few milliseconds                                                                */
/*
 * Why a thread outside Python: the resolver, waking every 50 ms, kept hundreds of events in flight,
 * and waking it more often cost more GIL than it saved (docs/design.md). This thread polls
 * without the GIL (every hot.RECYCLE_INTERVAL_S), so only the events of the last interval are in
 * flight, and the inference thread's free list hands back the ones it recorded last. Polling much
 * more often cost the launch-bound workload throughput (docs/design.md, "The hot path in C", the
 * recycler), with no GIL involved: what is left to compete with the inference thread is this
 * thread's wake-ups and its CUDA calls on events the inference thread has just recorded.
 *
 * Three stages, each index written by one side only:
 *   tail  the hot path (GIL) wrote pairs[.. tail)
 *   read  the thread read pairs[.. read): elapsed time or error stored, events on the return queue
 *   head  the resolver (GIL, collect()) observed pairs[.. head) into histograms; slots are reused
 * The thread touches no Python object: it moves the pairs' event objects (and the references the
 * pairs held) onto the return queue, and the GIL side appends them to their free lists, which the
 * hot path keeps alive as long as itself (``lists``).
 *
 * A sequence's boundary is the end of one pair and the start of the next, so the thread keeps such
 * an end (END_KEEP -> END_KEPT). If the sequence's next region is lost (its boundary could not be
 * recorded, or the ring was full), the event must still come back after its pair is read: the GIL
 * side flips END_KEEP to END_GIVE, or, when the thread has read the pair already, gives it back
 * itself (release_shared). So only pairs with an op are ever queued here. */

typedef int (*set_device_fn_t)(int device);
typedef int (*capture_mode_fn_t)(int *mode);
#define CUDA_STREAM_CAPTURE_MODE_RELAXED 2
/* What becomes of a pair's end event when the thread reads the pair. */
enum { END_GIVE, END_KEEP, END_KEPT, END_NONE };
/* An idle thread (nothing queued) backs off to this many intervals between polls. */
#define IDLE_BACKOFF 16

typedef struct {
    PyObject *op, *device;
    PyObject *trace;          /* NULL when no trace was active */
    PyObject *start, *end;    /* moved to the return queue when given back */
    PyObject *free;           /* the device's free list (borrowed: the hot path keeps it alive) */
    void *start_event, *end_event, *stream;
    int device_index;
    atomic_int end_state;     /* END_GIVE or END_KEEP when queued; the thread turns KEEP into KEPT */
    int status;               /* written by the thread: 0, or the CUDA error that lost the pair */
    float ms;
} Pair;

typedef struct {
    PyObject *event;          /* the reference is the queue's */
    PyObject *free;           /* the device's free list (borrowed) */
} Returned;


typedef struct {
    Pair *pairs;
    size_t size;                       /* ring_size */
    atomic_size_t tail, read;
    size_t head;
    Returned *back;
    size_t back_size;
    atomic_size_t back_tail;           /* written by the thread */
    atomic_size_t back_head;           /* written by the GIL side */
    query_fn_t query;
    elapsed_fn_t elapsed;
    last_error_fn_t clear_error;
    set_device_fn_t set_device;
    capture_mode_fn_t capture_mode;
    long long interval_ns;
    pthread_t thread;
    pthread_mutex_t lock;              /* guards the fields below (never held during CUDA calls) */
    pthread_cond_t wake, done;
    int started;                       /* 0 not yet, 1 running, 2 stopped, -1 could not start */
    int stop, kicked, in_pass;
    long long passes;
    /* the thread's own */
    int current_device, relaxed;
    atomic_llong cpu_ns, reads;
} Recycler;

static long long thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Make ``device`` current on the thread. The first time, also exempt the thread from "global" graph
 * capture mode, which forbids event queries from any thread while an inference thread captures
 * (PyTorch's NCCL watchdog does the same); done after choosing the device, because the call opens a
 * context on the thread's current device, and a new thread's is device 0. */
static int use_device(Recycler *r, int device) {
    if (device == r->current_device) return 0;
    int err = r->set_device(device);
    if (err != 0) {
        r->clear_error();
        return err;
    }
    r->current_device = device;
    if (!r->relaxed && r->capture_mode != NULL) {
        int mode = CUDA_STREAM_CAPTURE_MODE_RELAXED;
        if (r->capture_mode(&mode) != 0) r->clear_error();
        r->relaxed = 1;
    }
    return 0;
}

/* Read what finished of pairs[read, tail): store each pair's elapsed time (or error), give its
 * events back. Stops at the first pair not finished: events are given back in record order. Returns
 * the number of pairs read; *idle is set when nothing was queued. */
static size_t advance(Recycler *r, int *idle) {
    size_t read = atomic_load_explicit(&r->read, memory_order_relaxed);
    size_t tail = atomic_load_explicit(&r->tail, memory_order_acquire);
    *idle = read == tail;
    if (read == tail) return 0;
    /* Events of one stream finish in order: when the newest pair has finished, so has every earlier
     * pair of its stream, and one query answers for them all. */
    size_t vouched = read;
    int voucher_device = -1;
    void *voucher_stream = NULL;
    Pair *newest = &r->pairs[(tail - 1) % r->size];
    if (use_device(r, newest->device_index) == 0) {
        int err = r->query(newest->end_event);
        if (err == 0) {
            vouched = tail;
            voucher_device = newest->device_index;
            voucher_stream = newest->stream;
        } else if (err != CUDA_ERROR_NOT_READY) {
            r->clear_error();
        }
    }
    size_t back_tail = atomic_load_explicit(&r->back_tail, memory_order_relaxed), start = read;
    for (; read < tail; read++) {
        Pair *p = &r->pairs[read % r->size];
        size_t back_head = atomic_load_explicit(&r->back_head, memory_order_acquire);
        if (back_tail + 2 - back_head > r->back_size) break;  /* the GIL side has not taken them back yet */
        int err = use_device(r, p->device_index);
        if (err == 0 && !(read < vouched && p->device_index == voucher_device && p->stream == voucher_stream)) {
            err = r->query(p->end_event);
            if (err == CUDA_ERROR_NOT_READY) break;
            if (err != 0) r->clear_error();
        }
        if (err == 0) {
            err = r->elapsed(&p->ms, p->start_event, p->end_event);
            if (err != 0) r->clear_error();  /* e.g. an event recorded under graph capture */
        }
        p->status = err;
        r->back[back_tail++ % r->back_size] = (Returned){p->start, p->free};
        p->start = NULL;
        int keep = END_KEEP;
        if (!atomic_compare_exchange_strong(&p->end_state, &keep, END_KEPT)) {  /* END_GIVE */
            r->back[back_tail++ % r->back_size] = (Returned){p->end, p->free};
            p->end = NULL;
        }
    }
    atomic_store_explicit(&r->back_tail, back_tail, memory_order_release);
    atomic_store_explicit(&r->read, read, memory_order_release);
    return read - start;
}

static void *recycler_main(void *arg) {
    Recycler *r = (Recycler *)arg;
    long long sleep_ns = r->interval_ns;
    pthread_mutex_lock(&r->lock);
    while (!r->stop) {
        r->in_pass = 1;
        pthread_mutex_unlock(&r->lock);
        long long c0 = thread_cpu_ns();
        int idle;
        size_t n = advance(r, &idle);
        atomic_fetch_add(&r->cpu_ns, thread_cpu_ns() - c0);
        atomic_fetch_add(&r->reads, (long long)n);
        /* Idle: back off, so a program that times nothing pays a few dozen wake-ups a second. */
        sleep_ns = idle ? (sleep_ns * 2 < r->interval_ns * IDLE_BACKOFF ? sleep_ns * 2 : r->interval_ns * IDLE_BACKOFF)
                        : r->interval_ns;
        pthread_mutex_lock(&r->lock);
        r->in_pass = 0;
        r->passes++;
        pthread_cond_broadcast(&r->done);
        if (r->stop) break;
        if (!r->kicked) {
            struct timespec until;
            clock_gettime(CLOCK_MONOTONIC, &until);
            long long ns = until.tv_nsec + sleep_ns;
            until.tv_sec += ns / 1000000000LL;
            until.tv_nsec = ns % 1000000000LL;
            pthread_cond_timedwait(&r->wake, &r->lock, &until);
        }
        r->kicked = 0;
    }
    pthread_mutex_unlock(&r->lock);
    return NULL;
}

static Recycler *recycler_new(Py_ssize_t ring_size, Py_ssize_t query, Py_ssize_t elapsed, Py_ssize_t clear,
                              Py_ssize_t set_device, Py_ssize_t capture_mode, double interval_s) {
    Recycler *r = PyMem_RawCalloc(1, sizeof(Recycler));
    if (r == NULL) return NULL;
    r->size = (size_t)ring_size;
    r->back_size = 2 * r->size + 2;
    r->pairs = PyMem_RawCalloc(r->size, sizeof(Pair));
    r->back = PyMem_RawCalloc(r->back_size, sizeof(Returned));
    pthread_condattr_t attr;
    if (r->pairs == NULL || r->back == NULL || pthread_condattr_init(&attr) != 0) goto fail;
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    int ok = pthread_mutex_init(&r->lock, NULL) == 0 && pthread_cond_init(&r->wake, &attr) == 0 &&
             pthread_cond_init(&r->done, &attr) == 0;
    pthread_condattr_destroy(&attr);
    if (!ok) goto fail;
    r->query = (query_fn_t)query;
    r->elapsed = (elapsed_fn_t)elapsed;
    r->clear_error = (last_error_fn_t)clear;
    r->set_device = (set_device_fn_t)set_device;
    r->capture_mode = (capture_mode_fn_t)capture_mode;
    r->interval_ns = (long long)(interval_s * 1e9);
    if (r->interval_ns < 10000) r->interval_ns = 10000;
    r->current_device = -1;
    return r;
fail:
    PyMem_RawFree(r->pairs);
    PyMem_RawFree(r->back);
    PyMem_RawFree(r);
    return NULL;
}

/* Start the thread (on the first pair, so a timer that times nothing runs none): 0, or -1. */
static int recycler_start(Recycler *r) {
    if (r->started != 0) return r->started == 1 ? 0 : -1;
    r->started = pthread_create(&r->thread, NULL, recycler_main, r) == 0 ? 1 : -1;
    return r->started == 1 ? 0 : -1;
}

/* Stop the thread and wait for it, the GIL released (in tests its CUDA calls are Python callbacks). */
static void recycler_stop(Recycler *r) {
    if (r->started != 1) return;
    pthread_mutex_lock(&r->lock);
    r->stop = 1;
    pthread_cond_signal(&r->wake);
    pthread_mutex_unlock(&r->lock);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(r->thread, NULL);
    Py_END_ALLOW_THREADS
    r->started = 2;
}

/* Wake the thread and wait (GIL released, at most timeout_s) until it has made a whole pass begun
 * after this call: 1 if it did, 0 if not (or no thread runs). */
static int recycler_pass(Recycler *r, double timeout_s) {
    if (r->started != 1) return 0;
    int passed = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    long long ns = until.tv_nsec + (long long)(timeout_s * 1e9);
    until.tv_sec += ns / 1000000000LL;
    until.tv_nsec = ns % 1000000000LL;
    pthread_mutex_lock(&r->lock);
    long long target = r->passes + (r->in_pass ? 2 : 1);
    r->kicked = 1;
    pthread_cond_signal(&r->wake);
    while (r->passes < target && !r->stop) {
        if (pthread_cond_timedwait(&r->done, &r->lock, &until) != 0) break;
    }
    passed = r->passes >= target;
    pthread_mutex_unlock(&r->lock);
    Py_END_ALLOW_THREADS
    return passed;
}

/* ------------------------------------------------------------------------------------------------ */
/* HotPath: record_start() and end(op, token, callback) of one TimerCore                            */

typedef struct {
    PyObject_HEAD
    PyObject *core;             /* the TimerCore: add_device, record_failed, record_captured */
    PyObject *pools;            /* dict: device -> list of free events */
    PyObject *ring;             /* collections.deque of Pending */
    PyObject *ring_append;      /* ring.append, bound once */
    Py_ssize_t ring_size;
    PyObject *dropped;          /* dict: reason -> count */
    PyObject *record;           /* route.record(event, stream) -> error code */
    record_fn_t record_fn;      /* cudaEventRecord itself, when the route gave its address */
    PyObject *current_device;   /* route.current_device() */
    PyObject *current_stream;   /* route.current_stream(device) */
    PyObject *trace_var;        /* the ContextVar of the active trace id */
    PyObject *captures;         /* capture.in_progress: [number of captures in progress] */
    PyObject *capturing;        /* route.is_capturing() */
    PyTypeObject *pending_type; /* core.Pending (a tuple subclass) */
    PyObject *graph_token_type; /* core.GraphToken */
    long long sampled;
    double hot_path_s;
    int measure_every;
    Recycler *recycler;         /* NULL: pairs go to ``ring`` for the resolver's loops */
    PyObject *lists;            /* every free list a pair in the recycler pointed to (kept alive) */
} HotPath;

static int bump(PyObject *dropped, PyObject *reason) {
    PyObject *old = PyDict_GetItemWithError(dropped, reason);
    if (old == NULL && PyErr_Occurred()) return -1;
    long long n = old ? PyLong_AsLongLong(old) : 0;
    PyObject *value = PyLong_FromLongLong(n + 1);
    if (value == NULL) return -1;
    int rc = PyDict_SetItem(dropped, reason, value);
    Py_DECREF(value);
    return rc;
}

/* A finished pair's seconds (elapsed minus baseline) into its op, which the hot path made sure is an
 * OpState: 1, 0 when refused (counted as an error), or -1 with a Python error. */
static int observe_pair(PyObject *op, PyObject *device, double seconds, PyObject *trace, PyObject *dropped) {
    int rc = opstate_observe((OpState *)op, device, seconds, trace);
    return rc == 0 && bump(dropped, s_error) < 0 ? -1 : rc;
}

/* Append the events the recycler gave back to their free lists: the last ones recorded end up
 * last, so they are the next ones popped. A failed append loses the event from circulation (it is
 * still destroyed with the pool). */
static void take_back(HotPath *h) {
    Recycler *r = h->recycler;
    if (r == NULL) return;
    size_t head = atomic_load_explicit(&r->back_head, memory_order_relaxed);
    size_t tail = atomic_load_explicit(&r->back_tail, memory_order_acquire);
    if (head == tail) return;
    for (; head < tail; head++) {
        Returned *b = &r->back[head % r->back_size];
        if (PyList_Append(b->free, b->event) < 0) PyErr_Clear();
        Py_DECREF(b->event);
    }
    atomic_store_explicit(&r->back_head, head, memory_order_release);
}

/* Whether plain pairs go to the recycler (it is configured and its thread has not failed or stopped). */
static int recycling(HotPath *h) {
    return h->recycler != NULL && (h->recycler->started == 0 || h->recycler->started == 1);
}

/* The free list of ``device``, made by core.add_device on first use (new reference). */
static PyObject *free_list(HotPath *h, PyObject *device) {
    take_back(h);
    PyObject *free = PyDict_GetItemWithError(h->pools, device);
    if (free != NULL) {
        Py_INCREF(free);
        return free;
    }
    if (PyErr_Occurred()) return NULL;
    free = PyObject_CallMethodOneArg(h->core, s_add_device, device);
    if (free != NULL && !PyList_Check(free)) {
        Py_DECREF(free);
        PyErr_SetString(PyExc_TypeError, "add_device must return the device's free list");
        return NULL;
    }
    return free;
}

/* Last event of a non-empty free list, removed from it (new reference). */
static PyObject *pop_event(PyObject *free) {
    Py_ssize_t n = PyList_GET_SIZE(free);
    PyObject *event = PyList_GET_ITEM(free, n - 1);
    Py_INCREF(event);
    if (PyList_SetSlice(free, n - 1, n, NULL) < 0) {
        Py_DECREF(event);
        return NULL;
    }
    return event;
}

/* Record ``event`` on ``stream``: 0 on success, a CUDA error code (> 0), or -1 with a Python error. */
static int record(HotPath *h, PyObject *event, PyObject *stream) {
    if (h->record_fn != NULL) {
        void *e = PyLong_AsVoidPtr(event);
        void *s = PyLong_AsVoidPtr(stream);
        if (PyErr_Occurred()) return -1;
        return h->record_fn(e, s);
    }
    PyObject *args[2] = {event, stream};
    PyObject *rc = PyObject_Vectorcall(h->record, args, 2, NULL);
    if (rc == NULL) return -1;
    long err = PyLong_AsLong(rc);
    Py_DECREF(rc);
    if (err == -1 && PyErr_Occurred()) return -1;
    return err ? (int)(err < 0 ? 1 : err) : 0;
}

static int record_failed(HotPath *h) {
    PyObject *rc = PyObject_CallMethodNoArgs(h->core, s_record_failed);
    if (rc == NULL) return -1;
    Py_DECREF(rc);
    return 0;
}

/* True (1) while the current stream captures a CUDA graph; asks CUDA only while some capture runs. */
static int capturing(HotPath *h) {
    PyObject *count = PyList_GET_ITEM(h->captures, 0);
    int some = PyObject_IsTrue(count);
    if (some <= 0) return some;
    PyObject *rc = PyObject_CallNoArgs(h->capturing);
    if (rc == NULL) return -1;
    int yes = PyObject_IsTrue(rc);
    Py_DECREF(rc);
    return yes;
}

static PyObject *current_device(HotPath *h) { return PyObject_CallNoArgs(h->current_device); }

static PyObject *current_stream(HotPath *h, PyObject *device) {
    return PyObject_CallOneArg(h->current_stream, device);
}

static PyObject *trace_id(HotPath *h) {
    PyObject *value = NULL;
    if (PyContextVar_Get(h->trace_var, Py_None, &value) < 0) return NULL;
    return value;
}

/* Pending(op, device, stream, start, end, trace_id, callback, keep_end), built without the
 * NamedTuple's Python-level __new__. Steals nothing; NULL arguments become None. */
static PyObject *pending(HotPath *h, PyObject *op, PyObject *device, PyObject *stream, PyObject *start,
                         PyObject *end, PyObject *trace, PyObject *callback, int keep_end) {
    PyObject *item = h->pending_type->tp_alloc(h->pending_type, 8);
    if (item == NULL) return NULL;
    PyObject *values[8] = {op, device, stream, start, end, trace, callback, keep_end ? Py_True : Py_False};
    for (int i = 0; i < 8; i++) {
        PyObject *v = values[i] ? values[i] : Py_None;
        Py_INCREF(v);
        PyTuple_SET_ITEM(item, i, v);
    }
    return item;
}

static int ring_push(HotPath *h, PyObject *item) {
    PyObject *rc = PyObject_CallOneArg(h->ring_append, item);
    Py_DECREF(item);
    if (rc == NULL) return -1;
    Py_DECREF(rc);
    return 0;
}

/* Pairs waiting in the ring a pair with (``python``) or without a callback goes to; -1 on error. */
static Py_ssize_t queued(HotPath *h, int python) {
    if (!python && recycling(h)) {
        Recycler *r = h->recycler;
        return (Py_ssize_t)(atomic_load_explicit(&r->tail, memory_order_relaxed) - r->head);
    }
    return PyObject_Size(h->ring);
}

/* Into the recycler's ring (the caller made sure it has room): the pair's position, or -1 with a
 * Python error. ``end`` is kept when it starts the sequence's next region. */
static Py_ssize_t recycler_push(HotPath *h, PyObject *op, PyObject *device, PyObject *stream, PyObject *start,
                                PyObject *end, PyObject *trace, int keep_end) {
    Recycler *r = h->recycler;
    size_t tail = atomic_load_explicit(&r->tail, memory_order_relaxed);
    int device_index = PyLong_AsLong(device);
    void *stream_ptr = PyLong_AsVoidPtr(stream), *start_event = PyLong_AsVoidPtr(start);
    void *end_event = PyLong_AsVoidPtr(end);
    if (PyErr_Occurred()) return -1;
    PyObject *free = PyDict_GetItemWithError(h->pools, device);
    if (free == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, device);
        return -1;
    }
    /* The return queue borrows free lists: keep each one alive (close_pools replaces them). The
     * list of them is short (one per device) and compared by identity, never by contents. */
    Py_ssize_t known = PyList_GET_SIZE(h->lists), i = 0;
    while (i < known && PyList_GET_ITEM(h->lists, i) != free) i++;
    if (i == known && PyList_Append(h->lists, free) < 0) return -1;
    Pair *p = &r->pairs[tail % r->size];
    p->op = Py_NewRef(op);
    p->device = Py_NewRef(device);
    p->trace = is_none(trace) ? NULL : Py_NewRef(trace);
    p->start = Py_NewRef(start);
    p->end = Py_NewRef(end);
    p->free = free;
    p->start_event = start_event;
    p->end_event = end_event;
    p->stream = stream_ptr;
    p->device_index = device_index;
    atomic_store_explicit(&p->end_state, keep_end ? END_KEEP : END_GIVE, memory_order_relaxed);
    p->status = 0;
    p->ms = 0.0f;
    atomic_store_explicit(&r->tail, tail + 1, memory_order_release);
    return (Py_ssize_t)tail;
}

/* Give back a sequence's open event, the end of the pair at ``position`` of the recycler's ring,
 * whose next region was lost: the thread gives it back as it reads the pair or, when it has read
 * it already, we do. 0, or -1 with a Python error. */
static int release_shared(HotPath *h, PyObject *event, PyObject *device, size_t position) {
    Recycler *r = h->recycler;
    if (r->head <= position) {  /* the pair is still in its slot */
        int keep = END_KEEP;
        if (atomic_compare_exchange_strong(&r->pairs[position % r->size].end_state, &keep, END_GIVE)) return 0;
    }
    PyObject *free = free_list(h, device);
    if (free == NULL) return -1;
    int rc = PyList_Append(free, event);
    Py_DECREF(free);
    return rc;
}

/* Queue a recorded pair with an op: to the recycler when it runs and the pair needs no Python (no
 * callback), else as a Pending on the ring the resolver's loops read. NULL arguments are None;
 * steals nothing. The pair's position in the recycler's ring, -2 on the Python ring, or -1 with a
 * Python error. */
static Py_ssize_t queue_pair(HotPath *h, PyObject *op, PyObject *device, PyObject *stream, PyObject *start,
                             PyObject *end, PyObject *trace, PyObject *callback, int keep_end) {
    if (callback == NULL && recycling(h)) {
        if (recycler_start(h->recycler) == 0)
            return recycler_push(h, op, device, stream, start, end, trace, keep_end);
        if (bump(h->dropped, s_error) < 0) return -1;  /* no thread: the resolver's loops take over */
    }
    PyObject *item = pending(h, op, device, stream, start, end, trace, callback, keep_end);
    return item == NULL || ring_push(h, item) < 0 ? -1 : -2;
}

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static PyObject *HotPath_record_start(HotPath *h, PyObject *Py_UNUSED(ignored)) {
    PyObject *device = current_device(h);
    if (device == NULL) return NULL;
    int cap = capturing(h);
    if (cap != 0) {
        PyObject *rc = cap < 0 ? NULL : PyObject_CallMethodOneArg(h->core, s_record_captured, device);
        Py_DECREF(device);
        return rc;
    }
    PyObject *free = free_list(h, device), *event = NULL, *stream = NULL, *token = NULL;
    if (free == NULL) goto done;
    if (PyList_GET_SIZE(free) == 0) {
        if (bump(h->dropped, s_pool_empty) == 0) token = Py_NewRef(Py_None);
        goto done;
    }
    if ((event = pop_event(free)) == NULL) goto done;
    if ((stream = current_stream(h, device)) == NULL) goto done;
    int err = record(h, event, stream);
    if (err != 0) {
        if (err > 0 && PyList_Append(free, event) == 0 && record_failed(h) == 0) token = Py_NewRef(Py_None);
        goto done;
    }
    token = PyTuple_Pack(3, event, device, stream);
done:
    Py_XDECREF(stream);
    Py_XDECREF(event);
    Py_XDECREF(free);
    Py_DECREF(device);
    return token;
}

static PyObject *HotPath_end(HotPath *h, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "end(op, token, callback)");
        return NULL;
    }
    PyObject *op = args[0], *token = args[1], *callback = args[2];
    if (as_op_state(op, "end()") == NULL) return NULL;  /* the C loops observe through its struct */
    if ((PyObject *)Py_TYPE(token) == h->graph_token_type) {
        PyObject *recorder = PyTuple_GET_ITEM(token, 3);
        PyObject *call_args[3] = {recorder, op, token};
        return PyObject_VectorcallMethod(s_end, call_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    }
    if (!PyTuple_Check(token) || PyTuple_GET_SIZE(token) != 3) {
        PyErr_SetString(PyExc_TypeError, "end(): token must be what record_start returned");
        return NULL;
    }
    PyObject *start = PyTuple_GET_ITEM(token, 0), *device = PyTuple_GET_ITEM(token, 1),
             *stream = PyTuple_GET_ITEM(token, 2);
    take_back(h);
    PyObject *free = PyDict_GetItemWithError(h->pools, device);
    if (free == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, device);
        return NULL;
    }
    Py_INCREF(free);
    PyObject *result = NULL, *end = NULL;
    h->sampled += 1;
    int measure = h->measure_every > 0 && h->sampled % h->measure_every == 0;
    long long t0 = measure ? now_ns() : 0;
    Py_ssize_t waiting = queued(h, callback != Py_None);
    if (waiting < 0) goto done;
    if (PyList_GET_SIZE(free) == 0 || waiting >= h->ring_size) {
        PyObject *reason = PyList_GET_SIZE(free) == 0 ? s_pool_empty : s_ring_full;
        if (PyList_Append(free, start) == 0 && bump(h->dropped, reason) == 0) result = Py_NewRef(Py_None);
        goto done;
    }
    if ((end = pop_event(free)) == NULL) goto done;
    int err = record(h, end, stream);
    if (err != 0) {
        if (err > 0 && PyList_Append(free, end) == 0 && PyList_Append(free, start) == 0 && record_failed(h) == 0)
            result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *trace = trace_id(h);
    if (trace == NULL) goto done;
    Py_ssize_t position = queue_pair(h, op, device, stream, start, end, trace, callback == Py_None ? NULL : callback, 0);
    Py_DECREF(trace);
    if (position == -1) goto done;
    if (measure) {
        /* One end costs about what one start costs (a record and a container op each). */
        double cost = 2e-9 * (double)(now_ns() - t0);
        h->hot_path_s = h->hot_path_s == 0.0 ? cost : 0.9 * h->hot_path_s + 0.1 * cost;
    }
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(end);
    Py_DECREF(free);
    return result;
}

static int HotPath_init(HotPath *h, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"core", "pools", "ring", "ring_size", "dropped", "record", "record_address",
                             "current_device", "current_stream", "trace_var", "captures", "capturing",
                             "pending_type", "graph_token_type", "measure_every", "recycler_addresses",
                             "recycle_interval_s", NULL};
    PyObject *core, *pools, *ring, *dropped, *rec, *dev, *stream, *trace, *captures, *cap, *pend, *graph;
    Py_ssize_t ring_size, address, query = 0, elapsed = 0, clear = 0, set_device = 0, capture_mode = 0;
    int measure_every;
    double interval_s;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$OO!OnO!OnOOOO!OO!Oi(nnnnn)d", kwlist, &core, &PyDict_Type,
                                     &pools, &ring, &ring_size, &PyDict_Type, &dropped, &rec, &address, &dev,
                                     &stream, &trace, &PyList_Type, &captures, &cap, &PyType_Type, &pend,
                                     &graph, &measure_every, &query, &elapsed, &clear, &set_device,
                                     &capture_mode, &interval_s))
        return -1;
    if (h->recycler != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "HotPath: already initialised");
        return -1;
    }
    /* All four CUDA functions and a positive interval, or no recycler (the capture-mode call is optional). */
    if (query && elapsed && clear && set_device && interval_s > 0.0 && ring_size > 0) {
        if ((h->lists = PyList_New(0)) == NULL) return -1;
        h->recycler = recycler_new(ring_size, query, elapsed, clear, set_device, capture_mode, interval_s);
        if (h->recycler == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    if (PyList_GET_SIZE(captures) < 1 || !PyType_IsSubtype((PyTypeObject *)pend, &PyTuple_Type) ||
        !PyContextVar_CheckExact(trace)) {
        PyErr_SetString(PyExc_TypeError, "HotPath: captures must be [count], pending_type a tuple "
                                         "subclass and trace_var a ContextVar");
        return -1;
    }
    PyObject *append = PyObject_GetAttr(ring, s_append);
    if (append == NULL) return -1;
    Py_XSETREF(h->ring_append, append);
    Py_XSETREF(h->core, Py_NewRef(core));
    Py_XSETREF(h->pools, Py_NewRef(pools));
    Py_XSETREF(h->ring, Py_NewRef(ring));
    Py_XSETREF(h->dropped, Py_NewRef(dropped));
    Py_XSETREF(h->record, Py_NewRef(rec));
    Py_XSETREF(h->current_device, Py_NewRef(dev));
    Py_XSETREF(h->current_stream, Py_NewRef(stream));
    Py_XSETREF(h->trace_var, Py_NewRef(trace));
    Py_XSETREF(h->captures, Py_NewRef(captures));
    Py_XSETREF(h->capturing, Py_NewRef(cap));
    Py_XSETREF(h->pending_type, (PyTypeObject *)Py_NewRef(pend));
    Py_XSETREF(h->graph_token_type, Py_NewRef(graph));
    h->ring_size = ring_size;
    h->record_fn = (record_fn_t)address;
    h->measure_every = measure_every;
    return 0;
}

#define HOTPATH_OBJECTS(X) X(core) X(pools) X(ring) X(ring_append) X(dropped) X(record) \
    X(current_device) X(current_stream) X(trace_var) X(captures) X(capturing) X(pending_type) X(graph_token_type) \
    X(lists)
GC_TRAVERSE_CLEAR(HotPath, HOTPATH_OBJECTS)

/* Stop the thread, then release every reference the recycler's pairs and return queue still hold. */
static void recycler_free(HotPath *h) {
    Recycler *r = h->recycler;
    if (r == NULL) return;
    recycler_stop(r);
    take_back(h);
    size_t tail = atomic_load(&r->tail);
    for (size_t i = r->head; i < tail; i++) {
        Pair *p = &r->pairs[i % r->size];
        Py_CLEAR(p->op);
        Py_CLEAR(p->device);
        Py_CLEAR(p->trace);
        Py_CLEAR(p->start);
        Py_CLEAR(p->end);
    }
    pthread_mutex_destroy(&r->lock);
    pthread_cond_destroy(&r->wake);
    pthread_cond_destroy(&r->done);
    PyMem_RawFree(r->pairs);
    PyMem_RawFree(r->back);
    PyMem_RawFree(r);
    h->recycler = NULL;
}

static void HotPath_dealloc(HotPath *self) {
    PyObject_GC_UnTrack(self);
    recycler_free(self);
    HotPath_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* collect(baselines) -> observed: the recycler's read pairs into their ops' histograms (elapsed time
 * minus baselines[device]), failed ones counted as errors; their slots are free again. */
static PyObject *HotPath_collect(HotPath *h, PyObject *baselines) {
    Recycler *r = h->recycler;
    if (!PyDict_Check(baselines)) {
        PyErr_SetString(PyExc_TypeError, "collect(baselines: dict)");
        return NULL;
    }
    Py_ssize_t observed = 0;
    if (r == NULL) return PyLong_FromSsize_t(0);
    size_t read = atomic_load_explicit(&r->read, memory_order_acquire);
    take_back(h);
    while (r->head < read) {
        Pair *p = &r->pairs[r->head % r->size];
        int rc = 0;
        if (p->status != 0) {
            rc = bump(h->dropped, s_error);
        } else {
            PyObject *b = PyDict_GetItemWithError(baselines, p->device);
            double seconds = 1e-3 * (double)p->ms - (b != NULL ? PyFloat_AsDouble(b) : 0.0);
            rc = PyErr_Occurred() ? -1 : observe_pair(p->op, p->device, seconds, p->trace, h->dropped);
            observed += rc == 1;
        }
        Py_CLEAR(p->op);
        Py_CLEAR(p->device);
        Py_CLEAR(p->trace);
        Py_CLEAR(p->end);  /* still here only when kept as the next region's start */
        r->head++;
        if (rc < 0) return NULL;  /* after moving on: a pair is never observed twice */
    }
    return PyLong_FromSsize_t(observed);
}

static PyObject *HotPath_recycle_pass(HotPath *h, PyObject *timeout) {
    double seconds = PyFloat_AsDouble(timeout);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(h->recycler != NULL && recycler_pass(h->recycler, seconds));
}

static PyObject *HotPath_stop_recycler(HotPath *h, PyObject *Py_UNUSED(ignored)) {
    if (h->recycler != NULL) recycler_stop(h->recycler);
    Py_RETURN_NONE;
}

static PyObject *HotPath_get_queued(HotPath *h, void *Py_UNUSED(closure)) {
    Recycler *r = h->recycler;
    return PyLong_FromSize_t(r == NULL ? 0 : atomic_load(&r->tail) - r->head);
}

static PyObject *HotPath_get_recycling(HotPath *h, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(recycling(h));
}

static PyObject *HotPath_get_recycler_cpu_s(HotPath *h, void *Py_UNUSED(closure)) {
    return PyFloat_FromDouble(h->recycler == NULL ? 0.0 : 1e-9 * (double)atomic_load(&h->recycler->cpu_ns));
}

static PyObject *HotPath_get_collected(HotPath *h, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(h->recycler == NULL ? 0 : h->recycler->head);
}

static PyGetSetDef HotPath_getset[] = {
    {"recycling", (getter)HotPath_get_recycling, NULL,
     "whether plain pairs go to the recycler thread (configured, and not failed to start or stopped)", NULL},
    {"queued", (getter)HotPath_get_queued, NULL, "pairs in the recycler's ring not yet collected", NULL},
    {"collected", (getter)HotPath_get_collected, NULL, "pairs collected from the recycler so far", NULL},
    {"recycler_cpu_s", (getter)HotPath_get_recycler_cpu_s, NULL, "CPU seconds the recycler thread used", NULL},
    {NULL}};

static PyMethodDef HotPath_methods[] = {
    {"record_start", (PyCFunction)HotPath_record_start, METH_NOARGS,
     "Record a region's start on the current device's stream; the token for end(), or None if dropped."},
    {"end", (PyCFunction)(void (*)(void))HotPath_end, METH_FASTCALL,
     "end(op, token, callback): record the region's end and queue the pair for the resolver."},
    {"collect", (PyCFunction)HotPath_collect, METH_O,
     "collect(baselines) -> observed: the recycler's read pairs into histograms."},
    {"recycle_pass", (PyCFunction)HotPath_recycle_pass, METH_O,
     "recycle_pass(timeout_s) -> bool: wake the recycler and wait for one whole pass."},
    {"stop_recycler", (PyCFunction)HotPath_stop_recycler, METH_NOARGS,
     "Stop the recycler thread (later pairs go to the ring)."},
    {NULL}};

static PyMemberDef HotPath_members[] = {
    {"sampled", T_LONGLONG, offsetof(HotPath, sampled), READONLY, "pairs ended through end()"},
    {"hot_path_s", T_DOUBLE, offsetof(HotPath, hot_path_s), READONLY,
     "CPU seconds of a sampled region, measured in context every measure_every pairs"},
    {"ring_size", T_PYSSIZET, offsetof(HotPath, ring_size), READONLY, NULL},
    {NULL}};

static PyTypeObject HotPathType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.HotPath",
    .tp_doc = "The hot path of one TimerCore (C version of hot.PyHotPath).",
    .tp_basicsize = sizeof(HotPath),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)HotPath_init,
    .tp_traverse = (traverseproc)HotPath_traverse,
    .tp_clear = (inquiry)HotPath_clear,
    .tp_dealloc = (destructor)HotPath_dealloc,
    .tp_methods = HotPath_methods,
    .tp_members = HotPath_members,
    .tp_getset = HotPath_getset,
};

/* ------------------------------------------------------------------------------------------------ */
/* SequenceBase: the state of a Sequence and its split() / _close_open(); sequence.py adds the rest   */

typedef struct {
    PyObject_HEAD
    PyObject *core, *hot, *pass_, *op, *event, *device, *stream, *recorder;
    char shared, active;
    Py_ssize_t shared_at;  /* when shared: the position in the recycler's ring of the pair whose end is ``event`` */
} SequenceBase;

static HotPath *seq_hot(SequenceBase *s) {
    if (s->hot == NULL || !PyObject_TypeCheck(s->hot, &HotPathType)) {
        PyErr_SetString(PyExc_TypeError, "the sequence's _hot must be the core's C HotPath");
        return NULL;
    }
    return (HotPath *)s->hot;
}

/* Append ``event`` to the free list of ``device``: 0, or -1 with a Python error. */
static int give_back(HotPath *h, PyObject *device, PyObject *event) {
    PyObject *free = free_list(h, device);
    if (free == NULL) return -1;
    int rc = PyList_Append(free, event);
    Py_DECREF(free);
    return rc;
}

/* The open region is lost: give its start back, at once or, when it is the end of a queued pair,
 * once that pair is read (on the Python ring, a pair without an op releases it in order). */
static int release_open(SequenceBase *s, HotPath *h) {
    if (!s->shared) return give_back(h, s->device, s->event);
    if (s->shared_at >= 0 && h->recycler != NULL) return release_shared(h, s->event, s->device, (size_t)s->shared_at);
    PyObject *item = pending(h, NULL, s->device, s->stream, s->event, NULL, NULL, NULL, 0);
    return item == NULL ? -1 : ring_push(h, item);
}

/* Queue (open start -> end): 1 when ``end`` is now shared with a queued pair, 0 if not, -1 on error.
 * A start that is the end of an earlier queued pair may be re-recorded only after that pair is
 * resolved (release_open). */
static int close_open(SequenceBase *s, HotPath *h, PyObject *end, int last) {
    if (is_none(s->op)) return 0;
    PyObject *op = s->op;  /* our reference now */
    s->op = Py_NewRef(Py_None);
    int rc = -1;
    if (is_none(end)) {
        rc = release_open(s, h);
        goto out;
    }
    Py_ssize_t waiting = queued(h, 0);
    if (waiting < 0) goto out;
    if (waiting >= h->ring_size) {
        if (bump(h->dropped, s_ring_full) < 0) goto out;
        if (recycling(h)) {  /* nothing is queued; ``end`` starts the next region unshared */
            if (release_open(s, h) < 0 || (last && give_back(h, s->device, end) < 0)) goto out;
            rc = 0;
            goto out;
        }
        Py_SETREF(op, Py_NewRef(Py_None));  /* on the Python ring, dropped pairs still release in order */
    }
    PyObject *trace = trace_id(h);
    if (trace == NULL) goto out;
    Py_ssize_t position = queue_pair(h, op, s->device, s->stream, s->event, end, trace, NULL, !last);
    Py_DECREF(trace);
    if (position == -1) goto out;
    s->shared_at = position;  /* -2: on the Python ring */
    rc = !last;
out:
    Py_DECREF(op);
    return rc;
}

static PyObject *Sequence_close_open(SequenceBase *s, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "_close_open(end, last=False)");
        return NULL;
    }
    HotPath *h = seq_hot(s);
    if (h == NULL) return NULL;
    int last = nargs == 2 ? PyObject_IsTrue(args[1]) : 0;
    if (last < 0) return NULL;
    int rc = close_open(s, h, args[0], last);
    if (rc < 0) return NULL;
    return PyBool_FromLong(rc);
}

/* The lost-boundary path of split(): the open region cannot be closed. */
static PyObject *split_lost(SequenceBase *s, HotPath *h) {
    return close_open(s, h, Py_None, 0) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *Sequence_split(SequenceBase *s, PyObject *arg) {
    HotPath *h = seq_hot(s);
    if (h == NULL) return NULL;
    PyObject *op;
    if (PyUnicode_Check(arg)) {
        if ((op = PyObject_CallMethodOneArg(s->core, s_op_state, arg)) == NULL) return NULL;
    } else {
        op = Py_NewRef(arg);
    }
    PyObject *result = NULL, *device = NULL, *free = NULL, *event = NULL, *stream = NULL;
    OpState *state = as_op_state(op, "split()");
    if (state == NULL || count_entered(state) < 0) goto done;
    if (!s->active) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if ((device = current_device(h)) == NULL) goto done;
    if (!is_none(s->recorder)) {
        PyObject *call_args[3] = {(PyObject *)s, op, device};
        result = PyObject_VectorcallMethod(s_split_captured, call_args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                           NULL);
        goto done;
    }
    if ((free = free_list(h, device)) == NULL) goto done;
    if (PyList_GET_SIZE(free) == 0) {
        if (bump(h->dropped, s_pool_empty) == 0) result = split_lost(s, h);
        goto done;
    }
    if ((event = pop_event(free)) == NULL) goto done;
    if ((stream = current_stream(h, device)) == NULL) goto done;
    int err = record(h, event, stream);
    if (err != 0) {
        if (err > 0 && PyList_Append(free, event) == 0 && record_failed(h) == 0) result = split_lost(s, h);
        goto done;
    }
    int shared = close_open(s, h, event, 0);
    if (shared < 0) goto done;
    s->shared = (char)shared;
    Py_SETREF(s->op, Py_NewRef(op));
    Py_XSETREF(s->event, Py_NewRef(event));
    Py_XSETREF(s->device, Py_NewRef(device));
    Py_XSETREF(s->stream, Py_NewRef(stream));
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(stream);
    Py_XDECREF(event);
    Py_XDECREF(free);
    Py_XDECREF(device);
    Py_DECREF(op);
    return result;
}

#define SEQUENCE_OBJECTS(X) X(core) X(hot) X(pass_) X(op) X(event) X(device) X(stream) X(recorder)
GC_FUNCTIONS(SequenceBase, SEQUENCE_OBJECTS)

static PyMethodDef Sequence_methods[] = {
    {"split", (PyCFunction)Sequence_split, METH_O,
     "End the open region (if any) and start op's at this point of the stream."},
    {"_close_open", (PyCFunction)(void (*)(void))Sequence_close_open, METH_FASTCALL,
     "_close_open(end, last=False): queue (open start -> end); True when end is now shared."},
    {NULL}};

static PyMemberDef Sequence_members[] = {
    {"_core", T_OBJECT, offsetof(SequenceBase, core), 0, NULL},
    {"_hot", T_OBJECT, offsetof(SequenceBase, hot), 0, NULL},
    {"_pass", T_OBJECT, offsetof(SequenceBase, pass_), 0, NULL},
    {"_op", T_OBJECT, offsetof(SequenceBase, op), 0, NULL},
    {"_event", T_OBJECT, offsetof(SequenceBase, event), 0, NULL},
    {"_device", T_OBJECT, offsetof(SequenceBase, device), 0, NULL},
    {"_stream", T_OBJECT, offsetof(SequenceBase, stream), 0, NULL},
    {"_recorder", T_OBJECT, offsetof(SequenceBase, recorder), 0, NULL},
    {"_shared", T_BOOL, offsetof(SequenceBase, shared), 0, NULL},
    {"active", T_BOOL, offsetof(SequenceBase, active), 0, NULL},
    {NULL}};

static PyTypeObject SequenceBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.SequenceBase",
    .tp_doc = "State and hot path of a Sequence (C version of hot.PySequenceBase).",
    .tp_basicsize = sizeof(SequenceBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)SequenceBase_traverse,
    .tp_clear = (inquiry)SequenceBase_clear,
    .tp_dealloc = (destructor)SequenceBase_dealloc,
    .tp_methods = Sequence_methods,
    .tp_members = Sequence_members,
};

/* ------------------------------------------------------------------------------------------------ */
/* ExactForward and SplitForward: the per-module forwards instrument() puts in place on a sampled   */
/* pass (instrument.py's _exact_forward and _split_forward), passing the module's arguments through */
/* to its own forward without packing them                                                          */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *hot;      /* the core's C HotPath */
    PyObject *op;       /* the module's OpState */
    PyObject *original; /* the module's own forward */
} ExactForward;

static PyObject *ExactForward_vectorcall(ExactForward *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    if (count_entered((OpState *)f->op) < 0) return NULL;
    HotPath *h = (HotPath *)f->hot;
    PyObject *token = HotPath_record_start(h, NULL);
    if (token == NULL) return NULL;
    if (token == Py_None) {
        Py_DECREF(token);
        return PyObject_Vectorcall(f->original, args, nargsf, kwnames);
    }
    PyObject *result = PyObject_Vectorcall(f->original, args, nargsf, kwnames);
    PyObject *type, *value, *traceback;  /* try/finally: the region ends, then any error goes on */
    PyErr_Fetch(&type, &value, &traceback);
    PyObject *end_args[3] = {f->op, token, Py_None};
    PyObject *ended = HotPath_end(h, end_args, 3);
    Py_DECREF(token);
    if (ended == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        Py_XDECREF(result);
        return NULL;
    }
    Py_DECREF(ended);
    PyErr_Restore(type, value, traceback);
    return result;
}

static int ExactForward_init(ExactForward *f, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"hot", "op", "original", NULL};
    PyObject *hot_path, *op, *original;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O", kwlist, &HotPathType, &hot_path, &OpStateType, &op,
                                     &original))
        return -1;
    Py_XSETREF(f->hot, Py_NewRef(hot_path));
    Py_XSETREF(f->op, Py_NewRef(op));
    Py_XSETREF(f->original, Py_NewRef(original));
    f->vectorcall = (vectorcallfunc)ExactForward_vectorcall;
    return 0;
}

#define EXACT_FORWARD_OBJECTS(X) X(hot) X(op) X(original)
GC_FUNCTIONS(ExactForward, EXACT_FORWARD_OBJECTS)

static PyTypeObject ExactForwardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.ExactForward",
    .tp_doc = "ExactForward(hot, op, original): original(...) timed as one region of op.",
    .tp_basicsize = sizeof(ExactForward),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(ExactForward, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ExactForward_init,
    .tp_traverse = (traverseproc)ExactForward_traverse,
    .tp_clear = (inquiry)ExactForward_clear,
    .tp_dealloc = (destructor)ExactForward_dealloc,
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *local;    /* the instrumentation's threading.local: .seq is this thread's sequence */
    PyObject *get_seq;  /* makes this thread's sequence */
    PyObject *op;
    PyObject *original;
} SplitForward;

static PyObject *SplitForward_vectorcall(SplitForward *f, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    PyObject *seq = PyObject_GetAttr(f->local, s_seq);
    if (seq == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
        PyErr_Clear();
        if ((seq = PyObject_CallNoArgs(f->get_seq)) == NULL) return NULL;
    }
    PyObject *split = PyObject_TypeCheck(seq, &SequenceBaseType) ? Sequence_split((SequenceBase *)seq, f->op)
                                                                   : PyObject_CallMethodOneArg(seq, s_split, f->op);
    Py_DECREF(seq);
    if (split == NULL) return NULL;
    Py_DECREF(split);
    return PyObject_Vectorcall(f->original, args, nargsf, kwnames);
}

static int SplitForward_init(SplitForward *f, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"local", "get_seq", "op", "original", NULL};
    PyObject *local, *get_seq, *op, *original;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO", kwlist, &local, &get_seq, &op, &original)) return -1;
    Py_XSETREF(f->local, Py_NewRef(local));
    Py_XSETREF(f->get_seq, Py_NewRef(get_seq));
    Py_XSETREF(f->op, Py_NewRef(op));
    Py_XSETREF(f->original, Py_NewRef(original));
    f->vectorcall = (vectorcallfunc)SplitForward_vectorcall;
    return 0;
}

#define SPLIT_FORWARD_OBJECTS(X) X(local) X(get_seq) X(op) X(original)
GC_FUNCTIONS(SplitForward, SPLIT_FORWARD_OBJECTS)

static PyTypeObject SplitForwardType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.SplitForward",
    .tp_doc = "SplitForward(local, get_seq, op, original): split this thread's sequence to op, then original(...).",
    .tp_basicsize = sizeof(SplitForward),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(SplitForward, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SplitForward_init,
    .tp_traverse = (traverseproc)SplitForward_traverse,
    .tp_clear = (inquiry)SplitForward_clear,
    .tp_dealloc = (destructor)SplitForward_dealloc,
};

/* ------------------------------------------------------------------------------------------------ */
/* RegionMarks and MarkTable: the region markers of compiled models (compiled.py). Inductor's Python */
/* wrapper code calls the MarkTable directly at each marker (fusion.py rewrites the line it emits    */
/* for the marker op), so a marker costs one C call: no op dispatch, no Python frame.                */

/* Where two markers touch (no kernel emitted between them: compiled.py decides per graph), the later
 * one records no event of its own but reuses the earlier one's. The earlier marker is always an end,
 * so the shared event is the end of a queued pair, kept (END_KEEP / keep_end) until the later pair
 * that uses it (as its end, or as its start) is read, exactly as a Sequence's boundary is. An action
 * is (group, op) or (group, op, reuse_from, keep): ``reuse_from`` the slot (2 x index + is_end) whose
 * event this marker reuses, or -1; ``keep`` whether a later marker reuses this end's event. */
#define OWNED (-3)  /* a boundary or start event in no queued pair: ours to give back */

typedef struct {
    PyObject_HEAD
    PyObject *hot;        /* the core's C HotPath */
    PyObject *actions;    /* list, two per region (start, end): None, or (group, op[, reuse_from, keep]) */
    PyObject *tokens;     /* list, one per region: the open start token of the group it roots, or None */
    PyObject *captured;   /* captured(index, is_end): a marker met while a CUDA graph is captured */
    PyObject *bnd_event, *bnd_device, *bnd_stream;  /* the last end's event, kept for the next marker */
    Py_ssize_t bnd_pos;   /* its pair's position (recycler's ring >= 0, Python ring -2) */
    Py_ssize_t bnd_at;    /* the slot that recorded or last used it */
    unsigned long owner;  /* the thread whose pass is timed; 0 while none is */
    long long eager_marks, stray_marks, records;
} RegionMarks;

static PyTypeObject RegionMarksType;

/* Give back an event that is the end of the queued pair at ``pos`` (kept for a later pair that will
 * not come) or, with ``pos`` OWNED, in no pair at all. 0, or -1 with a Python error. */
static int release_event(HotPath *h, PyObject *event, PyObject *device, PyObject *stream, Py_ssize_t pos) {
    if (pos == OWNED) return give_back(h, device, event);
    if (pos >= 0 && h->recycler != NULL) return release_shared(h, event, device, (size_t)pos);
    PyObject *item = pending(h, NULL, device, stream, event, NULL, NULL, NULL, 0);
    return item == NULL ? -1 : ring_push(h, item);
}

/* Token of a start: (event, device, stream) recorded by it, or (event, device, stream, pos) reused
 * from the end of the queued pair at ``pos``. */
static Py_ssize_t token_pos(PyObject *token) {
    if (PyTuple_GET_SIZE(token) != 4) return OWNED;
    return PyLong_AsSsize_t(PyTuple_GET_ITEM(token, 3));
}

/* A start token that will never be ended: its event goes back (0, or -1). */
static int drop_token(HotPath *h, PyObject *token) {
    if (!PyTuple_CheckExact(token) || PyTuple_GET_SIZE(token) < 3) return 0;
    Py_ssize_t pos = token_pos(token);
    if (pos == -1 && PyErr_Occurred()) return -1;
    return release_event(h, PyTuple_GET_ITEM(token, 0), PyTuple_GET_ITEM(token, 1), PyTuple_GET_ITEM(token, 2), pos);
}

/* Set tokens[group] to ``token`` (a new reference, stolen), giving back a start left open there. */
static int put_token(RegionMarks *m, Py_ssize_t group, PyObject *token) {
    PyObject *old = PyList_GET_ITEM(m->tokens, group);
    PyList_SET_ITEM(m->tokens, group, token);
    int rc = is_none(old) ? 0 : drop_token((HotPath *)m->hot, old);
    Py_XDECREF(old);
    return rc;
}

/* The kept boundary event, if any, given back (no marker will reuse it). 0, or -1. */
static int release_boundary(RegionMarks *m) {
    if (m->bnd_event == NULL) return 0;
    PyObject *event = m->bnd_event, *device = m->bnd_device, *stream = m->bnd_stream;
    m->bnd_event = m->bnd_device = m->bnd_stream = NULL;
    int rc = release_event((HotPath *)m->hot, event, device, stream, m->bnd_pos);
    Py_DECREF(event);
    Py_DECREF(device);
    Py_DECREF(stream);
    return rc;
}

/* End a group: record its end (or reuse the kept boundary) and queue the pair, keeping the end for
 * the next marker when ``keep``. Steals ``token``. 0, or -1 with a Python error. */
static int marks_end(RegionMarks *m, PyObject *op, PyObject *token, Py_ssize_t at, int reuse, int keep) {
    HotPath *h = (HotPath *)m->hot;
    int rc = -1;
    PyObject *end = NULL, *free = NULL;
    Py_ssize_t end_pos = OWNED;
    if (as_op_state(op, "end()") == NULL || !PyTuple_Check(token) || PyTuple_GET_SIZE(token) < 3) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "end(): not a start token");
        drop_token(h, token);
        Py_DECREF(token);
        return -1;
    }
    PyObject *start = PyTuple_GET_ITEM(token, 0), *device = PyTuple_GET_ITEM(token, 1),
             *stream = PyTuple_GET_ITEM(token, 2);
    if (reuse && m->bnd_event != NULL) {
        int same = PyObject_RichCompareBool(m->bnd_stream, stream, Py_EQ);
        if (same < 0) goto done;
        if (same > 0) same = PyObject_RichCompareBool(m->bnd_device, device, Py_EQ);
        if (same < 0) goto done;
        if (same > 0) {
            end = m->bnd_event;
            end_pos = m->bnd_pos;
            Py_CLEAR(m->bnd_device);
            Py_CLEAR(m->bnd_stream);
            m->bnd_event = NULL;
        }
    }
    if (release_boundary(m) < 0) goto done;
    take_back(h);
    free = PyDict_GetItemWithError(h->pools, device);
    if (free == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, device);
        goto done;
    }
    Py_INCREF(free);
    Py_ssize_t waiting = queued(h, 0);
    if (waiting < 0) goto done;
    if (waiting >= h->ring_size || (end == NULL && PyList_GET_SIZE(free) == 0)) {
        if (bump(h->dropped, waiting >= h->ring_size ? s_ring_full : s_pool_empty) < 0) goto done;
        if (drop_token(h, token) < 0) goto done;
        if (end != NULL && release_event(h, end, device, stream, end_pos) < 0) goto done;
        rc = 0;
        goto done;
    }
    if (end == NULL) {
        if ((end = pop_event(free)) == NULL) goto done;
        int err = record(h, end, stream);
        if (err != 0) {
            if (err > 0 && PyList_Append(free, end) == 0 && drop_token(h, token) == 0 && record_failed(h) == 0) rc = 0;
            goto done;
        }
        m->records++;
    }
    PyObject *trace = trace_id(h);
    if (trace == NULL) goto done;
    Py_ssize_t position = queue_pair(h, op, device, stream, start, end, trace, NULL, keep);
    Py_DECREF(trace);
    if (position == -1) goto done;
    if (keep) {
        m->bnd_event = end;
        end = NULL;
        m->bnd_device = Py_NewRef(device);
        m->bnd_stream = Py_NewRef(stream);
        m->bnd_pos = position;
        m->bnd_at = at;
    }
    rc = 0;
done:
    Py_XDECREF(end);
    Py_XDECREF(free);
    Py_DECREF(token);
    return rc;
}

/* One marker: what regions.mark(index, is_end) does. 0, or -1 with a Python error. */
static int marks_mark(RegionMarks *m, Py_ssize_t index, int is_end) {
    if (m->hot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RegionMarks: not initialised");
        return -1;
    }
    if (PyThread_get_thread_ident() != m->owner) {
        m->stray_marks++;
        return 0;
    }
    HotPath *h = (HotPath *)m->hot;
    int cap = capturing(h);
    if (cap != 0) {
        if (cap < 0) return -1;
        PyObject *rc = PyObject_CallFunction(m->captured, "ni", index, is_end);
        Py_XDECREF(rc);
        return rc == NULL ? -1 : 0;
    }
    m->eager_marks++;
    Py_ssize_t at = 2 * index + is_end;
    if (at < 0 || at >= PyList_GET_SIZE(m->actions)) return 0;
    PyObject *action = PyList_GET_ITEM(m->actions, at);
    Py_ssize_t size = PyTuple_Check(action) ? PyTuple_GET_SIZE(action) : 0;
    if (size != 2 && size != 4) return 0;  /* inside a merged group */
    Py_ssize_t group = PyLong_AsSsize_t(PyTuple_GET_ITEM(action, 0));
    if (group == -1 && PyErr_Occurred()) return -1;
    if (group < 0 || group >= PyList_GET_SIZE(m->tokens)) return 0;
    Py_ssize_t reuse_from = -1;
    int keep = 0;
    if (size == 4) {
        reuse_from = PyLong_AsSsize_t(PyTuple_GET_ITEM(action, 2));
        keep = PyObject_IsTrue(PyTuple_GET_ITEM(action, 3));
        if ((reuse_from == -1 && PyErr_Occurred()) || keep < 0) return -1;
    }
    /* the kept event serves this marker only if the marker that kept it ran last */
    int reuse = reuse_from >= 0 && m->bnd_event != NULL && m->bnd_at == reuse_from;
    if (!reuse && release_boundary(m) < 0) return -1;
    if (!is_end) {
        PyObject *token;
        if (reuse) {
            PyObject *pos = PyLong_FromSsize_t(m->bnd_pos);
            if (pos == NULL) return -1;
            token = PyTuple_Pack(4, m->bnd_event, m->bnd_device, m->bnd_stream, pos);
            Py_DECREF(pos);
            if (token == NULL) return -1;
            Py_CLEAR(m->bnd_event);
            Py_CLEAR(m->bnd_device);
            Py_CLEAR(m->bnd_stream);
        } else {
            token = HotPath_record_start(h, NULL);
            if (token == NULL) return -1;
            if (PyTuple_Check(token)) m->records++;
        }
        return put_token(m, group, token);
    }
    PyObject *token = PyList_GET_ITEM(m->tokens, group);
    if (is_none(token)) return release_boundary(m);
    PyList_SET_ITEM(m->tokens, group, Py_NewRef(Py_None));  /* the list's reference is ours now */
    Py_INCREF(action);  /* the op stays alive while end() may run Python */
    int rc;
    if ((PyObject *)Py_TYPE(token) == h->graph_token_type) {  /* a captured region's (graphs.py) */
        PyObject *end_args[3] = {PyTuple_GET_ITEM(action, 1), token, Py_None};
        PyObject *ended = HotPath_end(h, end_args, 3);
        Py_XDECREF(ended);
        Py_DECREF(token);
        rc = ended == NULL ? -1 : 0;
    } else {
        rc = marks_end(m, PyTuple_GET_ITEM(action, 1), token, at, reuse, keep);
    }
    Py_DECREF(action);
    return rc;
}

static PyObject *RegionMarks_mark(RegionMarks *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mark(index, is_end)");
        return NULL;
    }
    Py_ssize_t index = PyLong_AsSsize_t(args[0]);
    int is_end = PyObject_IsTrue(args[1]);
    if ((index == -1 && PyErr_Occurred()) || is_end < 0) return NULL;
    return marks_mark(m, index, is_end) < 0 ? NULL : Py_NewRef(Py_None);
}

/* Starts left open by the last pass, and a boundary kept for a marker that never ran, give their
 * events back (a pass that raised half-way). */
static int clear_tokens(RegionMarks *m) {
    int rc = 0;
    if (m->tokens == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "RegionMarks: not initialised");
        return -1;
    }
    if (release_boundary(m) < 0) rc = -1;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(m->tokens); i++)
        if (!is_none(PyList_GET_ITEM(m->tokens, i)) && put_token(m, i, Py_NewRef(Py_None)) < 0) rc = -1;
    return rc;
}

static PyObject *RegionMarks_arm(RegionMarks *m, PyObject *Py_UNUSED(ignored)) {
    m->owner = PyThread_get_thread_ident();
    m->eager_marks = 0;
    m->records = 0;
    return clear_tokens(m) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *RegionMarks_disarm(RegionMarks *m, PyObject *Py_UNUSED(ignored)) {
    m->owner = 0;
    return clear_tokens(m) < 0 ? NULL : Py_NewRef(Py_None);
}

static int RegionMarks_init(RegionMarks *m, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"hot", "regions", "captured", NULL};
    PyObject *hot_path, *captured;
    Py_ssize_t n;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!nO", kwlist, &HotPathType, &hot_path, &n, &captured))
        return -1;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "RegionMarks: regions must be >= 0");
        return -1;
    }
    PyObject *actions = PyList_New(2 * n), *tokens = PyList_New(n);
    if (actions == NULL || tokens == NULL) {
        Py_XDECREF(actions);
        Py_XDECREF(tokens);
        return -1;
    }
    for (Py_ssize_t i = 0; i < 2 * n; i++) PyList_SET_ITEM(actions, i, Py_NewRef(Py_None));
    for (Py_ssize_t i = 0; i < n; i++) PyList_SET_ITEM(tokens, i, Py_NewRef(Py_None));
    Py_XSETREF(m->hot, Py_NewRef(hot_path));
    Py_XSETREF(m->actions, actions);
    Py_XSETREF(m->tokens, tokens);
    Py_XSETREF(m->captured, Py_NewRef(captured));
    m->owner = 0;
    return 0;
}

static int RegionMarks_set_actions(RegionMarks *m, PyObject *value, void *Py_UNUSED(closure)) {
    if (value == NULL || !PyList_CheckExact(value) || PyList_GET_SIZE(value) != 2 * PyList_GET_SIZE(m->tokens)) {
        PyErr_SetString(PyExc_TypeError, "actions: a list of two entries per region");
        return -1;
    }
    Py_XSETREF(m->actions, Py_NewRef(value));
    return 0;
}

static PyObject *RegionMarks_get_actions(RegionMarks *m, void *Py_UNUSED(closure)) {
    return Py_NewRef(m->actions);
}

static PyObject *RegionMarks_get_armed(RegionMarks *m, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(m->owner != 0);
}

#define REGION_MARKS_OBJECTS(X) X(hot) X(actions) X(tokens) X(captured) X(bnd_event) X(bnd_device) X(bnd_stream)
GC_FUNCTIONS(RegionMarks, REGION_MARKS_OBJECTS)

static PyMethodDef RegionMarks_methods[] = {
    {"mark", (PyCFunction)(void (*)(void))RegionMarks_mark, METH_FASTCALL,
     "mark(index, is_end): a marker of region ``index`` ran (its start, or its end)"},
    {"arm", (PyCFunction)RegionMarks_arm, METH_NOARGS,
     "a timed pass begins on this thread: its markers record, other threads' are stray"},
    {"disarm", (PyCFunction)RegionMarks_disarm, METH_NOARGS, "the timed pass is over"},
    {NULL}};

static PyMemberDef RegionMarks_members[] = {
    {"eager_marks", T_LONGLONG, offsetof(RegionMarks, eager_marks), 0,
     "markers of the armed pass that ran from Python (not captured into a CUDA graph)"},
    {"stray_marks", T_LONGLONG, offsetof(RegionMarks, stray_marks), 0,
     "markers reached from a thread whose pass is not timed (ignored)"},
    {"records", T_LONGLONG, offsetof(RegionMarks, records), 0,
     "events recorded by the markers of the armed pass (a marker that reuses its neighbour's records none)"},
    {NULL}};

static PyGetSetDef RegionMarks_getset[] = {
    {"actions", (getter)RegionMarks_get_actions, (setter)RegionMarks_set_actions,
     "two per region (start, end): None (inside a merged group), (group, op) or (group, op, reuse_from, "
     "keep)", NULL},
    {"armed", (getter)RegionMarks_get_armed, NULL, "whether a timed pass is running", NULL},
    {NULL}};

static PyTypeObject RegionMarksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.RegionMarks",
    .tp_doc = "RegionMarks(hot, regions, captured): the markers of one compiled model (C version of "
              "hot.PyRegionMarks).",
    .tp_basicsize = sizeof(RegionMarks),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RegionMarks_init,
    .tp_traverse = (traverseproc)RegionMarks_traverse,
    .tp_clear = (inquiry)RegionMarks_clear,
    .tp_dealloc = (destructor)RegionMarks_dealloc,
    .tp_methods = RegionMarks_methods,
    .tp_members = RegionMarks_members,
    .tp_getset = RegionMarks_getset,
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *entries;   /* compiled.py's region table: region id -> (regions, index, marks) or None */
    PyObject *fallback;  /* fallback(x, slot): a marker whose marks are not a RegionMarks */
} MarkTable;

/* table(x, slot): the marker ``slot`` (2 x region id, + 1 for the region's end) ran. Never raises:
 * a failure is counted as an ``error`` drop, as every failure on the hot path is. */
static PyObject *MarkTable_vectorcall(MarkTable *t, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "region_mark(x, slot)");
        return NULL;
    }
    if (t->entries == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "MarkTable: not initialised");
        return NULL;
    }
    Py_ssize_t slot = PyLong_AsSsize_t(args[1]);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t region = slot >> 1;
    if (slot < 0 || region >= PyList_GET_SIZE(t->entries)) Py_RETURN_NONE;
    PyObject *entry = PyList_GET_ITEM(t->entries, region);
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) Py_RETURN_NONE;
    PyObject *marks = PyTuple_GET_ITEM(entry, 2);
    if (Py_TYPE(marks) != &RegionMarksType) return PyObject_Vectorcall(t->fallback, args, 2, NULL);
    Py_ssize_t index = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
    if (index == -1 && PyErr_Occurred()) return NULL;
    Py_INCREF(marks);  /* the entry may be removed while the marker runs Python */
    if (marks_mark((RegionMarks *)marks, index, (int)(slot & 1)) < 0) {
        PyErr_Clear();  /* observability never breaks the observed program */
        if (bump(((HotPath *)((RegionMarks *)marks)->hot)->dropped, s_error) < 0) PyErr_Clear();
    }
    Py_DECREF(marks);
    Py_RETURN_NONE;
}

static int MarkTable_init(MarkTable *t, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"entries", "fallback", NULL};
    PyObject *entries, *fallback;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O", kwlist, &PyList_Type, &entries, &fallback)) return -1;
    Py_XSETREF(t->entries, Py_NewRef(entries));
    Py_XSETREF(t->fallback, Py_NewRef(fallback));
    t->vectorcall = (vectorcallfunc)MarkTable_vectorcall;
    return 0;
}

#define MARK_TABLE_OBJECTS(X) X(entries) X(fallback)
GC_FUNCTIONS(MarkTable, MARK_TABLE_OBJECTS)

static PyTypeObject MarkTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.MarkTable",
    .tp_doc = "MarkTable(entries, fallback): table(x, slot) runs the region marker ``slot``.",
    .tp_basicsize = sizeof(MarkTable),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(MarkTable, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)MarkTable_init,
    .tp_traverse = (traverseproc)MarkTable_traverse,
    .tp_clear = (inquiry)MarkTable_clear,
    .tp_dealloc = (destructor)MarkTable_dealloc,
};

/* ------------------------------------------------------------------------------------------------ */
/* Resolve: the resolver's inner loop for plain pairs (resolver.py's _resolve does the rest)        */

typedef struct {
    PyObject_HEAD
    query_fn_t query_fn;
    elapsed_fn_t elapsed_fn;
    last_error_fn_t clear_error_fn;
    PyObject *dropped;          /* dict: reason -> count */
    PyTypeObject *pending_type; /* core.Pending */
} Resolve;

#define RESOLVE_CHUNK 256

/* run(snapshot, index, device, baseline_s, pool) -> (index, resolved, blocked)
 *
 * Resolves snapshot[index:] while its items are plain pairs of ``device`` (an op, no callback, not a
 * graph replay) or dropped pairs of ``device``: releases their events to ``pool``, observes each
 * finished pair's elapsed time minus ``baseline_s`` into its op's histogram. Stops at the first item
 * it leaves to Python (returned index points at it) or at the first pair not finished yet (blocked
 * true): events of one stream finish in order, and the ring releases events in record order. */
static PyObject *Resolve_run(Resolve *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "run(snapshot: list, index, device, baseline_s, pool)");
        return NULL;
    }
    PyObject *snapshot = args[0], *device = args[2], *pool = args[4];
    Py_ssize_t index = PyLong_AsSsize_t(args[1]);
    double baseline = PyFloat_AsDouble(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_Check(pool)) {
        PyErr_SetString(PyExc_TypeError, "run(): pool must be the device's free list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(snapshot), resolved = 0;
    int blocked = 0;
    void *starts[RESOLVE_CHUNK], *ends[RESOLVE_CHUNK], *streams[RESOLVE_CHUNK];
    float ms[RESOLVE_CHUNK];
    int errors[RESOLVE_CHUNK];
    while (index < n && !blocked) {
        /* 1. (GIL) the run of plain pairs ahead, and dropped pairs released on the way */
        Py_ssize_t first = index, k = 0;
        for (; index < n && k < RESOLVE_CHUNK; index++) {
            PyObject *item = PyList_GET_ITEM(snapshot, index);
            if (Py_TYPE(item) != r->pending_type) break;
            PyObject *op = PyTuple_GET_ITEM(item, 0), *start = PyTuple_GET_ITEM(item, 3),
                     *end = PyTuple_GET_ITEM(item, 4), *callback = PyTuple_GET_ITEM(item, 6);
            int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(item, 1), device, Py_EQ);
            if (same < 0) return NULL;
            if (!same) break;
            if (op == Py_None) {
                if (k > 0) break;  /* released in order: only ahead of every pair of this chunk */
                if (PyList_Append(pool, start) < 0) return NULL;
                if (end != Py_None && !PyObject_IsTrue(PyTuple_GET_ITEM(item, 7)) && PyList_Append(pool, end) < 0)
                    return NULL;
                first = index + 1;
                continue;
            }
            if (!Py_IS_TYPE(op, &OpStateType) || callback != Py_None || !PyLong_Check(start) || !PyLong_Check(end))
                break;
            starts[k] = PyLong_AsVoidPtr(start);
            ends[k] = PyLong_AsVoidPtr(end);
            streams[k] = PyLong_AsVoidPtr(PyTuple_GET_ITEM(item, 2));
            if (PyErr_Occurred()) return NULL;
            k++;
        }
        if (k == 0) break;
        /* 2. (no GIL) which pairs finished, and their elapsed times. Events of one stream finish in
         * order: when the chunk's last pair has finished, so has every pair of its stream before it. */
        Py_ssize_t done = 0;
        Py_BEGIN_ALLOW_THREADS
        int err = r->query_fn(ends[k - 1]);
        if (err != 0 && err != CUDA_ERROR_NOT_READY) r->clear_error_fn();
        void *finished_stream = err == 0 ? streams[k - 1] : NULL;
        for (; done < k; done++) {
            if (err != 0 || streams[done] != finished_stream) {
                int queried = r->query_fn(ends[done]);
                if (queried != 0) {
                    if (queried != CUDA_ERROR_NOT_READY) r->clear_error_fn();
                    break;
                }
            }
            errors[done] = r->elapsed_fn(&ms[done], starts[done], ends[done]);
            if (errors[done] != 0) r->clear_error_fn();
        }
        Py_END_ALLOW_THREADS
        blocked = done < k;
        /* 3. (GIL) release the finished pairs' events and observe them */
        for (Py_ssize_t j = 0; j < done; j++) {
            PyObject *item = PyList_GET_ITEM(snapshot, first + j);
            if (PyList_Append(pool, PyTuple_GET_ITEM(item, 3)) < 0) return NULL;
            if (!PyObject_IsTrue(PyTuple_GET_ITEM(item, 7)) && PyList_Append(pool, PyTuple_GET_ITEM(item, 4)) < 0)
                return NULL;
            if (errors[j] != 0) {  /* e.g. an event recorded under graph capture */
                if (bump(r->dropped, s_error) < 0) return NULL;
                continue;
            }
            int rc = observe_pair(PyTuple_GET_ITEM(item, 0), device, 1e-3 * (double)ms[j] - baseline,
                                  PyTuple_GET_ITEM(item, 5), r->dropped);
            if (rc < 0) return NULL;
            resolved += rc;
        }
        index = first + done;
    }
    return Py_BuildValue("(nnO)", index, resolved, blocked ? Py_True : Py_False);
}

static int Resolve_init(Resolve *r, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"query_address", "elapsed_address", "clear_error_address", "dropped",
                             "pending_type", NULL};
    Py_ssize_t query, elapsed, clear;
    PyObject *dropped, *pend;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$nnnO!O!", kwlist, &query, &elapsed, &clear, &PyDict_Type,
                                     &dropped, &PyType_Type, &pend))
        return -1;
    if (!query || !elapsed || !clear || !PyType_IsSubtype((PyTypeObject *)pend, &PyTuple_Type)) {
        PyErr_SetString(PyExc_ValueError, "Resolve: needs the three function addresses and a tuple subclass");
        return -1;
    }
    r->query_fn = (query_fn_t)query;
    r->elapsed_fn = (elapsed_fn_t)elapsed;
    r->clear_error_fn = (last_error_fn_t)clear;
    Py_XSETREF(r->dropped, Py_NewRef(dropped));
    Py_XSETREF(r->pending_type, (PyTypeObject *)Py_NewRef(pend));
    return 0;
}

#define RESOLVE_OBJECTS(X) X(dropped) X(pending_type)
GC_FUNCTIONS(Resolve, RESOLVE_OBJECTS)

static PyMethodDef Resolve_methods[] = {
    {"run", (PyCFunction)(void (*)(void))Resolve_run, METH_FASTCALL,
     "run(snapshot, index, device, baseline_s, pool) -> (index, resolved, blocked)"},
    {NULL}};

static PyTypeObject ResolveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpuscope.timing._hotpath.Resolve",
    .tp_doc = "The resolver's inner loop for plain pairs, through CUDA's own functions.",
    .tp_basicsize = sizeof(Resolve),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Resolve_init,
    .tp_traverse = (traverseproc)Resolve_traverse,
    .tp_clear = (inquiry)Resolve_clear,
    .tp_dealloc = (destructor)Resolve_dealloc,
    .tp_methods = Resolve_methods,
};

/* ------------------------------------------------------------------------------------------------ */

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT, "_hotpath",
    "The timer's hot path in C (see hot.py for the Python version and how one is chosen).", -1, NULL};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

PyMODINIT_FUNC PyInit__hotpath(void) {
    INTERN(s_add_device, "add_device");
    INTERN(s_record_failed, "record_failed");
    INTERN(s_record_captured, "record_captured");
    INTERN(s_op_state, "op_state");
    INTERN(s_split_captured, "_split_captured");
    INTERN(s_end, "end");
    INTERN(s_pool_empty, "pool_empty");
    INTERN(s_ring_full, "ring_full");
    INTERN(s_append, "append");
    INTERN(s_error, "error");
    INTERN(s_seq, "seq");
    INTERN(s_split, "split");
    if ((one = PyLong_FromLong(1)) == NULL) return NULL;
    if (PyType_Ready(&BucketHistogramType) < 0 || PyType_Ready(&OpStateType) < 0 || PyType_Ready(&HotPathType) < 0 ||
        PyType_Ready(&SequenceBaseType) < 0 || PyType_Ready(&ResolveType) < 0 || PyType_Ready(&ExactForwardType) < 0 ||
        PyType_Ready(&SplitForwardType) < 0 ||
        PyType_Ready(&RegionMarksType) < 0 || PyType_Ready(&MarkTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&hotpath_module);
    if (m == NULL) return NULL;
    if (PyModule_AddObject(m, "BucketHistogram", Py_NewRef(&BucketHistogramType)) < 0 ||
        PyModule_AddObject(m, "OpState", Py_NewRef(&OpStateType)) < 0 ||
        PyModule_AddObject(m, "HotPath", Py_NewRef(&HotPathType)) < 0 ||
        PyModule_AddObject(m, "SequenceBase", Py_NewRef(&SequenceBaseType)) < 0 ||
        PyModule_AddObject(m, "Resolve", Py_NewRef(&ResolveType)) < 0 ||
        PyModule_AddObject(m, "ExactForward", Py_NewRef(&ExactForwardType)) < 0 ||
        PyModule_AddObject(m, "SplitForward", Py_NewRef(&SplitForwardType)) < 0 ||
        PyModule_AddObject(m, "RegionMarks", Py_NewRef(&RegionMarksType)) < 0 ||
        PyModule_AddObject(m, "MarkTable", Py_NewRef(&MarkTableType)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
