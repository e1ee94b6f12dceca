"""ctnetlink messages for tests: built with pyroute2's `nfct_msg`, read back into Connections.

Shared by the decoder's property tests and the dumper's tests (kernel dumps and fake sockets).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from pyroute2.netlink.nfnetlink.nfctsocket import nfct_msg

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_UDP, Connection
from flow_exporter.conntrack.decode import CT_DELETE, CT_NEW

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


def mutated(buf: bytes, data: Any) -> bytearray:
    """``buf`` with 1 to 8 bytes flipped or overwritten, drawn from hypothesis' ``data`` (a DataObject)."""
    from hypothesis import strategies as st

    out = bytearray(buf)
    for _ in range(data.draw(st.integers(1, 8))):
        pos = data.draw(st.integers(0, len(out) - 1))
        if data.draw(st.booleans()):
            out[pos] ^= 1 << data.draw(st.integers(0, 7))
        else:
            out[pos] = data.draw(st.integers(0, 0xFF))
    return out


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


# -- a kernel-shaped encoder: Connection -> one ctnetlink message ------------------------------

def _nla(ty: int, payload: bytes, nested: bool = False) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), ty | (0x8000 if nested else 0))
    return head + payload + b"\0" * (-len(payload) % 4)


def _tuple(c: Connection, reply: bool, family: int) -> bytes:
    src, dst = (c.reply_src, c.reply_dst) if reply else (c.orig_src, c.orig_dst)
    sport, dport = (c.reply_sport, c.reply_dport) if reply else (c.orig_sport, c.orig_dport)
    v6 = family == socket.AF_INET6
    ip = _nla(3 if v6 else 1, src) + _nla(4 if v6 else 2, dst)
    proto = _nla(1, struct.pack("B", c.proto))
    if c.proto in (PROTO_ICMP, PROTO_ICMPV6):
        base = 4 if c.proto == PROTO_ICMP else 7  # CTA_PROTO_ICMP_ID or CTA_PROTO_ICMPV6_ID
        proto += _nla(base, struct.pack(">H", sport)) + _nla(base + 1, bytes([dport >> 8])) + _nla(
            base + 2, bytes([dport & 0xFF])
        )
    else:
        proto += _nla(2, struct.pack(">H", sport)) + _nla(3, struct.pack(">H", dport))
    return _nla(1, ip, True) + _nla(2, proto, True)


def encode_connection(c: Connection, *, counters32: bool = False, delete: bool = False) -> bytes:
    """The message the kernel sends for ``c`` (the attribute order of ctnetlink_dump_info); decodes back to ``c``.

    Counters go out as 64-bit attributes (``counters32``: the 32-bit ones, as very old kernels sent),
    none when ``c.counted`` is false; the zone as CTA_ZONE, omitted at 0 as the kernel does.
    """
    attrs = _nla(1, _tuple(c, False, c.family), True) + _nla(2, _tuple(c, True, c.family), True)
    if c.zone:
        attrs += _nla(18, struct.pack(">H", c.zone))
    attrs += _nla(3, struct.pack(">I", c.status))
    if c.counted:
        fmt, base = (">I", 3) if counters32 else (">Q", 1)
        attrs += _nla(9, _nla(base, struct.pack(fmt, c.orig_packets)) + _nla(base + 1, struct.pack(fmt, c.orig_bytes)),
                      True)
        attrs += _nla(10, _nla(base, struct.pack(fmt, c.reply_packets))
                      + _nla(base + 1, struct.pack(fmt, c.reply_bytes)), True)
    if c.start_ns:
        ts = _nla(1, struct.pack(">Q", c.start_ns)) + (_nla(2, struct.pack(">Q", c.stop_ns)) if c.stop_ns else b"")
        attrs += _nla(20, ts, True)
    attrs += _nla(7, struct.pack(">I", 120))  # CTA_TIMEOUT: skipped by the decoders
    attrs += _nla(8, struct.pack(">I", c.mark))
    if c.tcp_state is not None:
        attrs += _nla(4, _nla(1, _nla(1, bytes([c.tcp_state])), True), True)
    attrs += _nla(12, struct.pack(">I", c.ct_id))
    if c.labels is not None:
        attrs += _nla(22, c.labels)
    body = struct.pack("BBH", c.family, 0, 0) + attrs
    mtype = CT_DELETE if delete else CT_NEW
    return struct.pack("=IHHII", 16 + len(body), mtype, NLM_F_MULTI, 0, 0) + body
