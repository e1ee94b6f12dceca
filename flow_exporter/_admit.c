/* New connections admitted into the store in one call: the first poll's hot path (issue 24).
 *
 * A run of dump rows the store does not hold, admitted as Table._admit -> _track -> Columns._alloc would admit
 * them one by one (flow_exporter/store/table.py, columns.py): a connectionId from the IdAllocator's sequence, a
 * first-seen stamp, a slot, its columns, the interned key, the keyed table, the expiry queue. Written in C
 * because that chain was ~4.6 us of Python per new connection, most of a 1M table's first poll
 * (BENCHMARKS.md). It stops, writing nothing for it, at the first row that needs anything else: a key the
 * store holds (a duplicate of a row admitted in this run is skipped, as update_batch skips it), a row the
 * checkpoint restored, a tuple the store gave up, a tombstone of the same incarnation, the cap, a row that may be one the store forgot (readmitted), a slot the columns
 * must grow for, a value a column cannot hold, an object that is not a plain Connection. The caller does that
 * row in Python and calls again for the rest. The property tests (tests/unit/test_native.py) hold this and the
 * pure path to the same store state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#include "_records.h"

enum { K_PROTO, K_OSRC, K_ODST, K_OSPORT, K_ODPORT, K_RSRC, K_RDST, K_RSPORT, K_RDPORT, K_ZONE, K_CT, K_MARK,
       K_LABELS, K_STATUS, K_TCP, K_OPK, K_OBY, K_RPK, K_RBY, K_START, K_STOP, K_ITYPE, K_ICODE, K_IID, K_COUNTED,
       K_N };
static const char *const NAMES[K_N] = {
    "proto", "orig_src", "orig_dst", "orig_sport", "orig_dport", "reply_src", "reply_dst", "reply_sport",
    "reply_dport", "zone", "ct_id", "mark", "labels", "status", "tcp_state", "orig_packets", "orig_bytes",
    "reply_packets", "reply_bytes", "start_ns", "stop_ns", "icmp_type", "icmp_code", "icmp_id", "counted"};
static SlotCache conn_slots;

/* The columns admission writes, in the order Table passes them (_admit_columns). */
enum { A_FID, A_FIRST, A_LAST_ACTIVE, A_SEEN, A_BITS, A_FLAGS, A_OP, A_OB, A_RP, A_RB, A_TCP, A_STATUS, A_START,
       A_CT, A_MARK, A_QACTIVE, A_QIDLE, A_QUEUED, A_N };
static const Py_ssize_t A_SIZE[A_N] = {8, 8, 8, 4, 1, 1, 8, 8, 8, 8, 1, 4, 8, 4, 4, 8, 8, 1};

#define PRESENT_ACTIVE 3 /* columns.py PRESENT | ACTIVE */
#define UNCOUNTED 128
#define PROTO_ICMP 1
#define PROTO_ICMPV6 58
#define GOLDEN 0x9E3779B97F4A7C15ULL

/* One row's values, checked: everything the columns take, before anything is written. */
typedef struct {
    PyObject *o[K_N];
    uint64_t opk, oby, rpk, rby, ct, mark, status, odport, rsport, rdport;
    int64_t start, stop, tcp;
    int counted;
} Vals;

static int vals_of(PyObject *conn, Vals *v) {
    for (int i = 0; i < K_N; i++) v->o[i] = SLOT_AT(conn_slots, conn, i);
    for (int i = 0; i < K_N; i++)
        if (v->o[i] == NULL) return 0;
    if (as_u64(v->o[K_OPK], &v->opk) || as_u64(v->o[K_OBY], &v->oby) || as_u64(v->o[K_RPK], &v->rpk) ||
        as_u64(v->o[K_RBY], &v->rby) || as_u64(v->o[K_CT], &v->ct) || as_u64(v->o[K_MARK], &v->mark) ||
        as_u64(v->o[K_STATUS], &v->status) || as_u64(v->o[K_ODPORT], &v->odport) ||
        as_u64(v->o[K_RSPORT], &v->rsport) || as_u64(v->o[K_RDPORT], &v->rdport) || as_i64(v->o[K_START], &v->start) ||
        as_i64(v->o[K_STOP], &v->stop))
        return 0;
    if (v->ct > UINT32_MAX || v->mark > UINT32_MAX || v->status > UINT32_MAX || v->odport > 0xFFFF ||
        v->rsport > 0xFFFF || v->rdport > 0xFFFF)
        return 0;
    if (v->o[K_TCP] == Py_None) v->tcp = -1;
    else if (as_i64(v->o[K_TCP], &v->tcp) || v->tcp < -128 || v->tcp > 127) return 0;
    if (!PyBytes_CheckExact(v->o[K_ODST]) || !PyBytes_CheckExact(v->o[K_RDST])) return 0;
    if (v->o[K_LABELS] != Py_None && !PyBytes_CheckExact(v->o[K_LABELS])) return 0;
    if (!PyBool_Check(v->o[K_COUNTED])) return 0;
    v->counted = v->o[K_COUNTED] == Py_True;
    return 1;
}

/* Connection.key's tuple: (zone, proto, orig_src, orig_sport, reply_src, orig_dport for ICMP else reply_sport). */
static PyObject *key_of(const Vals *v) {
    int64_t proto;
    if (as_i64(v->o[K_PROTO], &proto)) return NULL;
    PyObject *last = (proto == PROTO_ICMP || proto == PROTO_ICMPV6) ? v->o[K_ODPORT] : v->o[K_RSPORT];
    return PyTuple_Pack(6, v->o[K_ZONE], v->o[K_PROTO], v->o[K_OSRC], v->o[K_OSPORT], v->o[K_RSRC], last);
}

/* Columns._alloc's interning at admission: the table cleared when past its bound, then the addresses and the
 * destination port put in (kept where present). The key it returns (a new reference) holds what the table
 * holds, as the pure path's does; untracked by the cyclic collector (ints and bytes cannot form a cycle), as
 * the collector itself would untrack it at its first pass: a million keys it need not walk. */
static PyObject *interned_key(PyObject *key, PyObject *intern, Py_ssize_t intern_max) {
    static const int SHARED[3] = {2, 4, 5}; /* orig_src, reply_src, the destination port */
    if (PyDict_GET_SIZE(intern) > intern_max) PyDict_Clear(intern);
    int same = 1;
    PyObject *parts[6];
    for (int i = 0; i < 6; i++) parts[i] = PyTuple_GET_ITEM(key, i);
    for (int i = 0; i < 3; i++) {
        PyObject *x = parts[SHARED[i]];
        parts[SHARED[i]] = PyDict_SetDefault(intern, x, x); /* borrowed */
        if (parts[SHARED[i]] == NULL) return NULL;
        same &= parts[SHARED[i]] == x;
    }
    PyObject *out = same ? Py_NewRef(key) : PyTuple_Pack(6, parts[0], parts[1], parts[2], parts[3], parts[4], parts[5]);
    if (out != NULL && PyObject_GC_IsTracked(out)) PyObject_GC_UnTrack(out);
    return out;
}

/* columns.py _static: orig_dst + reply_dst + struct "!HHHB" (orig_dport, reply_sport, reply_dport, ICMP bits). */
static PyObject *static_of(const Vals *v) {
    Py_ssize_t a = PyBytes_GET_SIZE(v->o[K_ODST]), b = PyBytes_GET_SIZE(v->o[K_RDST]);
    PyObject *out = PyBytes_FromStringAndSize(NULL, a + b + 7);
    if (out == NULL) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    memcpy(p, PyBytes_AS_STRING(v->o[K_ODST]), (size_t)a);
    memcpy(p + a, PyBytes_AS_STRING(v->o[K_RDST]), (size_t)b);
    p += a + b;
    uint64_t ports[3] = {v->odport, v->rsport, v->rdport};
    for (int i = 0; i < 3; i++) {
        p[2 * i] = (uint8_t)(ports[i] >> 8);
        p[2 * i + 1] = (uint8_t)ports[i];
    }
    p[6] = (uint8_t)((v->o[K_ITYPE] != Py_None ? 1 : 0) | (v->o[K_ICODE] != Py_None ? 2 : 0) |
                     (v->o[K_IID] != Py_None ? 4 : 0));
    return out;
}

/* flow.py IdAllocator.__call__: the Weyl sequence through SplitMix64's finalizer, as a signed 64-bit id. */
static int64_t next_id(uint64_t *state) {
    uint64_t x = *state += GOLDEN;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return (int64_t)x;
}

/* Whether the store keeps a tombstone for (key, ct_id): 1 yes (or an error is set), 0 no. */
static int tombed(PyObject *tombs, PyObject *key, PyObject *ct_id) {
    if (!PyDict_GET_SIZE(tombs)) return 0;
    PyObject *k = PyTuple_Pack(2, key, ct_id);
    if (k == NULL) return 1;
    int found = PyDict_Contains(tombs, k);
    Py_DECREF(k);
    return found != 0;
}

typedef struct {
    Py_buffer b[A_N];
    Py_ssize_t slots; /* slots every column has */
} ACols;

static int acols_acquire(ACols *c, PyObject *columns) {
    if (columns_acquire(c->b, columns, A_N, A_SIZE)) return -1;
    c->slots = PY_SSIZE_T_MAX;
    for (int i = 0; i < A_N; i++)
        if (c->b[i].len / A_SIZE[i] < c->slots) c->slots = c->b[i].len / A_SIZE[i];
    return 0;
}

#define ACOL(c, i, T) ((T *)(c).b[i].buf)

/* state: [next_slot, id_state, last_stamp, admitted], read at the start and written back at the end. */
static int state_get(PyObject *state, Py_ssize_t *next_slot, uint64_t *ids, int64_t *stamp) {
    if (PyList_GET_SIZE(state) != 4) {
        PyErr_SetString(PyExc_TypeError, "state: expected [next_slot, id_state, last_stamp, admitted]");
        return -1;
    }
    *next_slot = PyLong_AsSsize_t(PyList_GET_ITEM(state, 0));
    *ids = PyLong_AsUnsignedLongLongMask(PyList_GET_ITEM(state, 1));
    *stamp = PyLong_AsLongLong(PyList_GET_ITEM(state, 2));
    return PyErr_Occurred() ? -1 : 0;
}

static int state_put(PyObject *state, Py_ssize_t next_slot, uint64_t ids, int64_t stamp, Py_ssize_t admitted) {
    PyObject *v[4] = {PyLong_FromSsize_t(next_slot), PyLong_FromUnsignedLongLong(ids), PyLong_FromLongLong(stamp),
                      PyLong_FromSsize_t(admitted)};
    int rc = 0;
    for (int i = 0; i < 4; i++) {
        if (v[i] == NULL) rc = -1;
        else PyList_SetItem(state, i, v[i]); /* steals */
    }
    return rc;
}

PyObject *native_admit_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows, *ctype, *conns, *orphans, *restored, *given_up, *tombs, *keys, *stat, *labels, *columns, *freel, *intern, *heap,
        *admitted, *state;
    Py_ssize_t i, max_conns, intern_max;
    long long readmit_before, wall_ns;
    unsigned long long gen;
    int flags;
    double active_at, idle_at;
    if (!PyArg_ParseTuple(args, "O!nOO!O!O!O!O!nLO!O!O!O!O!O!nKiLddO!OO!", &PyList_Type, &rows, &i, &ctype, &PyDict_Type,
                          &conns, &PyDict_Type, &orphans, &PyDict_Type, &restored, &PyDict_Type, &given_up,
                          &PyDict_Type, &tombs, &max_conns, &readmit_before,
                          &PyList_Type, &keys, &PyList_Type, &stat, &PyDict_Type, &labels, &PyTuple_Type, &columns,
                          &PyList_Type, &freel, &PyDict_Type, &intern, &intern_max, &gen, &flags, &wall_ns, &active_at,
                          &idle_at, &DeadlineHeapType, &heap, &admitted, &PyList_Type, &state))
        return NULL;
    if (PyTuple_GET_SIZE(columns) != A_N) {
        PyErr_Format(PyExc_TypeError, "expected %d columns", A_N);
        return NULL;
    }
    if (!PyType_Check(ctype) || !slot_cache(&conn_slots, ctype, NAMES, K_N)) return PyLong_FromSsize_t(i);
    Py_ssize_t next_slot;
    uint64_t ids;
    int64_t stamp;
    if (state_get(state, &next_slot, &ids, &stamp)) return NULL;
    ACols c = {0};
    if (acols_acquire(&c, columns)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows), count = 0;
    int failed = 0;
    double deadline = active_at < idle_at ? active_at : idle_at;
    for (; i < n; i++) {
        PyObject *conn = PyList_GET_ITEM(rows, i);
        Vals v;
        if (Py_TYPE(conn) != (PyTypeObject *)ctype || !vals_of(conn, &v)) break;
        PyObject *key = key_of(&v);
        if (key == NULL) {
            if (PyErr_Occurred()) PyErr_Clear();
            break;
        }
        /* -- every check first: a row that stops here has had nothing written */
        PyObject *held = PyDict_GetItemWithError(conns, key);
        if (held != NULL) {
            Py_ssize_t hs = PyLong_AsSsize_t(held);
            Py_DECREF(key);
            if (hs == -1 && PyErr_Occurred()) {
                failed = 1;
                break;
            }
            if (hs >= 0 && hs < c.slots && (uint64_t)ACOL(c, A_SEEN, uint32_t)[hs] == gen) continue; /* a duplicate */
            break;
        }
        if (PyErr_Occurred() || (PyDict_GET_SIZE(restored) && PyDict_Contains(restored, key)) ||
            (PyDict_GET_SIZE(given_up) && PyDict_Contains(given_up, key)) || tombed(tombs, key, v.o[K_CT])) {
            Py_DECREF(key); /* Table._admit_row's cases: a given-up tuple, a tombstone of this incarnation */
            failed = PyErr_Occurred() != NULL;
            break;
        }
        int64_t start = v.start, stop = v.stop;
        if (PyDict_GET_SIZE(conns) + PyDict_GET_SIZE(orphans) >= max_conns || (start && start <= readmit_before) ||
            gen > UINT32_MAX) {
            Py_DECREF(key);
            break;
        }
        Py_ssize_t nfree = PyList_GET_SIZE(freel), s;
        if (nfree) {
            s = PyLong_AsSsize_t(PyList_GET_ITEM(freel, nfree - 1));
            if (s == -1 && PyErr_Occurred()) {
                Py_DECREF(key);
                failed = 1;
                break;
            }
        } else {
            s = next_slot;
        }
        if (s < 0 || s >= c.slots || s >= PyList_GET_SIZE(keys) || s >= PyList_GET_SIZE(stat) ||
            ACOL(c, A_QUEUED, uint8_t)[s]) {
            Py_DECREF(key); /* the columns must grow first, or a slot in an unexpected state: Python's path */
            break;
        }
        /* -- admitted: the objects first (an error here leaves the slot unused), then the columns */
        PyObject *ikey = interned_key(key, intern, intern_max);
        Py_DECREF(key);
        PyObject *st = ikey ? static_of(&v) : NULL;
        PyObject *slot = st ? PyLong_FromSsize_t(s) : NULL;
        if (slot == NULL) {
            Py_XDECREF(ikey);
            Py_XDECREF(st);
            Py_XDECREF(slot);
            failed = 1;
            break;
        }
        int64_t first = start;
        if (!first) first = stamp = wall_ns > stamp + 1 ? wall_ns : stamp + 1; /* Table._stamp */
        int64_t fid = next_id(&ids);
        if (nfree) PyList_SetSlice(freel, nfree - 1, nfree, NULL);
        else next_slot = s + 1;
        PyList_SetItem(keys, s, Py_NewRef(ikey));
        PyList_SetItem(stat, s, st);
        ACOL(c, A_FID, int64_t)[s] = fid;
        ACOL(c, A_FIRST, int64_t)[s] = first;
        ACOL(c, A_LAST_ACTIVE, int64_t)[s] = stop ? stop : wall_ns;
        ACOL(c, A_SEEN, uint32_t)[s] = (uint32_t)gen;
        ACOL(c, A_BITS, uint8_t)[s] = v.counted ? PRESENT_ACTIVE : PRESENT_ACTIVE | UNCOUNTED;
        if (flags) ACOL(c, A_FLAGS, uint8_t)[s] = (uint8_t)flags;
        ACOL(c, A_OP, uint64_t)[s] = v.opk;
        ACOL(c, A_OB, uint64_t)[s] = v.oby;
        ACOL(c, A_RP, uint64_t)[s] = v.rpk;
        ACOL(c, A_RB, uint64_t)[s] = v.rby;
        ACOL(c, A_TCP, int8_t)[s] = (int8_t)v.tcp;
        ACOL(c, A_STATUS, uint32_t)[s] = (uint32_t)v.status;
        ACOL(c, A_START, int64_t)[s] = start;
        ACOL(c, A_CT, uint32_t)[s] = (uint32_t)v.ct;
        ACOL(c, A_MARK, uint32_t)[s] = (uint32_t)v.mark;
        count++;
        int rc = v.o[K_LABELS] != Py_None ? PyDict_SetItem(labels, slot, v.o[K_LABELS]) : 0;
        if (!rc) rc = PyDict_SetItem(conns, ikey, slot);
        if (!rc && admitted != Py_None) {
            PyObject *fido = PyLong_FromLongLong(fid);
            PyObject *t = fido ? PyTuple_Pack(3, slot, fido, conn) : NULL;
            Py_XDECREF(fido);
            rc = t ? PyList_Append(admitted, t) : -1;
            Py_XDECREF(t);
        }
        Py_DECREF(ikey);
        /* ExpiryQueue.push of a slot not queued: both deadlines, the queued flag, one heap entry */
        ACOL(c, A_QACTIVE, double)[s] = active_at;
        ACOL(c, A_QIDLE, double)[s] = idle_at;
        ACOL(c, A_QUEUED, uint8_t)[s] = 1;
        if (!rc) rc = heap_push(heap, ms_of(deadline), (uint32_t)s);
        Py_DECREF(slot);
        if (rc) {
            i++;
            failed = 1;
            break;
        }
    }
    columns_release(c.b, A_N);
    if (state_put(state, next_slot, ids, stamp, count) || failed) return NULL;
    return PyLong_FromSsize_t(i);
}
