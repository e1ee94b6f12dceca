# The C types of sampling.py (Cython pure-Python mode).

from flow_exporter.connection cimport Connection

cdef unsigned long long _M, _C0, _C1, _C2, _C3, _LAST, _SPREAD

cdef unsigned long long _be(bytes b, Py_ssize_t at, Py_ssize_t n) except? 0
cdef unsigned long long _rotl(unsigned long long x, int b) noexcept

cdef Py_ssize_t _MIN_CAPACITY
cdef unsigned int _KEPT, _INTERVAL
cdef int _DROP, _KEEP, _ASK

cdef class DroppedSet:
    cdef readonly Py_ssize_t count, met
    cdef unsigned int interval
    cdef unsigned long long mask
    cdef object key_array, mark_array
    cdef unsigned long long[::1] keys, old_keys
    cdef unsigned int[::1] marks, old_marks

    cdef void _alloc(self, Py_ssize_t capacity) except *
    cdef Py_ssize_t _slot(self, unsigned long long key) noexcept
    cdef unsigned int _met(self, Py_ssize_t i) noexcept
    cdef void _put(self, unsigned long long key, unsigned int mark) noexcept
    cpdef int touch(self, unsigned long long key) except -1
    cpdef bint meet(self, unsigned long long key, bint kept=*) except -1
    cdef void _rehash(self, Py_ssize_t capacity, bint met_only) except *
    cpdef void dump_done(self) except *

cdef class Sampler:
    cdef public double probability
    cdef readonly unsigned long long k0, k1
    cdef public object threshold
    cdef unsigned long long _threshold
    cdef unsigned long long v0, v1, v2, v3
    cdef public Py_ssize_t dropped
    cdef readonly DroppedSet remembered
    cdef readonly unsigned long long h, key
    cdef unsigned long long _deep
    cdef public long long now_ns
    cdef public object schedule
    cdef readonly bint every

    cdef inline void _round(self) noexcept
    cdef inline void _block(self, unsigned long long m) noexcept
    cpdef unsigned long long hash_words(self, unsigned long long w0, unsigned long long w1, unsigned long long w2, unsigned long long w3, unsigned long long w4) noexcept
    cpdef int decide(self, unsigned int family, unsigned int proto, unsigned long long a_hi, unsigned long long a_lo, unsigned long long sport, unsigned long long b_hi, unsigned long long b_lo, unsigned long long dport, unsigned long long ct_id) except -1
    cpdef bint first_meeting(self, long long start_ns) except -1
    cpdef bint keeps(self, Connection conn, object held=*) except -1
    cdef int _decide_connection(self, Connection conn) except -1
