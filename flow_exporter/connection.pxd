# The C layout of connection.py's Connection (Cython pure-Python mode): every field a Python object, as the
# annotations there say; the decoder (ctnetlink.py) and the admission (admission.py) read and set them as struct
# members.

cdef class Connection:
    cdef public object family, proto, orig_src, orig_dst, orig_sport, orig_dport, reply_src, reply_dst
    cdef public object reply_sport, reply_dport, zone, ct_id, mark, labels, status, tcp_state, orig_packets
    cdef public object orig_bytes, reply_packets, reply_bytes, start_ns, stop_ns, icmp_type, icmp_code, icmp_id
    cdef public object counted
