/* The expiry queue's heap for the compiled paths: (millisecond, slot) pairs in one C array (issue 24).
 *
 * The pure queue (flow_exporter/expiry.py) keeps a list of Python ints `ms << 32 | slot` ordered by heapq.
 * At 250k connections and an active timeout of 5 s (50,000 records/s), popping and pushing those ints cost
 * ~11% of the exporter's CPU in a perf profile: every comparison a rich comparison of two int objects, every
 * entry an object of its own (40 bytes with its list pointer; 16 here). And an int64 cannot hold the
 * entry once the monotonic clock passes 2^31 ms (24.8 days of a node's uptime): the compiled expire loop
 * raised OverflowError on such a node. Here the pair is kept as two fields, so any millisecond fits.
 *
 * The order is the ints' order (ms first, then slot) and the algorithm is heapq's (push: append, then move
 * up past larger parents; pop: the last entry to the root, down along the smaller children to a leaf, then
 * up), so the array holds the same entries in the same places as the pure queue's list: the property tests
 * (tests/unit/test_native.py) compare them with tolist().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_records.h"

static inline int less(HeapEntry a, HeapEntry b) { return a.ms < b.ms || (a.ms == b.ms && a.slot < b.slot); }

/* heapq's _siftdown: the entry at pos moves up past larger parents, no higher than start. */
static void sift_up_from(HeapEntry *v, Py_ssize_t start, Py_ssize_t pos) {
    HeapEntry item = v[pos];
    while (pos > start) {
        Py_ssize_t parent = (pos - 1) >> 1;
        if (!less(item, v[parent])) break;
        v[pos] = v[parent];
        pos = parent;
    }
    v[pos] = item;
}

/* heapq's _siftup: the entry at pos goes down along the smaller children to a leaf, then back up. */
static void sift_down_from(HeapEntry *v, Py_ssize_t n, Py_ssize_t pos) {
    Py_ssize_t start = pos, child = 2 * pos + 1;
    HeapEntry item = v[pos];
    while (child < n) {
        Py_ssize_t right = child + 1;
        if (right < n && !less(v[child], v[right])) child = right;
        v[pos] = v[child];
        pos = child;
        child = 2 * pos + 1;
    }
    v[pos] = item;
    sift_up_from(v, start, pos);
}

int heap_push(PyObject *heap, int64_t ms, uint32_t slot) {
    DeadlineHeap *h = (DeadlineHeap *)heap;
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap < 64 ? 64 : h->cap + h->cap / 2;
        HeapEntry *v = PyMem_Realloc(h->v, (size_t)cap * sizeof(HeapEntry));
        if (v == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        h->v = v;
        h->cap = cap;
    }
    h->v[h->n] = (HeapEntry){ms, slot};
    sift_up_from(h->v, 0, h->n++);
    return 0;
}

HeapEntry heap_pop(PyObject *heap) {
    DeadlineHeap *h = (DeadlineHeap *)heap;
    HeapEntry last = h->v[--h->n];
    if (h->n == 0) return last;
    HeapEntry top = h->v[0];
    h->v[0] = last;
    sift_down_from(h->v, h->n, 0);
    return top;
}

/* The entry as the pure queue's int: ms << 32 | slot, a long when ms is past 31 bits. */
static PyObject *entry_int(HeapEntry e) {
    if (e.ms >= -(1LL << 31) && e.ms < (1LL << 31)) return PyLong_FromLongLong(e.ms * (1LL << 32) + e.slot);
    PyObject *ms = PyLong_FromLongLong(e.ms), *shift = PyLong_FromLong(32), *slot = PyLong_FromUnsignedLong(e.slot);
    PyObject *hi = (ms && shift) ? PyNumber_Lshift(ms, shift) : NULL;
    PyObject *out = (hi && slot) ? PyNumber_Or(hi, slot) : NULL;
    Py_XDECREF(ms);
    Py_XDECREF(shift);
    Py_XDECREF(slot);
    Py_XDECREF(hi);
    return out;
}

/* An int `ms << 32 | slot` as an entry; 0, or -1 with an error set (not an int, or ms past 64 bits). */
static int int_entry(PyObject *o, HeapEntry *e) {
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "heap entry: expected an int, got %.100s", Py_TYPE(o)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (!overflow) {
        e->ms = (v - (v & 0xFFFFFFFFLL)) / (1LL << 32);
        e->slot = (uint32_t)(v & 0xFFFFFFFFLL);
        return 0;
    }
    PyObject *shift = PyLong_FromLong(32), *mask = PyLong_FromUnsignedLong(0xFFFFFFFFUL);
    PyObject *hi = (shift && mask) ? PyNumber_Rshift(o, shift) : NULL, *lo = hi ? PyNumber_And(o, mask) : NULL;
    int rc = -1;
    if (lo != NULL) {
        e->ms = PyLong_AsLongLong(hi);
        e->slot = (uint32_t)PyLong_AsUnsignedLong(lo);
        rc = PyErr_Occurred() ? -1 : 0;
    }
    Py_XDECREF(shift);
    Py_XDECREF(mask);
    Py_XDECREF(hi);
    Py_XDECREF(lo);
    return rc;
}

static PyObject *dh_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    PyObject *entries = NULL;
    static char *names[] = {"entries", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:DeadlineHeap", names, &entries)) return NULL;
    DeadlineHeap *h = (DeadlineHeap *)type->tp_alloc(type, 0);
    if (h == NULL || entries == NULL) return (PyObject *)h;
    PyObject *seq = PySequence_Fast(entries, "DeadlineHeap: expected a sequence of entries");
    if (seq == NULL) goto fail;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    h->v = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(HeapEntry));
    if (h->v == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        goto fail;
    }
    h->cap = n ? n : 1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (int_entry(PySequence_Fast_GET_ITEM(seq, i), &h->v[i])) {
            Py_DECREF(seq);
            goto fail;
        }
    Py_DECREF(seq);
    h->n = n;
    for (Py_ssize_t i = n / 2 - 1; i >= 0; i--) sift_down_from(h->v, n, i); /* heapq.heapify */
    return (PyObject *)h;
fail:
    Py_XDECREF(h);
    return NULL;
}

static void dh_dealloc(PyObject *self) {
    PyMem_Free(((DeadlineHeap *)self)->v);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t dh_len(PyObject *self) { return ((DeadlineHeap *)self)->n; }

static PyObject *dh_item(PyObject *self, Py_ssize_t i) {
    DeadlineHeap *h = (DeadlineHeap *)self;
    if (i < 0 || i >= h->n) {
        PyErr_SetString(PyExc_IndexError, "heap index out of range");
        return NULL;
    }
    return entry_int(h->v[i]);
}

static PyObject *dh_push(PyObject *self, PyObject *entry) {
    HeapEntry e;
    if (int_entry(entry, &e) || heap_push(self, e.ms, e.slot)) return NULL;
    Py_RETURN_NONE;
}

static PyObject *dh_pop(PyObject *self, PyObject *unused) {
    (void)unused;
    if (((DeadlineHeap *)self)->n == 0) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty heap");
        return NULL;
    }
    return entry_int(heap_pop(self));
}

static PyObject *dh_tolist(PyObject *self, PyObject *unused) {
    (void)unused;
    DeadlineHeap *h = (DeadlineHeap *)self;
    PyObject *out = PyList_New(h->n);
    for (Py_ssize_t i = 0; out != NULL && i < h->n; i++) {
        PyObject *x = entry_int(h->v[i]);
        if (x == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, x);
    }
    return out;
}

static PyMethodDef dh_methods[] = {
    {"push", dh_push, METH_O, "push(entry): heapq.heappush of `ms << 32 | slot`."},
    {"pop", dh_pop, METH_NOARGS, "pop() -> the smallest entry, as heapq.heappop."},
    {"tolist", dh_tolist, METH_NOARGS, "The entries in heap order, as the pure queue's list holds them."},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods dh_sequence = {.sq_length = dh_len, .sq_item = dh_item};

PyTypeObject DeadlineHeapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "flow_exporter._native.DeadlineHeap",
    .tp_basicsize = sizeof(DeadlineHeap),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "DeadlineHeap(entries=()): the expiry queue's heap of `ms << 32 | slot` entries, in one C array "
              "(heapified from entries).",
    .tp_new = dh_new,
    .tp_dealloc = dh_dealloc,
    .tp_as_sequence = &dh_sequence,
    .tp_methods = dh_methods,
};

int heap_add_type(PyObject *module) {
    if (PyType_Ready(&DeadlineHeapType) < 0) return -1;
    Py_INCREF(&DeadlineHeapType);
    if (PyModule_AddObject(module, "DeadlineHeap", (PyObject *)&DeadlineHeapType) < 0) {
        Py_DECREF(&DeadlineHeapType);
        return -1;
    }
    return 0;
}
