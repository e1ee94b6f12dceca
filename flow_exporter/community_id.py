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

Compiled with Cython (pure-Python mode, issue 39): the record encoder (``record_bytes``) hashes every new
connection, and the interpreted function was a visible part of it (a node with churn sees thousands a
second; the fields' cost, measured: docs/performance.md#cost-of-the-new-record-fields-communityid-reporter);
compiled, the endpoints are ordered and the hashed bytes assembled in C, and SHA-1 is still hashlib's.
"""

from __future__ import annotations

import hashlib
from binascii import b2a_base64
from typing import TYPE_CHECKING

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:  # the hashed bytes assembled in a C buffer (interpreted, concatenated)
    from cython.cimports.cpython.bytes import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyBytes_AS_STRING,
        PyBytes_FromStringAndSize,
    )
    from cython.cimports.libc.string import memcpy  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["community_id", "community_id_ascii"]

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
    return community_id_ascii(proto, saddr, daddr, sport, dport, seed).decode()


def community_id_ascii(
    proto: cython.int, saddr: bytes, daddr: bytes, sport: object, dport: object, seed: cython.int
) -> bytes:
    """:func:`community_id` as ASCII bytes (the record encoder writes them as they are)."""
    if not isinstance(saddr, bytes) or not isinstance(daddr, bytes):
        raise TypeError(f"addresses are bytes, not {type(saddr).__name__} and {type(daddr).__name__}")
    if proto < 0 or proto > 255 or seed < 0 or seed > 0xFFFF:
        raise ValueError(f"protocol {proto} or seed {seed} out of range")
    # -1: no port (None); the ICMP "ports" are a type and a code
    sp: cython.int = -1 if sport is None else _u16(sport)
    dp: cython.int = -1 if dport is None else _u16(dport)
    one_way: cython.bint = False
    if proto in (PROTO_ICMP, PROTO_ICMPV6) and sp >= 0:
        paired = (_ICMP_PAIRS if proto == PROTO_ICMP else _ICMPV6_PAIRS).get(sp)
        if paired is None:
            one_way = True  # (type, code) as they are, never reordered
        else:
            dp = paired
    elif proto != PROTO_TCP and proto != PROTO_UDP and proto != PROTO_SCTP:
        sp = dp = -1
    # the smaller (address, port) first; a missing port orders as 0
    if not one_way and (daddr < saddr or (daddr == saddr and max(dp, 0) < max(sp, 0))):
        saddr, daddr = daddr, saddr
        sp, dp = dp, sp
    ported: cython.bint = sp >= 0 and dp >= 0
    if cython.compiled:  # the bytes object filled in place
        ls: cython.Py_ssize_t = len(saddr)
        ld: cython.Py_ssize_t = len(daddr)
        data = PyBytes_FromStringAndSize(cython.NULL, 2 + ls + ld + 2 + (4 if ported else 0))
        p: cython.p_uchar = cython.cast(cython.p_uchar, PyBytes_AS_STRING(data))
        p[0] = seed >> 8
        p[1] = seed & 0xFF
        memcpy(cython.address(p[2]), cython.cast(cython.p_char, saddr), ls)
        memcpy(cython.address(p[2 + ls]), cython.cast(cython.p_char, daddr), ld)
        n: cython.Py_ssize_t = 2 + ls + ld
        p[n] = proto
        p[n + 1] = 0
        if ported:
            p[n + 2] = sp >> 8
            p[n + 3] = sp & 0xFF
            p[n + 4] = dp >> 8
            p[n + 5] = dp & 0xFF
    else:
        data = seed.to_bytes(2, "big") + saddr + daddr + bytes((proto, 0))
        if ported:
            data += sp.to_bytes(2, "big") + dp.to_bytes(2, "big")
    return b"1:" + b2a_base64(hashlib.sha1(data, usedforsecurity=False).digest(), newline=False)


def _u16(v: object) -> cython.int:
    """A port, an ICMP type or code: an int of 16 bits (TypeError, ValueError otherwise)."""
    if not isinstance(v, int):
        raise TypeError(f"a port is an int, not {type(v).__name__}")
    if v < 0 or v > 0xFFFF:
        raise ValueError(f"a port of {v} is out of range")
    return v
