# The C types of record_bytes.py (Cython pure-Python mode).

from flow_exporter.export cimport Export

cdef long long _TCP, _ICMP, _ICMPV6, _AF_INET, _AF_INET6
cdef list _TCP_STATES
cdef tuple _K8S
cdef bytes _NO_K8S

# the error value is one no field holds in practice (0 is common: Cython would ask whether an error is set)
cdef long long _long(object v) except? -0x7FFFFFFFFFFFFFFF
cdef long long _small(object v, int bits) except? -0x7FFFFFFFFFFFFFFF
cdef bytes _utf8(object s)

cdef class _Out:
    cdef list parts
    cdef bytearray out
    cdef unsigned char *buf
    cdef Py_ssize_t pos, cap
    cdef void reset(self) noexcept
    cdef int room(self, Py_ssize_t n) except -1
    cdef inline int u8(self, unsigned char v) except -1
    cdef inline int varint(self, long long v) except -1
    cdef inline int be16(self, unsigned int v) except -1
    cdef inline int raw(self, bytes data) except -1
    cdef int text(self, object s) except -1
    cdef bytes take_after(self, bytes head, bytes prefix)
    cdef bytes take(self)

cdef void _put_address(_Out o, long long family, object packed) except *

cdef class RecordEncoder:
    cdef readonly str node
    cdef readonly object seed
    cdef _Out _out
    cdef bytes _node
    cdef bytes _attributes
    cdef object _probability_at
    cpdef bytes static(self, Export export)
    cdef bytes _static(self, Export e)
    cdef void _put_prefix(self, _Out o, Export e) except *
    cdef void _put_k8s(self, _Out o, object meta) except *
    cdef void _put_tail(self, _Out o, Export e, long long export_ms) except *
    cpdef bytes encode(self, Export export, object export_ms)

cdef void _put_map(_Out o, dict m) except *
cdef void _put_counters(_Out o, object counters) except *
cdef tuple _key(object key)
cdef void _put_key(_Out o, Export e) except *
