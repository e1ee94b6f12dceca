# The C types of fused_poll.py (Cython pure-Python mode).

from flow_exporter.admission cimport Admission
from flow_exporter.column_views cimport ColumnViews
from flow_exporter.ctnetlink cimport _Row, _Walk
from flow_exporter.sampling cimport Sampler

cdef unsigned char _PRESENT, _DESTROYED, _ORPHAN, _UNCOUNTED
cdef int _KEEP, _DROP, _ASK
cdef unsigned long long _I64_MAX, _U32

cdef bint _int_is(object o, unsigned long long v) noexcept
cdef bint _bytes_is(object o, _Walk w, int f) except -1
cdef bint _slot_holds(ColumnViews c, Py_ssize_t s, _Walk w, _Row r) except -1
cdef inline unsigned long long _key_port(_Row r) noexcept
cdef tuple _key(_Walk w, _Row r)
cdef Py_ssize_t _find(dict conns, tuple key) except -2
cdef bint _fast_update(ColumnViews c, Py_ssize_t s, _Row r, unsigned long long gen, bint labelled_slot) noexcept
cdef unsigned long long _word(_Walk w, Py_ssize_t at, Py_ssize_t n) noexcept
cdef int _sampled(_Walk w, _Row r, Sampler sampler) except -1
cdef Py_ssize_t _admit(Admission adm, tuple key, _Walk w, _Row r) except -3
