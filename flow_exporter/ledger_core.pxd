# The C types of ledger_core.py (Cython pure-Python mode).

from flow_exporter.deadline_heap cimport DueSlots
from flow_exporter.export cimport Export

cdef unsigned char _ACTIVE, _END_OF_FLOW, _IDLE_TIMEOUT, _ACTIVE_TIMEOUT_CODE
cdef unsigned char _UNCOUNTED, _DESTROYED, _FINAL_DUE, _LAST_ACTIVE, _NO_COUNTERS, _OFFLOADED
cdef unsigned int _OFFLOAD_STATUS, _SEQ_MAX
cdef int _ACTIVE_TIMEOUT, _FORCED_END, _LACK_OF_RESOURCES, _ROW_ENDED, _ROW_GIVEN_UP, _ROW_RESET

cdef class _Columns:
    cdef unsigned long long[:] op, ob, rp, rb, bp, bb, brp, brb
    cdef unsigned int[:] seq, status, ct, epoch
    cdef long long[:] last, fid, first, start
    cdef signed char[:] tcp
    cdef unsigned char[:] flags, reason, bits
    cdef list keys, meta, prefix, pending
    cdef Py_ssize_t rows
    cdef unsigned char source_flags

cdef Export _build(_Columns c, Py_ssize_t s, int reason, object view)

cdef class _DueColumns:
    cdef unsigned char[:] reason, bits
    cdef signed char[:] tcp
    cdef unsigned int[:] status
    cdef double[:] idle
    cdef list keys, pending
    cdef Py_ssize_t rows
