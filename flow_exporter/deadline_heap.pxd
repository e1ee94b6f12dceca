# The C types of deadline_heap.py (Cython pure-Python mode).

cdef class DeadlineHeap:
    cdef object _ms_store, _slot_store
    cdef long long[::1] ms
    cdef unsigned int[::1] slot
    cdef Py_ssize_t n, cap
    cpdef _adopt(self, ms, slot)

cdef object _entry(object ms, object slot)
cdef object _entry_of(long long ms, unsigned int slot)
cdef void _up(DeadlineHeap h, Py_ssize_t start, Py_ssize_t pos) noexcept
cdef void _down(DeadlineHeap h, Py_ssize_t n, Py_ssize_t pos) noexcept
cdef void _grow(DeadlineHeap h) except *

cdef int push_entry(object heap, long long ms, unsigned int slot) except -1
cdef long long min_ms(object heap) noexcept
cdef unsigned int pop_min(object heap) noexcept

cpdef long long ms_of(double deadline) noexcept

cdef class DueSlots:
    cdef DeadlineHeap heap
    cdef unsigned char[::1] queued
    cdef double[::1] active, idle
    cdef double now
    cdef long long last_ms
    cdef list early
    cdef public Py_ssize_t change
    cpdef Py_ssize_t take(self) except -2
    cpdef requeue(self, Py_ssize_t slot, double active, double idle)
    cpdef close(self)
