/* gpuscope share: the controller's reads, writes and futex calls on the ledger's shared words.
 *
 * The controller wakes tens of times a second and touches a few words of shared memory each time;
 * through ctypes every such access builds argument objects, and on a cold cache after a sleep that
 * costs tens of microseconds per call. These are the same operations as plain C calls. ledger.py
 * falls back to ctypes where this extension was not built.
 *
 * Every function takes an address inside a mapping ledger.py made and keeps alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/futex.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int address(PyObject *arg, void **out) {
    unsigned long long a = PyLong_AsUnsignedLongLong(arg);
    if (a == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (void *)(uintptr_t)a;
    return 0;
}

static int check_args(Py_ssize_t n, Py_ssize_t want, const char *name) {
    if (n == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", name, want, n);
    return -1;
}

static PyObject *u32(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *p;
    if (check_args(n, 1, "u32") || address(args[0], &p)) return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)p, __ATOMIC_ACQUIRE));
}

static PyObject *u64(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *p;
    if (check_args(n, 1, "u64") || address(args[0], &p)) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n((uint64_t *)p, __ATOMIC_ACQUIRE));
}

static PyObject *set_u32(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *p;
    if (check_args(n, 2, "set_u32") || address(args[0], &p)) return NULL;
    unsigned long v = PyLong_AsUnsignedLong(args[1]);
    if (v == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    __atomic_store_n((uint32_t *)p, (uint32_t)v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *set_u64(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *p;
    if (check_args(n, 2, "set_u64") || address(args[0], &p)) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    __atomic_store_n((uint64_t *)p, (uint64_t)v, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* sub_u64_floor(addr, value): an atomic subtraction that stops at zero (a word other processes add to). */
static PyObject *sub_u64_floor(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *p;
    if (check_args(n, 2, "sub_u64_floor") || address(args[0], &p)) return NULL;
    unsigned long long v = PyLong_AsUnsignedLongLong(args[1]);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    uint64_t old = __atomic_load_n((uint64_t *)p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n((uint64_t *)p, &old, old > v ? old - v : 0, 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED)) {
    }
    Py_RETURN_NONE;
}

/* futex_wait(addr, expected, timeout_s) -> False when it timed out, else True (woken, or the word no
 * longer held `expected`). The GIL is released while it sleeps. */
static PyObject *futex_wait(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *p;
    if (check_args(n, 3, "futex_wait") || address(args[0], &p)) return NULL;
    unsigned long expected = PyLong_AsUnsignedLong(args[1]);
    if (expected == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    double timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (timeout < 0) timeout = 0;
    struct timespec ts = {(time_t)timeout, (long)((timeout - (double)(time_t)timeout) * 1e9)};
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, p, FUTEX_WAIT, (uint32_t)expected, &ts, NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc != 0 && err == ETIMEDOUT) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyObject *futex_wake(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    void *p;
    if (check_args(n, 1, "futex_wake") || address(args[0], &p)) return NULL;
    syscall(SYS_futex, p, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"u32", (PyCFunction)(void (*)(void))u32, METH_FASTCALL, "u32(addr): the 32-bit word at addr"},
    {"u64", (PyCFunction)(void (*)(void))u64, METH_FASTCALL, "u64(addr): the 64-bit word at addr"},
    {"set_u32", (PyCFunction)(void (*)(void))set_u32, METH_FASTCALL, "set_u32(addr, value)"},
    {"set_u64", (PyCFunction)(void (*)(void))set_u64, METH_FASTCALL, "set_u64(addr, value)"},
    {"sub_u64_floor", (PyCFunction)(void (*)(void))sub_u64_floor, METH_FASTCALL,
     "sub_u64_floor(addr, value): atomically subtract, stopping at zero"},
    {"futex_wait", (PyCFunction)(void (*)(void))futex_wait, METH_FASTCALL,
     "futex_wait(addr, expected, timeout_s) -> False on timeout"},
    {"futex_wake", (PyCFunction)(void (*)(void))futex_wake, METH_FASTCALL, "futex_wake(addr): wake every waiter"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_words", NULL, -1, methods};

PyMODINIT_FUNC PyInit__words(void) { return PyModule_Create(&module); }
