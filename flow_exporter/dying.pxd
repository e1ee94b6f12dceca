# The C types of dying.py (Cython pure-Python mode).

cdef int _PROTO_TCP, _TIME_WAIT, _CLOSE
cdef unsigned int _IPS_DYING

cpdef bint is_dying(int proto, int tcp_state, unsigned int status) noexcept
