"""Hypothesis strategies for the exporter's values (shared by the encoder and Schema Registry tests)."""

from __future__ import annotations

import socket

from hypothesis import strategies as st

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.flow import Export
from flow_exporter.record import META_FIELDS

u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 2**63 - 1)
text = st.text(max_size=40)


@st.composite
def exports(draw: st.DrawFn) -> Export:
    fam = draw(st.sampled_from([socket.AF_INET, socket.AF_INET6]))
    n = 4 if fam == socket.AF_INET else 16
    addr = st.binary(min_size=n, max_size=n)
    proto = draw(st.sampled_from([PROTO_TCP, PROTO_UDP, PROTO_SCTP, PROTO_ICMP, PROTO_ICMPV6]))
    icmp = proto in (PROTO_ICMP, PROTO_ICMPV6)
    src, dst, rsrc = draw(addr), draw(addr), draw(addr)
    sport = draw(u16)
    # The reply's destination: the source itself (no source NAT), or a translated address and/or port.
    snat_dst = draw(st.just(src) | addr)
    snat_port = draw(st.just(sport) | u16)
    c = Connection(
        family=fam,
        proto=proto,
        orig_src=src,
        orig_dst=dst,
        orig_sport=sport,
        orig_dport=draw(u16),
        reply_src=rsrc,
        reply_dst=snat_dst,
        reply_sport=draw(u16),
        reply_dport=snat_port,
        zone=draw(u16),
        ct_id=draw(u32),
        mark=draw(u32),
        labels=draw(st.none() | st.binary(min_size=16, max_size=16)),
        status=draw(u32),
        tcp_state=draw(st.none() | st.integers(0, 9)) if proto == PROTO_TCP else None,
        orig_packets=draw(u64),
        orig_bytes=draw(u64),
        reply_packets=draw(u64),
        reply_bytes=draw(u64),
        start_ns=draw(st.integers(0, 2**62)),
        stop_ns=draw(st.integers(0, 2**62)),
        icmp_type=draw(st.integers(0, 255)) if icmp else None,
        icmp_code=draw(st.integers(0, 255)) if icmp else None,
        icmp_id=draw(u16) if icmp else None,
    )
    meta = None
    if draw(st.booleans()):
        meta = {
            name: draw(st.none() | st.dictionaries(text, text, max_size=3))
            if name.endswith("Labels")
            else draw(st.none() | text)
            for name in META_FIELDS
        }
        meta["flowType"] = draw(st.integers(0, 4))
    first = draw(st.integers(1, 2**62))
    return Export(
        reason=draw(st.integers(1, 5)),
        sequence=draw(st.integers(0, 2**40)),
        totals=(draw(u64), draw(u64), draw(u64), draw(u64)),
        deltas=(draw(u64), draw(u64), draw(u64), draw(u64)),
        final=draw(st.booleans()),
        flow_end_ns=draw(st.integers(0, 2**62)),
        flow_id=draw(st.integers(-(2**63), 2**63 - 1)),
        first_seen_ns=first,
        conn_key=c.key,
        ct_id=c.ct_id,
        start_ns=c.start_ns,
        flags=draw(st.integers(0, 3)),
        tcp_state=c.tcp_state,
        meta=meta,
        conn=c,
    )
