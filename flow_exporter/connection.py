"""One conntrack entry as the rest of the pipeline sees it.

The conntrack source produces these; the store keeps one per key. Addresses stay
packed (4 or 16 bytes) because converting every address of every poll to text
costs more than the whole store update: text is made once, when a record is built.

``Connection`` is written once in Cython's pure-Python mode (issue 39): compiled, an extension type whose
fields are C struct members (``connection.pxd``), so the compiled decoder (``ctnetlink``) makes one with an
allocation and 26 stores where the dataclass's ``__init__`` was a Python frame an entry (measured),
and it takes no part in the cyclic GC (``no_gc``: it holds ints, bytes and None); Python code reads the same
fields by name. Interpreted, it is the same class as a plain dataclass.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

# Kernel enum ip_conntrack_status bits we look at.
IPS_DYING = 1 << 9
IPS_OFFLOAD = 1 << 14  # in a (software) flowtable
IPS_HW_OFFLOAD = 1 << 15  # in a hardware flowtable

# Kernel enum tcp_conntrack, in order (README, "Record fields": tcpState).
TCP_STATE_NAMES = (
    "NONE",
    "SYN_SENT",
    "SYN_RECV",
    "ESTABLISHED",
    "FIN_WAIT",
    "CLOSE_WAIT",
    "LAST_ACK",
    "TIME_WAIT",
    "CLOSE",
    "SYN_SENT2",
)
TCP_TIME_WAIT = 7
TCP_CLOSE = 8

PROTO_ICMP = 1
PROTO_TCP = 6
PROTO_UDP = 17
PROTO_ICMPV6 = 58
PROTO_SCTP = 132

PROTO_NAMES = {
    PROTO_ICMP: "ICMP",
    PROTO_TCP: "TCP",
    PROTO_UDP: "UDP",
    PROTO_ICMPV6: "ICMP6",
    PROTO_SCTP: "SCTP",
}


# 5-tuple (plus zone) identifying a flow in the store:
# (zone, proto, src, sport, dst, dport). The destination comes from the reply tuple,
# i.e. the endpoint after DNAT, so a connection to a Service VIP is keyed by the
# backend it reached. A plain tuple, not a NamedTuple: one is built per entry per
# poll, and a NamedTuple's constructor costs more than the rest of the lookup.
ConnectionKey = tuple[int, int, bytes, int, bytes, int]


@cython.dataclasses.dataclass
@cython.no_gc  # nothing it holds refers back to it
@cython.cclass
class Connection:
    """A conntrack entry: both tuples, counters, timestamps and kernel metadata.

    For ICMP/ICMPv6 each tuple's sport holds the ICMP id and dport holds
    type << 8 | code (the icmp_* fields repeat the original tuple's values), so
    ICMP flows key and compare like any other flow.
    """

    family: int  # socket.AF_INET or socket.AF_INET6
    proto: int
    orig_src: bytes
    orig_dst: bytes
    orig_sport: int
    orig_dport: int
    reply_src: bytes
    reply_dst: bytes
    reply_sport: int
    reply_dport: int
    zone: int = 0
    ct_id: int = 0
    mark: int = 0
    labels: bytes | None = None
    status: int = 0
    tcp_state: int | None = None
    orig_packets: int = 0
    orig_bytes: int = 0
    reply_packets: int = 0
    reply_bytes: int = 0
    start_ns: int = 0  # CLOCK_REALTIME ns, 0 when nf_conntrack_timestamp is off
    stop_ns: int = 0
    icmp_type: int | None = None
    icmp_code: int | None = None
    icmp_id: int | None = None
    # Whether the kernel gave counter attributes: an entry created while nf_conntrack_acct was
    # off has none (its zeros mean "not counted"), a zeroed one (conntrack -Z) has them at 0.
    # NEW events carry none either (the kernel sends counters with DESTROY only).
    counted: bool = True

    @property
    def key(self) -> ConnectionKey:
        # Source from the original tuple, destination from the reply tuple
        # (reply source = the real endpoint after DNAT).
        proto = self.proto
        if proto in (PROTO_ICMP, PROTO_ICMPV6):
            return (self.zone, proto, self.orig_src, self.orig_sport, self.reply_src, self.orig_dport)
        return (self.zone, proto, self.orig_src, self.orig_sport, self.reply_src, self.reply_sport)
