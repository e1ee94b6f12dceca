# The C types of checkpoint_rows.py (Cython pure-Python mode).

from flow_exporter.export cimport Export

cdef class _Out:
    cdef bytearray out
    cdef unsigned char *buf
    cdef Py_ssize_t pos, start, cap
    cdef void room(self, Py_ssize_t n) except *
    cdef void close(self) except *
    cdef inline void u8(self, unsigned char v) noexcept
    cdef inline void be(self, unsigned long long v, int size) noexcept
    cdef inline void i64(self, long long v) noexcept
    cdef void raw(self, bytes data) noexcept

cpdef Py_ssize_t row_size(Py_ssize_t alen) noexcept
cdef Py_ssize_t _RECORD_SIZE, _ACK_SIZE

# the error value is one no field holds in practice (0 is common: Cython would ask whether an error is set)
cdef unsigned long long _uint(object v, int bits) except? 0xFFFFFFFFFFFFFFFF
cdef long long _int64(object v) except? -0x7FFFFFFFFFFFFFFF
cdef bytes _blob(object v)
cdef Py_ssize_t _alen(object key) except -1
cdef void _put_message(_Out o, bytes topic, bytes key, bytes value) except *
cdef object _four(object totals)
cdef void _put_row(_Out o, tuple key, Py_ssize_t alen, unsigned int ct, unsigned long long start,
                   unsigned long long first, long long flow_id, unsigned long long next_seq, unsigned long long b0,
                   unsigned long long b1, unsigned long long b2, unsigned long long b3, unsigned char flags) except *
cdef void _put_row_of(_Out o, tuple key, Py_ssize_t alen, object ct, object start, object first, object flow_id, object next_seq,
                      object base, object flags) except *

cdef class _Columns:
    cdef unsigned int[:] ct, seq
    cdef long long[:] start, first, fid
    cdef unsigned long long[:] bp, bb, brp, brb
    cdef unsigned char[:] flags
    cdef Py_ssize_t rows
