"""ctnetlink messages for tests: built with pyroute2's `nfct_msg`, read back into Connections.

Shared by the decoder's property tests and the dumper's tests (kernel dumps and fake sockets).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from pyroute2.netlink.nfnetlink.nfctsocket import nfct_msg

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_UDP, Connection
from flow_exporter.conntrack.decode import CT_NEW

NLM_F_MULTI = 2
NLMSG_DONE = 3
NLMSG_ERROR = 2


def connection_from_pyroute2(msg: Any) -> Connection:
    """The Connection a decoded pyroute2 `nfct_msg` stands for, by decode.py's conventions."""
    family = msg["nfgen_family"]
    v = "V4" if family == socket.AF_INET else "V6"

    def tuple_of(name: str) -> tuple[bytes, bytes, int, int, int, Any]:
        t = msg.get_attr(name)
        ip = t.get_attr("CTA_TUPLE_IP")
        pr = t.get_attr("CTA_TUPLE_PROTO")
        src = socket.inet_pton(family, ip.get_attr(f"CTA_IP_{v}_SRC"))
        dst = socket.inet_pton(family, ip.get_attr(f"CTA_IP_{v}_DST"))
        proto = pr.get_attr("CTA_PROTO_NUM")
        return src, dst, proto, pr.get_attr("CTA_PROTO_SRC_PORT") or 0, pr.get_attr("CTA_PROTO_DST_PORT") or 0, pr

    osrc, odst, proto, osport, odport, opr = tuple_of("CTA_TUPLE_ORIG")
    rsrc, rdst, _, rsport, rdport, rpr = tuple_of("CTA_TUPLE_REPLY")
    icmp: tuple[int | None, int | None, int | None] = (None, None, None)
    if proto in (PROTO_ICMP, PROTO_ICMPV6):
        k = "ICMP" if proto == PROTO_ICMP else "ICMPV6"

        def icmp_of(pr: Any) -> tuple[int, int, int]:
            return tuple(pr.get_attr(f"CTA_PROTO_{k}_{f}") or 0 for f in ("ID", "TYPE", "CODE"))

        (oid, otype, ocode), (rid, rtype, rcode) = icmp_of(opr), icmp_of(rpr)
        osport, odport, rsport, rdport = oid, otype << 8 | ocode, rid, rtype << 8 | rcode
        icmp = (otype, ocode, oid)

    def counter(direction: str, what: str) -> int:
        c = msg.get_attr(f"CTA_COUNTERS_{direction}")
        if c is None:
            return 0
        value = c.get_attr(f"CTA_COUNTERS_{what}")
        return value if value is not None else c.get_attr(f"CTA_COUNTERS32_{what}") or 0

    labels = msg.get_attr("CTA_LABELS")
    return Connection(
        family=family,
        proto=proto,
        orig_src=osrc,
        orig_dst=odst,
        orig_sport=osport,
        orig_dport=odport,
        reply_src=rsrc,
        reply_dst=rdst,
        reply_sport=rsport,
        reply_dport=rdport,
        zone=msg.get_attr("CTA_ZONE") or 0,
        ct_id=msg.get_attr("CTA_ID") or 0,
        mark=msg.get_attr("CTA_MARK") or 0,
        labels=labels.to_bytes(16, "little") if labels else None,
        status=msg.get_attr("CTA_STATUS") or 0,
        tcp_state=msg.get_nested("CTA_PROTOINFO", "CTA_PROTOINFO_TCP", "CTA_PROTOINFO_TCP_STATE"),
        orig_packets=counter("ORIG", "PACKETS"),
        orig_bytes=counter("ORIG", "BYTES"),
        reply_packets=counter("REPLY", "PACKETS"),
        reply_bytes=counter("REPLY", "BYTES"),
        start_ns=msg.get_nested("CTA_TIMESTAMP", "CTA_TIMESTAMP_START") or 0,
        stop_ns=msg.get_nested("CTA_TIMESTAMP", "CTA_TIMESTAMP_STOP") or 0,
        icmp_type=icmp[0],
        icmp_code=icmp[1],
        icmp_id=icmp[2],
        counted=any(
            c is not None and any(c.get_attr(f"{p}_PACKETS") is not None for p in ("CTA_COUNTERS", "CTA_COUNTERS32"))
            for c in (msg.get_attr("CTA_COUNTERS_ORIG"), msg.get_attr("CTA_COUNTERS_REPLY"))
        ),
    )


def assert_valid(c: Connection) -> None:
    """What any decoded Connection must satisfy, whatever bytes it came from."""
    assert c.family in (socket.AF_INET, socket.AF_INET6)
    size = 4 if c.family == socket.AF_INET else 16
    for addr in (c.orig_src, c.orig_dst, c.reply_src, c.reply_dst):
        assert type(addr) is bytes and len(addr) == size
    assert 0 <= c.proto <= 0xFF
    for port in (c.orig_sport, c.orig_dport, c.reply_sport, c.reply_dport, c.zone):
        assert type(port) is int and 0 <= port <= 0xFFFF
    for v32 in (c.ct_id, c.mark, c.status):
        assert type(v32) is int and 0 <= v32 <= 0xFFFFFFFF
    for v64 in (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes, c.start_ns, c.stop_ns):
        assert type(v64) is int and 0 <= v64 < 1 << 64
    assert c.labels is None or (type(c.labels) is bytes and any(c.labels))
    assert c.tcp_state is None or 0 <= c.tcp_state <= 0xFF
    if c.proto in (PROTO_ICMP, PROTO_ICMPV6):
        assert c.icmp_type is not None and c.icmp_code is not None
        assert (c.icmp_type, c.icmp_code, c.icmp_id) == (c.orig_dport >> 8, c.orig_dport & 0xFF, c.orig_sport)
    else:
        assert c.icmp_type is c.icmp_code is c.icmp_id is None


def done_message(errno: int = 0) -> bytes:
    return struct.pack("=IHHIIi", 20, NLMSG_DONE, NLM_F_MULTI, 0, 0, -errno)


def ct_message(attrs: list[Any], family: int = socket.AF_INET) -> bytes:
    msg = nfct_msg()
    msg["header"]["type"] = CT_NEW
    msg["nfgen_family"] = family
    msg["attrs"] = attrs
    msg.encode()
    return bytes(msg.data)


def ip4_tuple(src: str, dst: str, proto: int = PROTO_UDP, sport: int = 1, dport: int = 2) -> dict[str, Any]:
    return {"attrs": [("CTA_TUPLE_IP", {"attrs": [("CTA_IP_V4_SRC", src), ("CTA_IP_V4_DST", dst)]}),
                      ("CTA_TUPLE_PROTO", {"attrs": [("CTA_PROTO_NUM", proto), ("CTA_PROTO_SRC_PORT", sport),
                                                     ("CTA_PROTO_DST_PORT", dport)]})]}
