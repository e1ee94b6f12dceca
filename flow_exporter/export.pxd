# The C layout of export.py's Export (Cython pure-Python mode): every field a Python object, as the
# annotations there say (the hand-written C fills them at their offsets; see export.py).

cdef class Export:
    cdef public object reason, sequence, totals, deltas, final, flow_end_ns, flow_id, first_seen_ns, conn_key
    cdef public object ct_id, start_ns, flags, ended, tcp_state, meta, conn, prefix, slot, epoch, value, topic
    cdef public object key, attempts, export_ms, row_kind

cpdef Export as_export(object x)
