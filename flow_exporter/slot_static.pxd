# The C types of slot_static.py (Cython pure-Python mode).

cdef Py_ssize_t _INTERN_MAX

cpdef tuple intern_key(tuple key, dict intern)
cpdef bytes static_of(bytes orig_dst, bytes reply_dst, unsigned int orig_dport, unsigned int reply_sport,
                      unsigned int reply_dport, unsigned char icmp)
