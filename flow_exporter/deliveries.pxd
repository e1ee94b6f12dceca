# The C types of deliveries.py (Cython pure-Python mode).

from flow_exporter.export cimport Export

cdef class Deliveries:
    cdef object on_failed, on_run, reports_type, run_topic, run_st
    cdef public list delivered, partitions, offsets, failed
    cdef Py_ssize_t run_n
    cpdef settle(self)

cdef class Delivery:
    cdef Deliveries owner
    cdef object export, topic, st
