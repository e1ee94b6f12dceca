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

/* A Connection's values, checked: its objects, and what the admission takes of them (AdmitVals). */
typedef struct {
    PyObject *o[K_N];
    AdmitVals a;
} Vals;

static int vals_of(PyObject *conn, Vals *v) {
    AdmitVals *a = &v->a;
    for (int i = 0; i < K_N; i++) v->o[i] = SLOT_AT(conn_slots, conn, i);
    for (int i = 0; i < K_N; i++)
        if (v->o[i] == NULL) return 0;
    if (as_u64(v->o[K_OPK], &a->opk) || as_u64(v->o[K_OBY], &a->oby) || as_u64(v->o[K_RPK], &a->rpk) ||
        as_u64(v->o[K_RBY], &a->rby) || as_u64(v->o[K_CT], &a->ct) || as_u64(v->o[K_MARK], &a->mark) ||
        as_u64(v->o[K_STATUS], &a->status) || as_u64(v->o[K_ODPORT], &a->odport) ||
        as_u64(v->o[K_RSPORT], &a->rsport) || as_u64(v->o[K_RDPORT], &a->rdport) || as_i64(v->o[K_START], &a->start) ||
        as_i64(v->o[K_STOP], &a->stop))
        return 0;
    if (v->o[K_TCP] == Py_None) a->tcp = -1;
    else if (as_i64(v->o[K_TCP], &a->tcp)) return 0;
    if (!PyBool_Check(v->o[K_COUNTED])) return 0;
    a->counted = v->o[K_COUNTED] == Py_True;
    if (!PyBytes_CheckExact(v->o[K_ODST]) || !PyBytes_CheckExact(v->o[K_RDST])) return 0;
    a->odst = (const uint8_t *)PyBytes_AS_STRING(v->o[K_ODST]);
    a->odst_len = PyBytes_GET_SIZE(v->o[K_ODST]);
    a->rdst = (const uint8_t *)PyBytes_AS_STRING(v->o[K_RDST]);
    a->rdst_len = PyBytes_GET_SIZE(v->o[K_RDST]);
    a->labels = v->o[K_LABELS];
    a->icmp = (uint8_t)((v->o[K_ITYPE] != Py_None ? 1 : 0) | (v->o[K_ICODE] != Py_None ? 2 : 0) |
                        (v->o[K_IID] != Py_None ? 4 : 0));
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
static PyObject *static_of(const AdmitVals *v) {
    Py_ssize_t a = v->odst_len, b = v->rdst_len;
    PyObject *out = PyBytes_FromStringAndSize(NULL, a + b + 7);
    if (out == NULL) return NULL;
    uint8_t *p = (uint8_t *)PyBytes_AS_STRING(out);
    if (a) memcpy(p, v->odst, (size_t)a);
    if (b) memcpy(p + a, v->rdst, (size_t)b);
    p += a + b;
    uint64_t ports[3] = {v->odport, v->rsport, v->rdport};
    for (int i = 0; i < 3; i++) {
        p[2 * i] = (uint8_t)(ports[i] >> 8);
        p[2 * i + 1] = (uint8_t)ports[i];
    }
    p[6] = v->icmp;
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
static int tombed(PyObject *tombs, PyObject *key, uint64_t ct_id) {
    if (!PyDict_GET_SIZE(tombs)) return 0;
    PyObject *ct = PyLong_FromUnsignedLongLong(ct_id);
    PyObject *k = ct ? PyTuple_Pack(2, key, ct) : NULL;
    Py_XDECREF(ct);
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

/* A run of admissions: the store's tables and columns, read from the context list Table._admission_context
 * builds (the same values admit_rows took one by one), and the counters the run advances. */
struct Admission {
    PyObject *ctx;  /* the context list (Python may refresh it while paused) */
    PyObject *args; /* a tuple of it, holding the borrowed references below */
    PyObject *conns, *orphans, *restored, *given_up, *tombs, *keys, *stat, *labels, *columns, *freel, *intern,
        *heap, *admitted, *state;
    Py_ssize_t max_conns, intern_max;
    long long readmit_before, wall_ns;
    unsigned long long gen;
    int flags;
    double active_at, idle_at;
    ACols c;
    int open;                       /* the context read and the columns held: admission_one may write */
    Py_ssize_t next_slot, count;   /* count: admitted since the context was read */
    uint64_t ids;
    int64_t stamp;
};

/* Read the context, acquire the columns, take the counters from its state list. */
int admission_resume(Admission *a) {
    if (a->open) return 0;
    PyObject *args = PyList_AsTuple(a->ctx);
    if (args == NULL) return -1;
    Py_XSETREF(a->args, args);
    if (!PyArg_ParseTuple(args, "O!O!O!O!nLO!O!O!O!O!O!nKiLddOOO!:admission context", &PyDict_Type, &a->orphans,
                          &PyDict_Type, &a->restored, &PyDict_Type, &a->given_up, &PyDict_Type, &a->tombs,
                          &a->max_conns, &a->readmit_before, &PyList_Type, &a->keys, &PyList_Type, &a->stat,
                          &PyDict_Type, &a->labels, &PyTuple_Type, &a->columns, &PyList_Type, &a->freel, &PyDict_Type,
                          &a->intern, &a->intern_max, &a->gen, &a->flags, &a->wall_ns, &a->active_at, &a->idle_at,
                          &a->heap, &a->admitted, &PyList_Type, &a->state))
        return -1;
    if (!heap_check(a->heap)) return -1;
    if (PyTuple_GET_SIZE(a->columns) != A_N) {
        PyErr_Format(PyExc_TypeError, "expected %d columns", A_N);
        return -1;
    }
    if (state_get(a->state, &a->next_slot, &a->ids, &a->stamp)) return -1;
    if (acols_acquire(&a->c, a->columns)) return -1;
    a->count = 0;
    a->open = 1;
    return 0;
}

/* The counters written back to the state list and the columns released: before Python runs (it may grow the
 * columns, admit rows itself, compact the heap); admission_resume reads everything again. */
int admission_pause(Admission *a) {
    if (!a->open) return 0;
    a->open = 0;
    columns_release(a->c.b, A_N);
    return state_put(a->state, a->next_slot, a->ids, a->stamp, a->count);
}

Admission *admission_open(PyObject *conns, PyObject *ctx) {
    if (!PyList_Check(ctx)) {
        PyErr_SetString(PyExc_TypeError, "admission context: expected a list");
        return NULL;
    }
    Admission *a = PyMem_Calloc(1, sizeof(Admission));
    if (a == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    a->conns = conns;
    a->ctx = Py_NewRef(ctx);
    if (admission_resume(a)) {
        admission_close(a);
        return NULL;
    }
    return a;
}

int admission_close(Admission *a) {
    if (a == NULL) return 0;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb); /* an error being raised stays the one raised */
    int rc = admission_pause(a);
    if (type != NULL) PyErr_Restore(type, value, tb);
    Py_XDECREF(a->args);
    Py_XDECREF(a->ctx);
    PyMem_Free(a);
    return rc;
}

/* Admit one new connection with `key` (a Connection.key tuple) and values `v`, as Table._admit would: 1
 * admitted (*slot_out its slot), 2 a duplicate of a row this dump already showed (nothing to do), 0 stopped
 * (nothing written: the row is Python's), -1 an error. `lookup`: whether the keyed table may hold the key
 * (the fused poll has just looked it up). `conn` is what the hook for new connections gets (NULL: no hook
 * may be set). */
int admission_one(Admission *a, PyObject *key, const AdmitVals *v, int lookup, PyObject *conn, Py_ssize_t *slot_out) {
    if (!a->open) return 0;
    if (a->admitted != Py_None && conn == NULL) return 0;
    if (v->ct > UINT32_MAX || v->mark > UINT32_MAX || v->status > UINT32_MAX || v->odport > 0xFFFF ||
        v->rsport > 0xFFFF || v->rdport > 0xFFFF || v->tcp < -128 || v->tcp > 127)
        return 0; /* a value a column cannot hold */
    if (v->labels != Py_None && !PyBytes_CheckExact(v->labels)) return 0;
    ACols *c = &a->c;
    if (lookup) {
        PyObject *held = PyDict_GetItemWithError(a->conns, key);
        if (held != NULL) {
            Py_ssize_t hs = PyLong_AsSsize_t(held);
            if (hs == -1 && PyErr_Occurred()) return -1;
            return hs >= 0 && hs < c->slots && (uint64_t)ACOL(*c, A_SEEN, uint32_t)[hs] == a->gen ? 2 : 0;
        }
        if (PyErr_Occurred()) return -1;
    }
    /* Table._admit_row's cases: a restored row, a given-up tuple, a tombstone of this incarnation */
    if (PyDict_GET_SIZE(a->restored)) {
        int r = PyDict_Contains(a->restored, key);
        if (r) return r < 0 ? -1 : 0;
    }
    if (PyDict_GET_SIZE(a->given_up)) {
        int r = PyDict_Contains(a->given_up, key);
        if (r) return r < 0 ? -1 : 0;
    }
    if (tombed(a->tombs, key, v->ct)) return PyErr_Occurred() ? -1 : 0;
    if (PyDict_GET_SIZE(a->conns) + PyDict_GET_SIZE(a->orphans) >= a->max_conns ||
        (v->start && v->start <= a->readmit_before) || a->gen > UINT32_MAX)
        return 0;
    Py_ssize_t nfree = PyList_GET_SIZE(a->freel), s;
    if (nfree) {
        s = PyLong_AsSsize_t(PyList_GET_ITEM(a->freel, nfree - 1));
        if (s == -1 && PyErr_Occurred()) return -1;
    } else {
        s = a->next_slot;
    }
    if (s < 0 || s >= c->slots || s >= PyList_GET_SIZE(a->keys) || s >= PyList_GET_SIZE(a->stat) ||
        ACOL(*c, A_QUEUED, uint8_t)[s])
        return 0; /* the columns must grow first, or a slot in an unexpected state: Python's path */
    /* -- admitted: the objects first (an error here leaves the slot unused), then the columns */
    PyObject *ikey = interned_key(key, a->intern, a->intern_max);
    PyObject *st = ikey ? static_of(v) : NULL;
    PyObject *slot = st ? PyLong_FromSsize_t(s) : NULL;
    if (slot == NULL) {
        Py_XDECREF(ikey);
        Py_XDECREF(st);
        return -1;
    }
    int64_t start = v->start, stop = v->stop, first = start;
    if (!first) first = a->stamp = a->wall_ns > a->stamp + 1 ? a->wall_ns : a->stamp + 1; /* Table._stamp */
    int64_t fid = next_id(&a->ids);
    if (nfree) PyList_SetSlice(a->freel, nfree - 1, nfree, NULL);
    else a->next_slot = s + 1;
    PyList_SetItem(a->keys, s, Py_NewRef(ikey));
    PyList_SetItem(a->stat, s, st);
    ACOL(*c, A_FID, int64_t)[s] = fid;
    ACOL(*c, A_FIRST, int64_t)[s] = first;
    ACOL(*c, A_LAST_ACTIVE, int64_t)[s] = stop ? stop : a->wall_ns;
    ACOL(*c, A_SEEN, uint32_t)[s] = (uint32_t)a->gen;
    ACOL(*c, A_BITS, uint8_t)[s] = v->counted ? PRESENT_ACTIVE : PRESENT_ACTIVE | UNCOUNTED;
    if (a->flags) ACOL(*c, A_FLAGS, uint8_t)[s] = (uint8_t)a->flags;
    ACOL(*c, A_OP, uint64_t)[s] = v->opk;
    ACOL(*c, A_OB, uint64_t)[s] = v->oby;
    ACOL(*c, A_RP, uint64_t)[s] = v->rpk;
    ACOL(*c, A_RB, uint64_t)[s] = v->rby;
    ACOL(*c, A_TCP, int8_t)[s] = (int8_t)v->tcp;
    ACOL(*c, A_STATUS, uint32_t)[s] = (uint32_t)v->status;
    ACOL(*c, A_START, int64_t)[s] = start;
    ACOL(*c, A_CT, uint32_t)[s] = (uint32_t)v->ct;
    ACOL(*c, A_MARK, uint32_t)[s] = (uint32_t)v->mark;
    a->count++;
    int rc = v->labels != Py_None ? PyDict_SetItem(a->labels, slot, v->labels) : 0;
    if (!rc) rc = PyDict_SetItem(a->conns, ikey, slot);
    if (!rc && a->admitted != Py_None) {
        PyObject *fido = PyLong_FromLongLong(fid);
        PyObject *t = fido ? PyTuple_Pack(3, slot, fido, conn) : NULL;
        Py_XDECREF(fido);
        rc = t ? PyList_Append(a->admitted, t) : -1;
        Py_XDECREF(t);
    }
    Py_DECREF(ikey);
    Py_DECREF(slot);
    /* ExpiryQueue.push of a slot not queued: both deadlines, the queued flag, one heap entry */
    double deadline = a->active_at < a->idle_at ? a->active_at : a->idle_at;
    ACOL(*c, A_QACTIVE, double)[s] = a->active_at;
    ACOL(*c, A_QIDLE, double)[s] = a->idle_at;
    ACOL(*c, A_QUEUED, uint8_t)[s] = 1;
    if (!rc) rc = heap_push(a->heap, ms_of(deadline), (uint32_t)s);
    if (rc) return -1;
    *slot_out = s;
    return 1;
}

PyObject *native_admit_rows(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *rows, *ctype, *conns, *ctx;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "O!nOO!O!", &PyList_Type, &rows, &i, &ctype, &PyDict_Type, &conns, &PyList_Type, &ctx))
        return NULL;
    int direct = PyType_Check(ctype) ? slot_cache(&conn_slots, ctype, NAMES, K_N) : 0;
    if (direct < 0) return NULL;
    if (!direct) return PyLong_FromSsize_t(i);
    Admission *a = admission_open(conns, ctx);
    if (a == NULL) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(rows);
    int failed = 0;
    for (; i < n; i++) {
        PyObject *conn = PyList_GET_ITEM(rows, i);
        Vals v;
        if (Py_TYPE(conn) != (PyTypeObject *)ctype || !vals_of(conn, &v)) break;
        PyObject *key = key_of(&v);
        if (key == NULL) {
            if (PyErr_Occurred()) PyErr_Clear();
            break;
        }
        Py_ssize_t s;
        int got = admission_one(a, key, &v.a, 1, conn, &s);
        Py_DECREF(key);
        if (got < 0) failed = 1;
        if (got <= 0) break;
    }
    if (admission_close(a) || failed) return NULL;
    return PyLong_FromSsize_t(i);
}
