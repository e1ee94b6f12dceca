/* The compiled record path's entry points (flow_exporter/_records.c, _prefix.c, _delivery.c), in flow_exporter._native's method table. */
#ifndef FLOW_EXPORTER_RECORDS_H
#define FLOW_EXPORTER_RECORDS_H
#include <Python.h>

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

/* Shared by the C files: the slot offsets of a slots dataclass's fields (1 if every one is a plain object slot). */
int slot_offsets(PyObject *type, const char *const *names, int n, Py_ssize_t *offsets);

/* slot_offsets of the last type seen, kept: resolved again only when another type comes. */
typedef struct {
    PyObject *type;
    int direct; /* 1: every field is a plain object slot at off[i] */
    Py_ssize_t off[32];
} SlotCache;
int slot_cache(SlotCache *c, PyObject *type, const char *const *names, int n);
#define SLOT_AT(c, o, i) (*(PyObject **)((char *)(o) + (c).off[i]))

PyObject *native_prepare_records(PyObject *self, PyObject *args);
PyObject *native_journal_sent(PyObject *self, PyObject *args);
PyObject *native_build_records(PyObject *self, PyObject *args);
PyObject *native_acknowledge_delivered(PyObject *self, PyObject *args);
PyObject *native_journal_acked(PyObject *self, PyObject *args);
PyObject *native_due_slots(PyObject *self, PyObject *args);
/* flow_exporter/_prefix.c */
PyObject *native_encode_prefix(PyObject *self, PyObject *args);
/* flow_exporter/_delivery.c: the Deliveries type, added to the module, and produce_run */
int delivery_add_types(PyObject *module);
PyObject *native_produce_run(PyObject *self, PyObject *args);

#endif
