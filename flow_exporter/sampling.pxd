# The C types of sampling.py (Cython pure-Python mode).

from flow_exporter.connection cimport Connection

cdef unsigned long long _M, _C0, _C1, _C2, _C3, _LAST, _SPREAD

cdef unsigned long long _be(bytes b, Py_ssize_t at, Py_ssize_t n) except? 0
cdef unsigned long long _rotl(unsigned long long x, int b) noexcept

cdef class Sampler:
    cdef public double probability
    cdef readonly unsigned long long k0, k1
    cdef public object threshold
    cdef unsigned long long _threshold
    cdef unsigned long long v0, v1, v2, v3
    cdef public Py_ssize_t dropped
    cdef readonly set current, previous

    cdef inline void _round(self) noexcept
    cdef inline void _block(self, unsigned long long m) noexcept
    cpdef unsigned long long hash_words(self, unsigned long long w0, unsigned long long w1, unsigned long long w2, unsigned long long w3, unsigned long long w4) noexcept
    cpdef bint decide(self, unsigned int family, unsigned int proto, unsigned long long a_hi, unsigned long long a_lo, unsigned long long sport, unsigned long long b_hi, unsigned long long b_lo, unsigned long long dport, unsigned long long ct_id) except -1
    cpdef bint keeps(self, Connection conn) except -1
