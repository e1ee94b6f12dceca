# The C types of admission.py (Cython pure-Python mode).

from flow_exporter.column_views cimport ColumnViews
from flow_exporter.connection cimport Connection

cdef Py_ssize_t STOPPED, DUPLICATE
cdef unsigned char _FRESH, _UNCOUNTED
cdef unsigned long long _U32

cpdef long long stamp_after(long long last, long long wall_ns) noexcept

cdef class Admission:
    cdef object table, heap
    cdef dict conns, orphans, restored, given_up, tombs, labels, intern
    cdef list free, admitted
    cdef ColumnViews c
    cdef Py_ssize_t max_conns, next_slot, count
    cdef long long readmit_before, wall_ns, stamp
    cdef unsigned long long gen, ids
    cdef unsigned char flags
    cdef double active_at, idle_at
    cdef bint open
    cpdef resume(self)
    cpdef pause(self)
    cdef Py_ssize_t admit(self, tuple key, bytes orig_dst, bytes reply_dst, object labels, unsigned long long opk,
                          unsigned long long oby, unsigned long long rpk, unsigned long long rby,
                          unsigned long long ct_id, unsigned long long mark, unsigned long long status,
                          unsigned long long orig_dport, unsigned long long reply_sport,
                          unsigned long long reply_dport, long long start, long long stop, long long tcp, bint counted,
                          unsigned char icmp, bint lookup, object conn) except -3

cdef unsigned long long _u64(object o) except? 0xFFFFFFFFFFFFFFFF
cdef long long _i64(object o) except? -1
cdef Py_ssize_t _admit_connection(Admission adm, Connection conn) except -3
cpdef Py_ssize_t admit_rows(object table, object rows, Py_ssize_t i, double now, long long wall_ns,
                            object admitted) except -1
