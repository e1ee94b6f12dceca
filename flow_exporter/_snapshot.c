/* A checkpoint snapshot's rows and records, packed in one call each (issue 24), part of flow_exporter._native.
 *
 *   pack_rows(slots, keys, columns, out) -> count, or None
 *     The row of every slot, from the store's columns (flow.ReportedRows: ct_id, start, first seen, flow id,
 *     next sequence, base totals x4, flags), appended to the bytearray `out` exactly as checkpoint._pack_row
 *     packs a Restored.
 *   pack_records(exports, out) -> count, or None
 *     Every record of the list, appended as checkpoint._pack_record packs it.
 *
 * Why compiled: at 50k records/s over a 250k table a snapshot is due every few seconds, and making a Restored
 * per connection and packing it took ~15% of the exporter's CPU (py-spy, BENCHMARKS.md). None, with `out` as
 * it was, when a value would not pack exactly as struct packs it (a negative start, an address of another
 * length, a slot past the columns, an odd type): the caller then packs in Python, which packs or raises as it
 * always did. The property tests (tests/unit/test_native_snapshot.py) hold both to the same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#include "_records.h"

/* The columns of flow.ReportedRows, in its order, and their item sizes (array I, q, q, q, I, Q x4; bytearray). */
enum { R_CT, R_START, R_FIRST, R_FID, R_SEQ, R_BP, R_BB, R_BRP, R_BRB, R_FLAGS, R_N };
static const Py_ssize_t R_SIZE[R_N] = {4, 8, 8, 8, 4, 8, 8, 8, 8, 1};

/* Room for `more` bytes after out's first `len`; the start of them, or NULL with an error set. */
static uint8_t *grow(PyObject *out, Py_ssize_t len, Py_ssize_t more) {
    if (more > PY_SSIZE_T_MAX - len) {
        PyErr_NoMemory();
        return NULL;
    }
    if (PyByteArray_Resize(out, len + more)) return NULL;
    return (uint8_t *)PyByteArray_AS_STRING(out) + len;
}

PyObject *native_pack_rows(PyObject *self, PyObject *args) {
    PyObject *slots, *keys, *columns, *out;
    if (!PyArg_ParseTuple(args, "O!O!O!O!", &PyList_Type, &slots, &PyList_Type, &keys, &PyTuple_Type, &columns,
                          &PyByteArray_Type, &out))
        return NULL;
    if (PyTuple_GET_SIZE(columns) != R_N) Py_RETURN_NONE;
    Py_buffer b[R_N];
    if (columns_acquire(b, columns, R_N, R_SIZE)) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_BufferError)) return NULL;
        PyErr_Clear(); /* not arrays: the Python packer reads them */
        Py_RETURN_NONE;
    }
    Py_ssize_t rows = 0;
    for (int i = 0; i < R_N; i++) {
        Py_ssize_t n = b[i].len / R_SIZE[i];
        if (i == 0 || n < rows) rows = n;
    }
    Py_ssize_t n = PyList_GET_SIZE(slots), base = PyByteArray_GET_SIZE(out);
    if (n > (PY_SSIZE_T_MAX - base) / CHECKPOINT_ROW_MAX) goto fallback;
    /* The exact room first: room for the largest row everywhere (IPv6 keys, 117 bytes) was 24 MB more than a 1M
     * IPv4 table's 93 MB, and a snapshot's buffer is the exporter's peak memory. A key that is not what the
     * writing pass expects counts as the largest; that pass checks it. */
    Py_ssize_t room = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t s = PyLong_CheckExact(PyList_GET_ITEM(slots, i)) ? PyLong_AsSsize_t(PyList_GET_ITEM(slots, i)) : -1;
        if (s == -1 && PyErr_Occurred()) PyErr_Clear();
        PyObject *k = s >= 0 && s < PyList_GET_SIZE(keys) ? PyList_GET_ITEM(keys, s) : NULL;
        PyObject *src = k != NULL && PyTuple_CheckExact(k) && PyTuple_GET_SIZE(k) == 6 ? PyTuple_GET_ITEM(k, 2) : NULL;
        room += src != NULL && PyBytes_CheckExact(src) && PyBytes_GET_SIZE(src) == 4 ? CHECKPOINT_ROW_SIZE(4)
                                                                                      : CHECKPOINT_ROW_MAX;
    }
    uint8_t *p = grow(out, base, room);
    if (p == NULL) {
        columns_release(b, R_N);
        return NULL;
    }
    const uint8_t *limit = p + room;
    const uint32_t *ct = b[R_CT].buf, *seq = b[R_SEQ].buf;
    const int64_t *start = b[R_START].buf, *first = b[R_FIRST].buf, *fid = b[R_FID].buf;
    const uint64_t *bp = b[R_BP].buf, *bb = b[R_BB].buf, *brp = b[R_BRP].buf, *brb = b[R_BRB].buf;
    const uint8_t *flags = b[R_FLAGS].buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *so = PyList_GET_ITEM(slots, i);
        if (!PyLong_CheckExact(so)) goto fallback;
        Py_ssize_t s = PyLong_AsSsize_t(so);
        if (s < 0 || s >= rows || s >= PyList_GET_SIZE(keys)) {
            PyErr_Clear();
            goto fallback;
        }
        CheckpointKey k;
        if (checkpoint_key(PyList_GET_ITEM(keys, s), &k)) goto fallback;
        if (p + CHECKPOINT_ROW_SIZE(k.alen) > limit) goto fallback; /* past the room the sizing pass found */
        if (start[s] < 0 || first[s] < 0) goto fallback; /* struct's Q refuses them */
        const uint64_t totals[4] = {bp[s], bb[s], brp[s], brb[s]}; /* the base: the last record's */
        p = put_checkpoint_row(p, &k, ct[s], (uint64_t)start[s], (uint64_t)first[s], (uint64_t)fid[s], seq[s], totals,
                               flags[s]);
    }
    Py_ssize_t end = p - (uint8_t *)PyByteArray_AS_STRING(out);
    columns_release(b, R_N);
    if (PyByteArray_Resize(out, end)) return NULL;
    return PyLong_FromSsize_t(n);
fallback:
    columns_release(b, R_N);
    if (PyByteArray_Resize(out, base)) return NULL;
    Py_RETURN_NONE;
}

/* Export's fields a snapshot record reads. */
enum { E_FLOW_ID, E_SEQ, E_TOTALS, E_TOPIC, E_KEY, E_VALUE, E_N };
static const char *const ENAMES[E_N] = {"flow_id", "sequence", "totals", "topic", "key", "value"};
static SlotCache e_slots;

/* `e.x or default` for bytes (None and empty alike): its bytes and length, or 1 when not plain bytes/None. */
static int bytes_or_empty(PyObject *o, const char **bytes, Py_ssize_t *len) {
    if (o == Py_None) {
        *bytes = "";
        *len = 0;
        return 0;
    }
    if (!PyBytes_CheckExact(o)) return 1;
    *bytes = PyBytes_AS_STRING(o);
    *len = PyBytes_GET_SIZE(o);
    return 0;
}

PyObject *native_pack_records(PyObject *self, PyObject *args) {
    PyObject *exports, *out;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &exports, &PyByteArray_Type, &out)) return NULL;
    Py_ssize_t base = PyByteArray_GET_SIZE(out), len = base;
    Py_ssize_t n = PyList_GET_SIZE(exports);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GET_ITEM(exports, i);
        int direct = slot_cache(&e_slots, (PyObject *)Py_TYPE(e), ENAMES, E_N);
        if (direct < 0) return NULL; /* `out` keeps what was packed, as when growing it fails */
        if (!direct || !slots_set(&e_slots, e, E_N)) goto fallback; /* an unset field: the pure packer raises */
        int64_t flow_id;
        uint64_t seq, t[4];
        if (as_i64(SLOT_AT(e_slots, e, E_FLOW_ID), &flow_id) || as_u64(SLOT_AT(e_slots, e, E_SEQ), &seq))
            goto fallback;
        PyObject *tot = SLOT_AT(e_slots, e, E_TOTALS);
        if (!PyTuple_CheckExact(tot) || PyTuple_GET_SIZE(tot) != 4) goto fallback;
        for (int j = 0; j < 4; j++)
            if (as_u64(PyTuple_GET_ITEM(tot, j), &t[j])) goto fallback;
        const char *topic, *key, *value;
        Py_ssize_t tl, kl, vl;
        PyObject *to = SLOT_AT(e_slots, e, E_TOPIC);
        if (to == Py_None) {
            topic = "";
            tl = 0;
        } else if (PyUnicode_CheckExact(to)) {
            topic = PyUnicode_AsUTF8AndSize(to, &tl); /* cached in the str: no copy kept */
            if (topic == NULL) {
                PyErr_Clear(); /* a lone surrogate: the Python encode raises it */
                goto fallback;
            }
        } else
            goto fallback;
        if (bytes_or_empty(SLOT_AT(e_slots, e, E_KEY), &key, &kl) ||
            bytes_or_empty(SLOT_AT(e_slots, e, E_VALUE), &value, &vl))
            goto fallback;
        if (tl > 0xFFFF || kl > 0xFFFF || vl > 0xFFFFFFFFLL) goto fallback;
        Py_ssize_t size = 8 * 6 + 2 + 2 + 4 + tl + kl + vl;
        uint8_t *p = grow(out, len, size);
        if (p == NULL) return NULL;
        p = be_put(p, (uint64_t)flow_id, 8);
        p = be_put(p, seq, 8);
        for (int j = 0; j < 4; j++) p = be_put(p, t[j], 8);
        p = be_put(p, (uint64_t)tl, 2);
        p = be_put(p, (uint64_t)kl, 2);
        p = be_put(p, (uint64_t)vl, 4);
        memcpy(p, topic, tl);
        p += tl;
        memcpy(p, key, kl);
        p += kl;
        memcpy(p, value, vl);
        len += size;
    }
    return PyLong_FromSsize_t(n);
fallback:
    if (PyByteArray_Resize(out, base)) return NULL;
    Py_RETURN_NONE;
}
