# The C types of cilium_ct.py (Cython pure-Python mode).

from flow_exporter.connection cimport Connection

cdef extern from "<unistd.h>":
    long syscall(long number, ...) nogil

cdef extern from "<sys/syscall.h>":
    enum: SYS_bpf

cdef unsigned int _RX_CLOSING, _TX_CLOSING, _DYING
cdef Py_ssize_t _VALUE_SIZE, _LIFETIME, _FLAGS, _REV_NAT
cdef int _AF_INET, _AF_INET6, _ICMP, _ICMPV6

cdef void _through(Connection conn, bytes address, object port) noexcept

cdef class _Bytes:
    cdef const unsigned char[::1] v

cdef unsigned int _u16be(_Bytes b, Py_ssize_t at) noexcept
cdef unsigned int _u16le(_Bytes b, Py_ssize_t at) noexcept
cdef unsigned long long _ule(_Bytes b, Py_ssize_t at, int size) noexcept

cdef class CtDecoder:
    cdef public int layout
    cdef public long long now
    cdef public dict services
    cdef public list held
    cdef public Py_ssize_t entries, related, service_entries, twins, empty
    cdef object contains
    cdef unsigned char[::1] _twin, _value
    cdef unsigned long long[::1] _attr

    cdef bint _has_twin(self, int fd, _Bytes kb, bytes keys, Py_ssize_t k, Py_ssize_t key_size) except -1

    cdef Connection _connection(self, _Bytes kb, _Bytes vb, bytes keys, Py_ssize_t k, Py_ssize_t v, Py_ssize_t alen,
                                int family, int proto, int flags)
