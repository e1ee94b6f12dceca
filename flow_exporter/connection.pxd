# The C layout of connection.py's Connection (Cython pure-Python mode): every field a Python object, as the
# annotations there say. `public` makes Cython write the struct to connection.h, which the hand-written C
# (_records.c) reads the fields' offsets from until the fused poll is ported.

cdef public class Connection [object FlowConnection, type FlowConnectionType]:
    cdef public object family, proto, orig_src, orig_dst, orig_sport, orig_dport, reply_src, reply_dst
    cdef public object reply_sport, reply_dport, zone, ct_id, mark, labels, status, tcp_state, orig_packets
    cdef public object orig_bytes, reply_packets, reply_bytes, start_ns, stop_ns, icmp_type, icmp_code, icmp_id
    cdef public object counted
