# The C types of community_id.py (Cython pure-Python mode).

cpdef bytes community_id_ascii(int proto, bytes saddr, bytes daddr, object sport, object dport, int seed)
cdef int _u16(object v) except -1
