# The C types of column_views.py (Cython pure-Python mode).

cdef class ColumnViews:
    cdef unsigned int[::1] seen, ct, seq, status, mark
    cdef long long[::1] start, first, last_active, fid, order
    cdef unsigned char[::1] bits, flags, queued
    cdef signed char[::1] tcp
    cdef unsigned long long[::1] op, ob, rp, rb
    cdef double[::1] q_active, q_idle
    cdef list keys, static
    cdef Py_ssize_t rows, orders
