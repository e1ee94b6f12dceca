# The C types of deliveries.py (Cython pure-Python mode).

from flow_exporter.export cimport Export

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object op)

cdef class Deliveries:
    cdef object append, on_failed, on_run, report_type, run_topic, run_st
    cdef Py_ssize_t run_n
    cpdef settle(self)

cdef class Delivery:
    cdef Deliveries owner
    cdef object export, topic, st
