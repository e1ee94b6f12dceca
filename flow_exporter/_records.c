/*
 * The compiled record path (issue 24), part of flow_exporter._native: the per-record work between a record
 * being built and it being produced, done for a whole batch in one call. Optional, like the poll path: the
 * pure-Python methods it mirrors are the reference, and the lockstep tests (tests/unit/test_native.py) hold both
 * to the same records.
 *
 *   build_records, acknowledge_delivered: the ledger's record build and delivered-record settling, for a
 *     batch, in the common case (see each below); every other case goes to the Python method.
 *
 * Export (flow_exporter/export.py: an extension type of object fields where compiled) has its fields read and
 * written at their offsets, resolved once, which costs a load where an attribute lookup costs a dictionary
 * probe. A type whose fields are not plain object fields gets NotImplemented, and the caller takes the pure
 * path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "_records.h"

/* Every field of flow.Export, in its order (make_export fills them all). */
enum {
    X_REASON, X_SEQ, X_TOTALS, X_DELTAS, X_FINAL, X_FLOW_END, X_FLOW_ID, X_FIRST, X_CONN_KEY, X_CT_ID, X_START,
    X_FLAGS, X_ENDED, X_TCP, X_META, X_CONN, X_PREFIX, X_SLOT, X_EPOCH, X_VALUE, X_TOPIC, X_KEY, X_ATTEMPTS,
    X_EXPORT_MS, X_ROW_KIND, X_N
};
static const char *const XNAMES[X_N] = {
    "reason", "sequence", "totals", "deltas", "final", "flow_end_ns", "flow_id", "first_seen_ns", "conn_key",
    "ct_id", "start_ns", "flags", "ended", "tcp_state", "meta", "conn", "prefix", "slot", "epoch", "value",
    "topic", "key", "attempts", "export_ms", "row_kind"};

static SlotCache x_slots;

/* The offset of an extension type's object field behind its getset descriptor `d` (flow_exporter.export.Export,
 * compiled: Cython serves each struct member through a property): set on `probe` (an instance of the
 * descriptor's type) to a fresh object, the field is the one word of the instance that holds it. 0 if none or
 * more than one does, -1 with the error set. The C that reads records this way goes as it is ported (issue 39). */
static Py_ssize_t getset_offset(PyObject *probe, PyObject *d) {
    PyTypeObject *owner = ((PyDescrObject *)d)->d_type;
    PyObject *mark = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    if (mark == NULL) return -1;
    if (PyObject_GenericSetAttr(probe, ((PyDescrObject *)d)->d_name, mark) < 0) {
        Py_DECREF(mark);
        return -1;
    }
    Py_ssize_t found = 0, seen = 0;
    for (Py_ssize_t off = (Py_ssize_t)sizeof(PyObject); off + (Py_ssize_t)sizeof(PyObject *) <= owner->tp_basicsize;
         off += (Py_ssize_t)sizeof(PyObject *))
        if (*(PyObject **)((char *)probe + off) == mark) found = off, seen++;
    Py_DECREF(mark); /* the probe still holds it */
    return seen == 1 ? found : 0;
}

/* The offsets of `names` in `type` (a slots dataclass, or an extension type of object fields): 1 if every one
 * is a plain, writable object field whose instances can be made by tp_alloc and filled directly, 0 if not (the
 * caller takes the Python path), -1 with the error set when a lookup failed otherwise than by a missing
 * attribute (a MemoryError, a metaclass that raised): that is no answer about the type, and must not be taken
 * for one. */
int slot_offsets(PyObject *type, const char *const *names, int n, Py_ssize_t *offsets) {
    if (!PyType_Check(type) || ((PyTypeObject *)type)->tp_init == NULL) return 0;
    PyObject *probe = NULL; /* an instance, made when the first getset field is met */
    int r = 1;
    for (int i = 0; i < n && r == 1; i++) {
        PyObject *d = PyObject_GetAttrString(type, names[i]);
        if (d == NULL) {
            r = PyErr_ExceptionMatches(PyExc_AttributeError) ? 0 : -1;
            if (r == 0) PyErr_Clear();
            break;
        }
        /* The descriptor's offset is one of its own type's layout: only `type` or a subtype of it has the field
         * there (a class borrowing Export's descriptors, `value = Export.value`, is smaller). */
        int member = Py_IS_TYPE(d, &PyMemberDescr_Type), getset = Py_IS_TYPE(d, &PyGetSetDescr_Type);
        if (!(member || getset) || !PyType_IsSubtype((PyTypeObject *)type, ((PyDescrObject *)d)->d_type))
            r = 0;
        else if (member) {
            PyMemberDescrObject *m = (PyMemberDescrObject *)d;
            if (m->d_member->type == T_OBJECT_EX && !(m->d_member->flags & READONLY))
                offsets[i] = m->d_member->offset;
            else
                r = 0;
        } else if (((PyGetSetDescrObject *)d)->d_getset->set == NULL)
            r = 0;
        else {
            if (probe == NULL) {
                PyObject *none = PyTuple_New(0);
                PyTypeObject *t = (PyTypeObject *)type;
                probe = none == NULL || t->tp_new == NULL ? NULL : t->tp_new(t, none, NULL);
                Py_XDECREF(none);
            }
            Py_ssize_t off = probe != NULL ? getset_offset(probe, d) : PyErr_Occurred() ? -1 : 0;
            if (off > 0)
                offsets[i] = off;
            else
                r = off < 0 ? -1 : 0;
        }
        Py_DECREF(d);
    }
    Py_XDECREF(probe);
    return r;
}

/* Whether every field of `o` (of the cached type) is set: a slot deleted (`del e.value`) or never set
 * (object.__new__) reads as NULL, which the pure code meets as an AttributeError. */
int slots_set(const SlotCache *c, PyObject *o, int n) {
    for (int i = 0; i < n; i++)
        if (SLOT_AT(*c, o, i) == NULL) return 0;
    return 1;
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

/* Resolve Export's slot offsets (once per type); 1 if every field is a plain object slot, 0 if not, -1 error. */
static int bind_export(PyTypeObject *type) { return slot_cache(&x_slots, (PyObject *)type, XNAMES, X_N); }

#define SLOT(o, i) SLOT_AT(x_slots, o, i)

/* ------------------------------------------------------------------ building records */

/* The store's columns build_records reads and writes, in the order store.ledger passes them, and their
 * item sizes (array typecodes Q, I, b, q and bytearrays). */
enum {
    B_OP, B_OB, B_RP, B_RB, B_BP, B_BB, B_BRP, B_BRB, B_SEQ, B_TCP, B_STATUS, B_LAST, B_FID, B_FIRST, B_CT,
    B_START, B_EPOCH, B_FLAGS, B_REASON, B_BITS, B_N
};
static const Py_ssize_t B_SIZE[B_N] = {8, 8, 8, 8, 8, 8, 8, 8, 4, 1, 4, 8, 8, 8, 4, 8, 4, 1, 1, 1};
/* The bit and code values, from the Python modules that own them (store.columns, flow, connection). */
enum {
    K_UNCOUNTED, K_DESTROYED, K_FINAL_DUE, K_LAST_ACTIVE, K_NO_COUNTERS, K_OFFLOADED, K_OFFLOAD_STATUS,
    K_ACTIVE_TIMEOUT, K_FORCED_END, K_LACK_OF_RESOURCES, K_ROW_ENDED, K_ROW_GIVEN_UP, K_ROW_RESET, K_N
};

#define BCOL(b, i, T) ((T *)(b)[i].buf)

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

/* A tuple of four counters. Only ints: the garbage collector would untrack it at its first look, so it is
 * never tracked (CPython does the same for such tuples; see make_export for why it matters here). */
static PyObject *counters(const uint64_t *c) {
    PyObject *t = PyTuple_New(4);
    if (t == NULL) return NULL;
    for (int i = 0; i < 4; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(c[i]);
        if (v == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, v);
    }
    PyObject_GC_UnTrack(t);
    return t;
}

/* A new Export holding the given field values (references stolen, NULLs allowed: then it fails). */
static PyObject *make_export(PyTypeObject *type, PyObject **v) {
    PyObject *e = NULL;
    for (int i = 0; i < X_N; i++)
        if (v[i] == NULL) goto done;
    e = type->tp_alloc(type, 0);
    if (e == NULL) goto done;
    for (int i = 0; i < X_N; i++) {
        SLOT(e, i) = v[i]; /* the slot takes the reference */
        v[i] = NULL;
    }
    /* Not for the cyclic garbage collector: a record refers to values and its connection's fields, and
     * nothing it holds refers back to it, so reference counting frees it. Tracked, the records in flight (up
     * to limits.maxInFlight) were traversed by every young collection: 13% of the record path's CPU in
     * bench/bench_app_export.py. */
    PyObject_GC_UnTrack(e);
done:
    for (int i = 0; i < X_N; i++) Py_XDECREF(v[i]);
    return e;
}

/*
 * build_records(slots, reasons, out, Export, slow, view, columns, keys, meta, prefix, pending, consts) -> built here
 *
 * Ledger._build for each (slot, reason), in order, appending the records to `out`. A record without a
 * cached prefix carries `view(slot)`, the connection's fields for the encoder (a connection's first record).
 * A slot whose flags change now (the cached prefix then goes) or whose sequence would not fit its column
 * goes to `slow(slot, reason)` (the Python _build) before the next one is looked at.
 */
PyObject *native_build_records(PyObject *self, PyObject *args) {
    PyObject *slots, *reasons, *out, *etype, *slow, *view, *columns, *keys, *meta, *prefix, *pending, *consts;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OOO!O!O!O!O!O!", &PyList_Type, &slots, &PyBytes_Type, &reasons, &PyList_Type,
                          &out, &PyType_Type, &etype, &slow, &view, &PyTuple_Type, &columns, &PyList_Type, &keys,
                          &PyList_Type, &meta, &PyList_Type, &prefix, &PyList_Type, &pending, &PyTuple_Type, &consts))
        return NULL;
    if (PyTuple_GET_SIZE(consts) != K_N || PyBytes_GET_SIZE(reasons) != PyList_GET_SIZE(slots)) {
        PyErr_SetString(PyExc_ValueError, "build_records: constants or reasons of the wrong length");
        return NULL;
    }
    int bound = bind_export((PyTypeObject *)etype);
    if (bound < 0) return NULL;
    if (!bound) Py_RETURN_NOTIMPLEMENTED;
    long k[K_N];
    for (int i = 0; i < K_N; i++) {
        k[i] = PyLong_AsLong(PyTuple_GET_ITEM(consts, i));
        if (k[i] == -1 && PyErr_Occurred()) return NULL;
    }
    Py_buffer b[B_N];
    int held = 0;
    Py_ssize_t n_slots = PyList_GET_SIZE(keys);
    if (acquire_views(columns, B_N, B_SIZE, b, &n_slots, "build_records")) return NULL;
    held = B_N;
    if (PyList_GET_SIZE(meta) < n_slots || PyList_GET_SIZE(prefix) < n_slots || PyList_GET_SIZE(pending) < n_slots) {
        PyErr_SetString(PyExc_ValueError, "build_records: a column is shorter than the keys");
        goto fail;
    }
    const uint8_t *why = (const uint8_t *)PyBytes_AS_STRING(reasons);
    Py_ssize_t built = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
        Py_ssize_t s = PyLong_AsSsize_t(PyList_GET_ITEM(slots, i));
        if (s == -1 && PyErr_Occurred()) goto fail;
        if (s < 0 || s >= n_slots) {
            PyErr_Format(PyExc_IndexError, "build_records: slot %zd out of range", s);
            goto fail;
        }
        int reason = why[i];
        uint8_t flags = BCOL(b, B_FLAGS, uint8_t)[s];
        uint8_t bits = BCOL(b, B_BITS, uint8_t)[s];
        long seen = ((bits & k[K_UNCOUNTED]) ? k[K_NO_COUNTERS] : 0) |
                    ((BCOL(b, B_STATUS, uint32_t)[s] & (uint32_t)k[K_OFFLOAD_STATUS]) ? k[K_OFFLOADED] : 0);
        uint32_t seq = BCOL(b, B_SEQ, uint32_t)[s];
        PyObject *pre = PyList_GET_ITEM(prefix, s);
        if ((seen & ~(long)flags) || seq == UINT32_MAX) {
            PyObject *e = PyObject_CallFunction(slow, "ni", s, reason);
            if (e == NULL) goto fail;
            int r = PyList_Append(out, e);
            Py_DECREF(e);
            if (r) goto fail;
            continue;
        }
        uint64_t o[4] = {BCOL(b, B_OP, uint64_t)[s], BCOL(b, B_OB, uint64_t)[s], BCOL(b, B_RP, uint64_t)[s],
                         BCOL(b, B_RB, uint64_t)[s]};
        uint64_t base[4] = {BCOL(b, B_BP, uint64_t)[s], BCOL(b, B_BB, uint64_t)[s], BCOL(b, B_BRP, uint64_t)[s],
                            BCOL(b, B_BRB, uint64_t)[s]};
        PyObject *conn = Py_None;
        if (pre == Py_None) {
            /* the connection's first record (or its prefix was dropped): its fields, for the encoder */
            conn = PyObject_CallFunction(view, "n", s);
            if (conn == NULL) goto fail;
            if (n_slots > PyList_GET_SIZE(keys) || PyList_GET_ITEM(prefix, s) != Py_None) {
                Py_DECREF(conn);
                PyErr_SetString(PyExc_RuntimeError, "build_records: the store changed under the view");
                goto fail;
            }
        } else {
            Py_INCREF(conn);
        }
        int end_reason = BCOL(b, B_REASON, uint8_t)[s];
        int8_t ts = BCOL(b, B_TCP, int8_t)[s];
        PyObject *v[X_N];
        v[X_REASON] = PyLong_FromLong(reason);
        v[X_SEQ] = PyLong_FromUnsignedLong(seq);
        v[X_TOTALS] = counters(o);
        /* the Python code subtracts unbounded ints and keeps the positive part: the same in 64 bits */
        uint64_t d[4];
        for (int j = 0; j < 4; j++) d[j] = o[j] > base[j] ? o[j] - base[j] : 0;
        v[X_DELTAS] = counters(d);
        v[X_FINAL] = PyBool_FromLong(end_reason != 0);
        v[X_FLOW_END] = PyLong_FromLongLong(BCOL(b, B_LAST, int64_t)[s]);
        v[X_FLOW_ID] = PyLong_FromLongLong(BCOL(b, B_FID, int64_t)[s]);
        v[X_FIRST] = PyLong_FromLongLong(BCOL(b, B_FIRST, int64_t)[s]);
        v[X_CONN_KEY] = Py_NewRef(PyList_GET_ITEM(keys, s));
        v[X_CT_ID] = PyLong_FromUnsignedLong(BCOL(b, B_CT, uint32_t)[s]);
        v[X_START] = PyLong_FromLongLong(BCOL(b, B_START, int64_t)[s]);
        v[X_FLAGS] = PyLong_FromLong(flags);
        /* ended: the entry is over for good (not a give-up of a live one): the journal lets its row go */
        v[X_ENDED] = PyBool_FromLong(end_reason != 0 &&
                                     (end_reason != k[K_LACK_OF_RESOURCES] || (bits & k[K_DESTROYED])));
        v[X_TCP] = ts < 0 ? Py_NewRef(Py_None) : PyLong_FromLong(ts);
        v[X_META] = Py_NewRef(PyList_GET_ITEM(meta, s));
        v[X_CONN] = conn;
        v[X_PREFIX] = Py_NewRef(pre);
        v[X_SLOT] = PyLong_FromSsize_t(s);
        v[X_EPOCH] = PyLong_FromUnsignedLong(BCOL(b, B_EPOCH, uint32_t)[s]);
        v[X_VALUE] = Py_NewRef(Py_None);
        v[X_TOPIC] = Py_NewRef(Py_None);
        v[X_KEY] = Py_NewRef(Py_None);
        v[X_ATTEMPTS] = PyLong_FromLong(0);
        v[X_EXPORT_MS] = PyLong_FromLong(0);
        long row_kind = 0;
        bits = reason == k[K_ACTIVE_TIMEOUT] ? bits | k[K_LAST_ACTIVE] : bits & ~k[K_LAST_ACTIVE];
        if (end_reason) {
            bits &= ~k[K_FINAL_DUE];
            /* a destroyed entry cannot be met again: no row (Ledger._build) */
            if (bits & k[K_DESTROYED]) row_kind = 0;
            else if (end_reason == k[K_LACK_OF_RESOURCES]) row_kind = k[K_ROW_GIVEN_UP];
            else row_kind = k[K_ROW_ENDED] | (end_reason == k[K_FORCED_END] ? k[K_ROW_RESET] : 0);
        }
        v[X_ROW_KIND] = PyLong_FromLong(row_kind);
        PyObject *e = make_export((PyTypeObject *)etype, v);
        if (e == NULL) goto fail;
        if (PyList_Append(out, e)) {
            Py_DECREF(e);
            goto fail;
        }
        /* the record is frozen: its totals are the next delta's base, and it is the one in flight */
        BCOL(b, B_SEQ, uint32_t)[s] = seq + 1;
        BCOL(b, B_BP, uint64_t)[s] = o[0];
        BCOL(b, B_BB, uint64_t)[s] = o[1];
        BCOL(b, B_BRP, uint64_t)[s] = o[2];
        BCOL(b, B_BRB, uint64_t)[s] = o[3];
        BCOL(b, B_BITS, uint8_t)[s] = bits;
        PyList_SetItem(pending, s, e); /* steals the reference */
        built++;
    }
    release_views(b, held);
    return PyLong_FromSsize_t(built);
fail:
    release_views(b, held);
    return NULL;
}

/* ------------------------------------------------------------------ settling delivered records */

/*
 * acknowledge_delivered(exports, pending, prefix, columns, active_bit, slow) -> settled here
 *
 * Ledger.acknowledge(export, True, now) for each delivered record, in order. Done here when the record is
 * its live connection's one in flight and the connection has not ended: it is in flight no more, and its
 * prefix is kept for the next record while the connection is active (dropped when idle). Every other
 * record (restored, stale, ended, not a plain Export, a field unset) goes to `slow(export)`, the Python method.
 * columns: (reason bytearray, bits bytearray, epoch array('I')).
 */
PyObject *native_acknowledge_delivered(PyObject *self, PyObject *args) {
    PyObject *exports, *pending, *prefix, *columns, *slow;
    long active;
    if (!PyArg_ParseTuple(args, "O!O!O!O!lO", &PyList_Type, &exports, &PyList_Type, &pending, &PyList_Type, &prefix,
                          &PyTuple_Type, &columns, &active, &slow))
        return NULL;
    static const Py_ssize_t size[3] = {1, 1, 4};
    Py_buffer b[3];
    int held = 0;
    Py_ssize_t n_slots = PyList_GET_SIZE(pending) < PyList_GET_SIZE(prefix) ? PyList_GET_SIZE(pending)
                                                                           : PyList_GET_SIZE(prefix);
    if (acquire_views(columns, 3, size, b, &n_slots, "acknowledge_delivered")) return NULL;
    held = 3;
    Py_ssize_t done = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(exports); i++) {
        PyObject *e = PyList_GET_ITEM(exports, i);
        int bound = bind_export(Py_TYPE(e));
        if (bound < 0) goto fail;
        Py_ssize_t s = -1;
        /* another type, or a field unset: the Python method, which reads it as it always does */
        PyObject *slot = bound && slots_set(&x_slots, e, X_N) ? SLOT(e, X_SLOT) : NULL;
        if (slot != NULL && PyLong_CheckExact(slot)) s = PyLong_AsSsize_t(slot);
        if (s == -1 && PyErr_Occurred()) PyErr_Clear();
        if (s < 0 || s >= n_slots || PyList_GET_ITEM(pending, s) != e || ((uint8_t *)b[0].buf)[s] != 0) {
            PyObject *r = PyObject_CallOneArg(slow, e);
            if (r == NULL) goto fail;
            Py_DECREF(r);
            continue;
        }
        Py_INCREF(e); /* the pending column held the list's other reference: keep ours until done */
        PyList_SetItem(pending, s, Py_NewRef(Py_None));
        if (((uint8_t *)b[1].buf)[s] & active) {
            PyObject *pre = SLOT(e, X_PREFIX);
            int64_t epoch;
            if (pre != Py_None && as_i64(SLOT(e, X_EPOCH), &epoch) == 0 && epoch == ((uint32_t *)b[2].buf)[s])
                PyList_SetItem(prefix, s, Py_NewRef(pre));
        } else {
            PyList_SetItem(prefix, s, Py_NewRef(Py_None));
        }
        Py_DECREF(e);
        done++;
    }
    release_views(b, held);
    return PyLong_FromSsize_t(done);
fail:
    release_views(b, held);
    return NULL;
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
