# The C types of poll_core.py (Cython pure-Python mode).

cdef unsigned char _PRESENT, _DESTROYED

cdef class _Marks:
    cdef unsigned int[:] seen
    cdef unsigned char[:] bits
    cdef Py_ssize_t rows
