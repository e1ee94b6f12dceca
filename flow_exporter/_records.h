/* The compiled record path's entry points (flow_exporter/_records.c), in flow_exporter._native's method table. */
#ifndef FLOW_EXPORTER_RECORDS_H
#define FLOW_EXPORTER_RECORDS_H
#include <Python.h>

#include <math.h>
#include <stdint.h>

/* Avro long (int64): zigzag, then base-128 little-endian, at p (room for 10 bytes); returns its length. */
static inline int avro_long(uint8_t *p, int64_t n) {
    uint64_t z = ((uint64_t)n << 1) ^ (uint64_t)(n >> 63);
    int i = 0;
    while (z >= 0x80) {
        p[i++] = (uint8_t)((z & 0x7F) | 0x80);
        z >>= 7;
    }
    p[i++] = (uint8_t)z;
    return i;
}

/* v as `size` bytes, big-endian (network order, as struct's "!"), at p; returns the end. */
static inline uint8_t *be_put(uint8_t *p, uint64_t v, int size) {
    for (int i = size - 1; i >= 0; i--) {
        p[i] = (uint8_t)v;
        v >>= 8;
    }
    return p + size;
}

/* An exact int that fits int64 (bool included, as Python's arithmetic takes it): 0, else -1 (no error set). */
static inline int as_i64(PyObject *o, int64_t *out) {
    if (o == NULL || !PyLong_Check(o)) return -1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* An int in [0, 2**64): 0, else -1 (no error set). */
static inline int as_u64(PyObject *o, uint64_t *out) {
    if (o == NULL || !PyLong_Check(o)) return -1;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* Writable buffers of n columns (a tuple of arrays and bytearrays) whose items have the given sizes: 0, or -1
 * with an exception set and nothing held. Shared by the poll's column writers (_native.c, _admit.c). */
int columns_acquire(Py_buffer *b, PyObject *columns, int n, const Py_ssize_t *sizes);
void columns_release(Py_buffer *b, int n);

/* Shared by the C files: the offsets of a slots dataclass's fields (1 if every one is a plain object slot of the
 * type or a base, 0 if not, -1 with an error set when the lookup failed). */
int slot_offsets(PyObject *type, const char *const *names, int n, Py_ssize_t *offsets);

/* slot_offsets of the last type seen, kept: resolved again only when another type comes (or after a failed
 * lookup, which is not kept). The offsets hold for instances of exactly that type (or a subtype). */
typedef struct {
    PyObject *type;
    int direct; /* 1: every field is a plain object slot at off[i] */
    Py_ssize_t off[32];
} SlotCache;
int slot_cache(SlotCache *c, PyObject *type, const char *const *names, int n);
#define SLOT_AT(c, o, i) (*(PyObject **)((char *)(o) + (c).off[i]))

/* flow_exporter/_admit.c: admit_rows, and the admission it runs, which the fused poll (_native.c) runs too */
PyObject *native_admit_rows(PyObject *self, PyObject *args);
/* A new connection's values as the admission takes them, from a Connection or straight from a dump row. */
typedef struct {
    const uint8_t *odst, *rdst; /* the destination addresses' bytes (the Connection's, or the dump buffer's) */
    Py_ssize_t odst_len, rdst_len;
    PyObject *labels; /* borrowed: bytes or None */
    uint64_t opk, oby, rpk, rby, ct, mark, status, odport, rsport, rdport;
    int64_t start, stop, tcp; /* tcp: -1 for none */
    int counted;
    uint8_t icmp; /* columns.py _static's bits: 1 ICMP type, 2 code, 4 id present */
} AdmitVals;
typedef struct Admission Admission;
Admission *admission_open(PyObject *connections, PyObject *context); /* NULL with an error set */
int admission_one(Admission *a, PyObject *key, const AdmitVals *v, int lookup, PyObject *conn, Py_ssize_t *slot);
int admission_pause(Admission *a);  /* before Python runs; 0 or -1 */
int admission_resume(Admission *a); /* after it; 0 or -1 */
int admission_close(Admission *a);  /* pause and free; 0 or -1 */
/* The expiry queue's heap (flow_exporter/deadline_heap.py, compiled by Cython), through the C interface it
 * exports (deadline_heap_api.h, imported when _native loads): (deadline millisecond, slot) pairs ordered as the
 * ints `ms << 32 | slot` are. The admission pushes a new connection's entry. */
int heap_check(PyObject *o);                              /* 1 if o is a DeadlineHeap, else 0 with TypeError set */
int heap_push(PyObject *heap, int64_t ms, uint32_t slot); /* 0, or -1 with MemoryError */
/* deadline_heap.ms_of: a deadline's millisecond, the heap's first key (until the admission is ported) */
static inline int64_t ms_of(double deadline) { return (int64_t)floor(deadline * 1000.0); }

#endif
