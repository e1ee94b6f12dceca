/*
 * What the C files share, part of flow_exporter._native: Connection's field offsets (which the fused poll and
 * the admission fill and read) and the store's columns as buffers. What is due, a record's build and its
 * settling are flow_exporter/ledger_core.py's (issue 39).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "_records.h"
#include "connection.h" /* Connection's struct, written by Cython from connection.pxd (no symbol of it is used) */

/* The compiled Connection's fields (flow_exporter/connection.py): their offsets in its struct. Cython exposes them
 * as getset descriptors, which say nothing of where the field is: the struct does. */
#define FIELD(f) {#f, offsetof(struct FlowConnection, f)}
static const struct {
    const char *name;
    Py_ssize_t off;
} CONNECTION_FIELDS[] = {
    FIELD(family), FIELD(proto), FIELD(orig_src), FIELD(orig_dst), FIELD(orig_sport), FIELD(orig_dport),
    FIELD(reply_src), FIELD(reply_dst), FIELD(reply_sport), FIELD(reply_dport), FIELD(zone), FIELD(ct_id),
    FIELD(mark), FIELD(labels), FIELD(status), FIELD(tcp_state), FIELD(orig_packets), FIELD(orig_bytes),
    FIELD(reply_packets), FIELD(reply_bytes), FIELD(start_ns), FIELD(stop_ns), FIELD(icmp_type), FIELD(icmp_code),
    FIELD(icmp_id), FIELD(counted),
};
#undef FIELD

/* The offset of field `name` if `d` is the compiled Connection's descriptor of it (a getset of that type, whose
 * instances have connection.h's layout), else -1. */
static Py_ssize_t compiled_connection_field(PyObject *d, const char *name) {
    if (!Py_IS_TYPE(d, &PyGetSetDescr_Type)) return -1;
    PyTypeObject *owner = ((PyDescrObject *)d)->d_type;
    if (strcmp(owner->tp_name, "flow_exporter.connection.Connection") != 0 ||
        owner->tp_basicsize != (Py_ssize_t)sizeof(struct FlowConnection))
        return -1;
    for (size_t i = 0; i < sizeof CONNECTION_FIELDS / sizeof CONNECTION_FIELDS[0]; i++)
        if (strcmp(CONNECTION_FIELDS[i].name, name) == 0) return CONNECTION_FIELDS[i].off;
    return -1;
}

/* The offsets of `names` in `type` (the compiled Connection, a subtype of it, or a slots dataclass): 1 if every
 * one is a plain, writable object field whose instances can be made by tp_alloc and filled directly, 0 if not
 * (the caller takes the Python path), -1 with the error set when a lookup failed otherwise than by a missing
 * attribute (a MemoryError, a metaclass that raised): that is no answer about the type, and must not be taken
 * for one. */
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
        Py_ssize_t compiled_off = compiled_connection_field(d, names[i]);
        if ((compiled_off < 0 && !Py_IS_TYPE(d, &PyMemberDescr_Type)) ||
            !PyType_IsSubtype((PyTypeObject *)type, ((PyDescrObject *)d)->d_type))
            r = 0;
        else if (compiled_off >= 0) {
            offsets[i] = compiled_off;
        } else {
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
