# The C types of flow_ids.py (Cython pure-Python mode).

cdef unsigned long long _MASK, _GOLDEN, _MIX1, _MIX2

cpdef unsigned long long step(unsigned long long position) noexcept
cpdef long long id_at(unsigned long long position) noexcept
