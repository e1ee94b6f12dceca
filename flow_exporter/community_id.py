"""Community ID v1 flow hashes (the published spec, github.com/corelight/community-id-spec).

A Community ID names a flow the same way in every tool that implements the spec (Zeek,
Suricata, Arkime, Elastic, Wireshark, ...) and in both directions: ``"1:"`` + base64 of the
SHA-1 of seed (2 bytes), the two addresses, protocol, a zero byte and the two ports, the
endpoints ordered so the smaller (address, port) comes first. ICMP and ICMPv6 use the type as
the source "port" and the paired type (request <-> reply) or the code as the destination
"port"; a type without a pair is one-way and is never reordered. Protocols without ports hash
addresses and protocol only.

Written here rather than taken from the ``communityid`` package: the exporter computes one per
connection from packed addresses it already has, in a few microseconds, with no dependency
for the node image; tests/unit/test_community_id.py checks it against the spec's published
baseline vectors and against that package on generated flows.
"""

from __future__ import annotations

import base64
import hashlib

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP

__all__ = ["community_id"]

_PORTED = frozenset((PROTO_TCP, PROTO_UDP, PROTO_SCTP))
# Request/response pairs of ICMP types (Zeek's mapping, which the spec adopts).
_ICMP_PAIRS = {8: 0, 0: 8, 13: 14, 14: 13, 15: 16, 16: 15, 10: 9, 9: 10, 17: 18, 18: 17}
_ICMPV6_PAIRS = {
    128: 129, 129: 128, 130: 131, 131: 130, 133: 134, 134: 133,
    135: 136, 136: 135, 139: 140, 140: 139, 144: 145, 145: 144,
}  # fmt: skip


def community_id(
    proto: int,
    saddr: bytes,
    daddr: bytes,
    sport: int | None = None,
    dport: int | None = None,
    seed: int = 0,
) -> str:
    """The v1 Community ID of a flow from ``saddr`` to ``daddr`` (packed addresses, 4 or 16 bytes).

    For TCP, UDP and SCTP ``sport``/``dport`` are the ports; for ICMP/ICMPv6 they are the
    message type and code; for other protocols they are ignored.
    """
    one_way = False
    if proto in (PROTO_ICMP, PROTO_ICMPV6) and sport is not None:
        pairs = _ICMP_PAIRS if proto == PROTO_ICMP else _ICMPV6_PAIRS
        paired = pairs.get(sport)
        if paired is None:
            one_way = True  # (type, code) as they are, never reordered
        else:
            dport = paired
    elif proto not in _PORTED:
        sport = dport = None
    if not one_way and (daddr, dport or 0) < (saddr, sport or 0):
        saddr, daddr, sport, dport = daddr, saddr, dport, sport
    data = seed.to_bytes(2, "big") + saddr + daddr + bytes((proto, 0))
    if sport is not None and dport is not None:
        data += sport.to_bytes(2, "big") + dport.to_bytes(2, "big")
    return "1:" + base64.b64encode(hashlib.sha1(data, usedforsecurity=False).digest()).decode()
