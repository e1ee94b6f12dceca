# The C types of ctnetlink.py (Cython pure-Python mode).

from flow_exporter.connection cimport Connection

cdef Py_ssize_t _HDR, _MSG_MIN
cdef int _ERROR, _DONE, _INTR, _TYPE_MASK, _NEW, _DELETE, _INET, _INET6
cdef unsigned int _ICMP, _ICMPV6
cdef bint _LITTLE
cdef int _SRC, _DST, _PROTO, _SPORT, _DPORT, _ICMP_ID, _ICMP_TYPE, _ICMP_CODE, _ICMP6_ID, _ICMP6_TYPE, _ICMP6_CODE
cdef int _TZONE, _R, _STATUS, _MARK, _ID, _ZONE, _OPK, _OBY, _OPK32, _OBY32, _RPK, _RBY, _RPK32, _RBY32
cdef int _START, _STOP, _TCP, _LABELS
cdef unsigned long long _REQUIRED, _ONE

cdef class _Walk:
    cdef const unsigned char[::1] buf
    cdef unsigned long long[::1] v
    cdef unsigned long long have
    cdef int family
    cdef Py_ssize_t labels_len
    cdef Py_ssize_t off, decoded, skipped, ignored, kept
    cdef long err_no
    cdef bint done, interrupted

cdef class _Row:
    cdef unsigned int proto
    cdef unsigned long long sport, dport, rsport, rdport, zone, ct_id, mark, status, start, stop
    cdef unsigned long long opk, oby, rpk, rby, icmp_type, icmp_code, icmp_id
    cdef int tcp
    cdef bint counted, labelled, icmp

cdef inline unsigned int _u16(_Walk w, Py_ssize_t at) noexcept
cdef inline unsigned int _u32(_Walk w, Py_ssize_t at) noexcept
cdef inline long _s32(_Walk w, Py_ssize_t at) noexcept
cdef bint _attrs_ok(_Walk w, Py_ssize_t at, Py_ssize_t end) noexcept
cdef bint _put(_Walk w, int f, Py_ssize_t pos, Py_ssize_t plen, int size) noexcept
cdef bint _walk_tuple(_Walk w, Py_ssize_t at, Py_ssize_t end, int base) noexcept
cdef bint _walk_nested(_Walk w, Py_ssize_t at, Py_ssize_t end, int first, int count, int wide) noexcept
cdef bint _walk_tcp(_Walk w, Py_ssize_t at, Py_ssize_t end) noexcept
cdef bint _walk_message(_Walk w, Py_ssize_t off, Py_ssize_t mlen) noexcept
cdef inline unsigned long long _pick(_Walk w, int f) noexcept
cdef inline bint _has(_Walk w, int f) noexcept
cdef bytes _bytes_at(_Walk w, int f, Py_ssize_t size)
cdef unsigned long long _zone(_Walk w) noexcept
cdef void _row_of(_Walk w, _Row r) noexcept
cdef bytes _address(_Walk w, int f)
cdef Connection _connection(_Walk w, _Row r)
cdef int _next_entry(_Walk w, object zones) except -1
cdef tuple _result(_Walk w)
