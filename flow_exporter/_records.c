/*
 * What is due, compiled (issue 24), part of flow_exporter._native: due_slots, the expiry queue's pop and the
 * ledger's decision loop fused (see it below); and what the C files share: a slots dataclass's field offsets
 * (Connection's, which the decoder and the admission fill) and the store's columns as buffers. Optional, like the
 * poll path: the pure-Python methods it mirrors are the reference, and the lockstep tests
 * (tests/unit/test_native.py) hold both to the same store. A record's build and its settling are
 * flow_exporter/ledger_core.py's (issue 39).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "_records.h"

/* The offsets of `names` in `type` (a slots dataclass): 1 if every one is a plain, writable object slot whose
 * instances can be made by tp_alloc and filled directly, 0 if not (the caller takes the Python path), -1 with
 * the error set when a lookup failed otherwise than by a missing attribute (a MemoryError, a metaclass that
 * raised): that is no answer about the type, and must not be taken for one. */
int slot_offsets(PyObject *type, const char *const *names, int n, Py_ssize_t *offsets) {
    if (!PyType_Check(type) || ((PyTypeObject *)type)->tp_init == NULL) return 0;
    int r = 1;
    for (int i = 0; i < n && r == 1; i++) {
        PyObject *d = PyObject_GetAttrString(type, names[i]);
        if (d == NULL) {
            r = PyErr_ExceptionMatches(PyExc_AttributeError) ? 0 : -1;
            if (r == 0) PyErr_Clear();
            break;
        }
        /* The descriptor's offset is one of its own type's layout: only `type` or a subtype of it has the field
         * there (a class borrowing Connection's descriptors, `proto = Connection.proto`, is smaller). */
        if (!Py_IS_TYPE(d, &PyMemberDescr_Type) || !PyType_IsSubtype((PyTypeObject *)type, ((PyDescrObject *)d)->d_type))
            r = 0;
        else {
            PyMemberDescrObject *m = (PyMemberDescrObject *)d;
            if (m->d_member->type == T_OBJECT_EX && !(m->d_member->flags & READONLY))
                offsets[i] = m->d_member->offset;
            else
                r = 0;
        }
        Py_DECREF(d);
    }
    return r;
}

void columns_release(Py_buffer *b, int n) {
    for (int i = 0; i < n; i++) PyBuffer_Release(&b[i]);
}

int columns_acquire(Py_buffer *b, PyObject *columns, int n, const Py_ssize_t *sizes) {
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(columns, i), &b[i], PyBUF_WRITABLE | PyBUF_FORMAT)) {
            columns_release(b, i);
            return -1;
        }
        if (b[i].itemsize != sizes[i]) {
            PyErr_Format(PyExc_TypeError, "column %d: item size %zd, expected %zd", i, b[i].itemsize, sizes[i]);
            columns_release(b, i + 1);
            return -1;
        }
    }
    return 0;
}

int slot_cache(SlotCache *c, PyObject *type, const char *const *names, int n) {
    if (type == c->type) return c->direct;
    Py_ssize_t off[sizeof c->off / sizeof c->off[0]];
    int direct = n <= (int)(sizeof off / sizeof off[0]) ? slot_offsets(type, names, n, off) : 0;
    if (direct < 0) return -1; /* no answer: nothing kept, so the next call asks again */
    if (direct) memcpy(c->off, off, (size_t)n * sizeof off[0]);
    c->direct = direct;
    Py_XSETREF(c->type, Py_NewRef(type));
    return c->direct;
}

static void release_views(Py_buffer *b, int held) {
    for (int i = 0; i < held; i++) PyBuffer_Release(&b[i]);
}

/* Writable views of the `n` columns (a tuple), each of its item size; `*slots` lowered to the shortest.
 * 0, or -1 with an error set and every view released. */
static int acquire_views(PyObject *columns, int n, const Py_ssize_t *sizes, Py_buffer *b, Py_ssize_t *slots,
                         const char *who) {
    if (PyTuple_GET_SIZE(columns) != n) {
        PyErr_Format(PyExc_ValueError, "%s: %d columns expected", who, n);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(columns, i), &b[i], PyBUF_WRITABLE)) {
            release_views(b, i);
            return -1;
        }
        if (b[i].itemsize != sizes[i]) {
            release_views(b, i + 1);
            PyErr_Format(PyExc_TypeError, "%s: column %d has items of %zd bytes, not %zd", who, i, b[i].itemsize,
                         sizes[i]);
            return -1;
        }
        if (b[i].len / sizes[i] < *slots) *slots = b[i].len / sizes[i];
    }
    return 0;
}

/* ------------------------------------------------------------------ what is due */


enum { D_REASON, D_BITS, D_TCP, D_STATUS, D_QUEUED, D_ACTIVE, D_IDLE, D_N };
static const Py_ssize_t D_SIZE[D_N] = {1, 1, 1, 4, 1, 8, 8};
enum {
    E_FINAL_DUE, E_ACTIVE, E_END_OF_FLOW, E_IDLE_TIMEOUT, E_ACTIVE_TIMEOUT, E_PROTO_TCP, E_TIME_WAIT, E_CLOSE,
    E_IPS_DYING, E_N
};

/*
 * due_slots(heap, columns, now, active_timeout, limit, todo, why, retry, taken, pending, keys, idle_order,
 *           push, constants) -> change in the queue's live count
 *
 * ExpiryQueue.pop_due and the decision loop of Ledger.expire, fused: every slot due at `now`, earliest
 * first, is popped and sorted into a record to build (`todo`, `why`), a retry (its record is in flight) or
 * nothing (ended, nothing owed); an active connection is queued again for its next active timeout. The
 * heap is the queue's DeadlineHeap (deadline_heap.py, through its C interface), popped and pushed in the same
 * order as ExpiryQueue.pop_due and requeue pop and push it, so the queue ends up the same, entry for entry. At the limit the slot goes
 * back through `push(slot, active, idle)` (the queue's method) and the loop stops.
 * columns: (reason, bits, tcp state, status, queued, active deadline, idle deadline).
 */
PyObject *native_due_slots(PyObject *self, PyObject *args) {
    PyObject *heap, *columns, *todo, *why, *retry, *taken, *pending, *keys, *idle_order, *push, *consts;
    double now, active_timeout;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OO!ddnO!O!O!O!O!O!O!OO!", &heap, &PyTuple_Type, &columns, &now,
                          &active_timeout, &limit, &PyList_Type, &todo, &PyByteArray_Type, &why, &PyList_Type, &retry,
                          &PySet_Type, &taken, &PyList_Type, &pending, &PyList_Type, &keys, &PyDict_Type, &idle_order,
                          &push, &PyTuple_Type, &consts))
        return NULL;
    if (!heap_check(heap)) return NULL;
    if (PyTuple_GET_SIZE(consts) != E_N) {
        PyErr_SetString(PyExc_ValueError, "due_slots: constants of the wrong length");
        return NULL;
    }
    long k[E_N];
    for (int i = 0; i < E_N; i++) {
        k[i] = PyLong_AsLong(PyTuple_GET_ITEM(consts, i));
        if (k[i] == -1 && PyErr_Occurred()) return NULL;
    }
    Py_buffer b[D_N];
    int held = 0;
    Py_ssize_t n_slots = PyList_GET_SIZE(pending) < PyList_GET_SIZE(keys) ? PyList_GET_SIZE(pending)
                                                                         : PyList_GET_SIZE(keys);
    if (acquire_views(columns, D_N, D_SIZE, b, &n_slots, "due_slots")) return NULL;
    held = D_N;
    uint8_t *reason = b[D_REASON].buf, *bits = b[D_BITS].buf, *queued = b[D_QUEUED].buf;
    int8_t *tcp = b[D_TCP].buf;
    uint32_t *status = b[D_STATUS].buf;
    double *active = b[D_ACTIVE].buf, *idle = b[D_IDLE].buf;
    int64_t now_ms = ms_of(now); /* due: entries up to now's millisecond (pop_due's limit) */
    Py_ssize_t live = 0;
    HeapEntry *early = NULL; /* entries of now's millisecond whose exact deadline is later than now */
    Py_ssize_t n_early = 0, early_cap = 0;
    int has_taken = PySet_GET_SIZE(taken) > 0;
    while (heap_len(heap) > 0 && heap_min_ms(heap) <= now_ms) {
        HeapEntry ev = heap_pop(heap);
        Py_ssize_t s = (Py_ssize_t)ev.slot;
        if (s >= n_slots) {
            PyErr_Format(PyExc_IndexError, "due_slots: slot %zd out of range", s);
            goto fail_early;
        }
        if (!queued[s]) continue;
        double deadline = active[s] < idle[s] ? active[s] : idle[s];
        if (ms_of(deadline) != ev.ms) continue; /* stale: the slot's deadline moved */
        if (deadline > now) {
            if (n_early == early_cap) {
                early_cap = early_cap ? 2 * early_cap : 16;
                HeapEntry *grown = PyMem_Realloc(early, (size_t)early_cap * sizeof(HeapEntry));
                if (grown == NULL) {
                    PyErr_NoMemory();
                    goto fail_early;
                }
                early = grown;
            }
            early[n_early++] = ev;
            continue;
        }
        queued[s] = 0;
        live--;
        /* the slot is due: what the ledger does with it */
        PyObject *slot = PyLong_FromSsize_t(s);
        if (slot == NULL) goto fail_early;
        if (limit >= 0 && PyList_GET_SIZE(todo) >= limit) {
            PyObject *r = PyObject_CallFunction(push, "Odd", slot, active[s], idle[s]);
            Py_DECREF(slot);
            if (r == NULL) goto fail_early;
            Py_DECREF(r); /* push queued it again and counted it itself */
            break;
        }
        int busy = PyList_GET_ITEM(pending, s) != Py_None;
        if (!busy && has_taken) {
            busy = PySet_Contains(taken, slot);
            if (busy < 0) {
                Py_DECREF(slot);
                goto fail_early;
            }
        }
        int rc = 0;
        if (busy) {
            rc = PyList_Append(retry, slot);
        } else if (reason[s]) {
            if (bits[s] & k[E_FINAL_DUE]) {
                rc = PyList_Append(todo, slot);
                if (!rc) rc = PyByteArray_Resize(why, PyByteArray_GET_SIZE(why) + 1);
                if (!rc) PyByteArray_AS_STRING(why)[PyByteArray_GET_SIZE(why) - 1] = (char)reason[s];
            }
        } else {
            rc = PyList_Append(todo, slot);
            int code = (int)k[E_ACTIVE_TIMEOUT];
            if (!rc) {
                PyObject *key = PyList_GET_ITEM(keys, s);
                int dying = 0;
                if (key != Py_None) {
                    long proto = -1;
                    if (PyTuple_Check(key) && PyTuple_GET_SIZE(key) > 1) proto = PyLong_AsLong(PyTuple_GET_ITEM(key, 1));
                    if (proto == -1 && PyErr_Occurred()) rc = -1;
                    else if (proto == k[E_PROTO_TCP] && tcp[s] >= 0) dying = tcp[s] == k[E_TIME_WAIT] || tcp[s] == k[E_CLOSE];
                    else dying = (status[s] & (uint32_t)k[E_IPS_DYING]) != 0;
                }
                if (dying) {
                    code = (int)k[E_END_OF_FLOW];
                } else if (idle[s] <= now) {
                    code = (int)k[E_IDLE_TIMEOUT];
                    bits[s] &= (uint8_t)~k[E_ACTIVE];
                    if (!rc) rc = PyDict_SetItem(idle_order, slot, Py_None);
                } else if (!rc) { /* requeue: its next active timeout */
                    active[s] = now + active_timeout;
                    queued[s] = 1;
                    live++;
                    rc = heap_push(heap, ms_of(active[s] < idle[s] ? active[s] : idle[s]), (uint32_t)s);
                }
            }
            if (!rc) rc = PyByteArray_Resize(why, PyByteArray_GET_SIZE(why) + 1);
            if (!rc) PyByteArray_AS_STRING(why)[PyByteArray_GET_SIZE(why) - 1] = (char)code;
        }
        Py_DECREF(slot);
        if (rc) goto fail_early;
    }
    /* the entries of now's millisecond whose exact deadline is later go back, as pop_due's finally does */
    int rc = 0;
    for (Py_ssize_t i = 0; i < n_early && !rc; i++) rc = heap_push(heap, early[i].ms, early[i].slot);
    PyMem_Free(early);
    release_views(b, held);
    return rc ? NULL : PyLong_FromSsize_t(live);
fail_early:
    for (Py_ssize_t i = 0; i < n_early; i++) /* pop_due's finally: back even when the loop failed */
        if (heap_push(heap, early[i].ms, early[i].slot)) break;
    PyMem_Free(early);
    release_views(b, held);
    return NULL;
}
