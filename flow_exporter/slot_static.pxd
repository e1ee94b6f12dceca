# The C types of slot_static.py (Cython pure-Python mode).

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object op)

cdef Py_ssize_t _INTERN_MAX

cpdef unsigned char icmp_bits(object icmp_type, object icmp_code, object icmp_id) noexcept
cpdef tuple intern_key(tuple key, dict intern)
cpdef bytes static_of(bytes orig_dst, bytes reply_dst, unsigned int orig_dport, unsigned int reply_sport,
                      unsigned int reply_dport, unsigned char icmp)
