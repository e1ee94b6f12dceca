"""Property tests of the ctnetlink decoder against pyroute2's own encoder and decoder.

Entries are encoded with pyroute2's `nfct_msg`, then decoded by pyroute2 (converted with
`connection_from_pyroute2`, which the real-kernel test reuses) and by `Decoder`, in both builds of
flow_exporter/ctnetlink.py (the one this run chose, and the interpreted one beside it); all must agree
with the entry.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pyroute2.netlink import NLA_F_NESTED, NLA_F_NET_BYTEORDER
from pyroute2.netlink.nfnetlink.nfctsocket import nfct_msg

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_SCTP, PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.conntrack.decode import CT_DELETE, CT_NEW, Decoder, decode_batch
from tests.support.netlink_messages import (
    NLM_F_MULTI,
    NLMSG_ERROR,
    assert_valid,
    connection_from_pyroute2,
    ct_message,
    done_message,
    ip4_tuple,
    mutated,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, (1 << 64) - 1)


# -- generating entries ---------------------------------------------------------------------

@st.composite
def tuples(draw: st.DrawFn, family: int, proto: int, nested: bool) -> tuple[list[Any], dict[str, Any]]:
    """(pyroute2 attrs of one CTA_TUPLE_*, expected values)."""
    size = 4 if family == socket.AF_INET else 16
    v = "V4" if family == socket.AF_INET else "V6"
    src, dst = draw(st.binary(min_size=size, max_size=size)), draw(st.binary(min_size=size, max_size=size))
    ip = [(f"CTA_IP_{v}_SRC", socket.inet_ntop(family, src)), (f"CTA_IP_{v}_DST", socket.inet_ntop(family, dst))]
    pr: list[Any] = [("CTA_PROTO_NUM", proto)]
    exp: dict[str, Any] = {"src": src, "dst": dst}
    if proto in (PROTO_ICMP, PROTO_ICMPV6):
        k = "ICMP" if proto == PROTO_ICMP else "ICMPV6"
        ident, itype, code = draw(u16), draw(u8), draw(u8)
        pr += [(f"CTA_PROTO_{k}_ID", ident), (f"CTA_PROTO_{k}_TYPE", itype), (f"CTA_PROTO_{k}_CODE", code)]
        exp.update(sport=ident, dport=itype << 8 | code, icmp=(itype, code, ident))
    elif proto in (PROTO_TCP, PROTO_UDP, PROTO_SCTP):
        sport, dport = draw(u16), draw(u16)
        pr += [("CTA_PROTO_SRC_PORT", sport), ("CTA_PROTO_DST_PORT", dport)]
        exp.update(sport=sport, dport=dport)
    else:  # a protocol conntrack tracks without ports (e.g. GRE without its helper)
        exp.update(sport=0, dport=0)
    pr = draw(st.permutations(pr))
    parts = [("CTA_TUPLE_IP", {"attrs": draw(st.permutations(ip))}), ("CTA_TUPLE_PROTO", {"attrs": pr})]
    if nested:
        parts = [(n, a, NLA_F_NESTED) for n, a in parts]
    return draw(st.permutations(parts)), exp


@st.composite
def entries(draw: st.DrawFn) -> tuple[bytes, Connection, bool]:
    """(encoded message, the Connection it must decode to, whether it is a DELETE)."""
    family = draw(st.sampled_from([socket.AF_INET, socket.AF_INET6]))
    proto = draw(st.sampled_from([PROTO_TCP, PROTO_UDP, PROTO_SCTP, 47,
                                  PROTO_ICMP if family == socket.AF_INET else PROTO_ICMPV6]))
    nested = draw(st.booleans())  # the kernel sets NLA_F_NESTED; pyroute2 does not

    def nest(name: str, attrs: list[Any]) -> tuple[Any, ...]:
        return (name, {"attrs": attrs}, NLA_F_NESTED) if nested else (name, {"attrs": attrs})

    otuple, o = draw(tuples(family, proto, nested))
    rtuple, r = draw(tuples(family, proto, nested))
    attrs: list[Any] = [nest("CTA_TUPLE_ORIG", otuple), nest("CTA_TUPLE_REPLY", rtuple)]
    exp: dict[str, Any] = dict(
        family=family, proto=proto, orig_src=o["src"], orig_dst=o["dst"], orig_sport=o["sport"],
        orig_dport=o["dport"], reply_src=r["src"], reply_dst=r["dst"], reply_sport=r["sport"],
        reply_dport=r["dport"],
    )
    if "icmp" in o:
        exp.update(icmp_type=o["icmp"][0], icmp_code=o["icmp"][1], icmp_id=o["icmp"][2])

    def scalar(attr: str, field: str, values: st.SearchStrategy[int]) -> None:
        value = draw(st.none() | values)
        if value is not None:  # the kernel never sets NLA_F_NET_BYTEORDER here; it must be masked anyway
            attrs.append((attr, value, NLA_F_NET_BYTEORDER) if draw(st.booleans()) else (attr, value))
            exp[field] = value

    scalar("CTA_ZONE", "zone", u16)
    scalar("CTA_MARK", "mark", u32)
    scalar("CTA_STATUS", "status", u32)
    scalar("CTA_ID", "ct_id", u32)
    labels = draw(st.none() | st.just(0) | st.integers(0, (1 << 128) - 1))
    if labels is not None:
        attrs.append(("CTA_LABELS", labels))
        exp["labels"] = labels.to_bytes(16, "little") if labels else None
    if proto == PROTO_TCP and draw(st.booleans()):
        state = draw(st.integers(0, 9))
        tcp = [("CTA_PROTOINFO_TCP_STATE", state), ("CTA_PROTOINFO_TCP_WSCALE_ORIGINAL", 7),
               ("CTA_PROTOINFO_TCP_FLAGS_ORIGINAL", (draw(u8), draw(u8)))]
        attrs.append(nest("CTA_PROTOINFO", [nest("CTA_PROTOINFO_TCP", draw(st.permutations(tcp)))]))
        exp["tcp_state"] = state
    exp["counted"] = False  # no counter attributes: accounting was off when the entry was created
    for direction in ("ORIG", "REPLY"):
        width = draw(st.sampled_from([None, 64, 32]))
        if width is not None:
            pk, by = draw(u64 if width == 64 else u32), draw(u64 if width == 64 else u32)
            prefix = "CTA_COUNTERS" if width == 64 else "CTA_COUNTERS32"
            attrs.append(nest(f"CTA_COUNTERS_{direction}", [(f"{prefix}_PACKETS", pk), (f"{prefix}_BYTES", by)]))
            d = direction.lower()
            exp[f"{d}_packets"], exp[f"{d}_bytes"] = pk, by
            exp["counted"] = True
    ts = draw(st.sampled_from(["none", "start", "both"]))
    if ts != "none":
        start, stop = draw(u64), draw(u64)
        parts: list[Any] = [("CTA_TIMESTAMP_START", start)]
        exp["start_ns"] = start
        if ts == "both":
            parts.append(("CTA_TIMESTAMP_STOP", stop))
            exp["stop_ns"] = stop
        attrs.append(nest("CTA_TIMESTAMP", parts))
    # Attributes the decoder must step over.
    for extra in draw(st.lists(st.sampled_from(["timeout", "use", "help", "secmark"]), unique=True)):
        attrs.append({"timeout": ("CTA_TIMEOUT", 120), "use": ("CTA_USE", 1), "help": ("CTA_HELP", "ftp"),
                      "secmark": ("CTA_SECMARK", 9)}[extra])
    attrs = draw(st.permutations(attrs))

    delete = draw(st.booleans())
    msg = nfct_msg()
    msg["header"]["type"] = CT_DELETE if delete else CT_NEW
    msg["header"]["flags"] = NLM_F_MULTI
    msg["header"]["sequence_number"] = draw(u32)
    msg["nfgen_family"] = family
    msg["attrs"] = attrs
    msg.encode()
    return bytes(msg.data), Connection(**exp), delete


def decode_pyroute2(data: bytes) -> Connection:
    msg = nfct_msg(data)
    msg.decode()
    return connection_from_pyroute2(msg)


def decode_all(decoder: Decoder, buf: bytes | memoryview, **kw: Any) -> tuple[list[Connection], Any]:
    out: list[Connection] = []
    res = decoder.decode_batch(buf, out, **kw)
    return out, res


# -- properties -----------------------------------------------------------------------------

@SETTINGS
@given(st.lists(entries(), min_size=1, max_size=6), st.booleans())
def test_decode_matches_pyroute2_and_entry(batch: list[tuple[bytes, Connection, bool]], done: bool) -> None:
    buf = b"".join(m for m, _, _ in batch) + (done_message() if done else b"")
    expected = [c for _, c, _ in batch]
    assert [decode_pyroute2(m) for m, _, _ in batch] == expected

    for decoder in (Decoder(compiled=False), Decoder()):
        got, res = decode_all(decoder, buf)
        assert got == expected
        assert (res.decoded, res.skipped, res.done, res.errno) == (len(batch), 0, done, 0)
        assert decode_all(decoder, memoryview(buf))[0] == expected
    for c in expected:
        assert_valid(c)


@SETTINGS
@given(st.lists(entries(), min_size=1, max_size=6), st.sets(u16, max_size=3))
def test_zone_filter_and_destroyed(batch: list[tuple[bytes, Connection, bool]], zones: set[int]) -> None:
    buf = b"".join(m for m, _, _ in batch)
    for decoder in (Decoder(compiled=False), Decoder()):
        for _ in range(2):  # the same buffer again: nothing kept from the first
            out: list[Connection] = []
            gone: list[Connection] = []
            res = decoder.decode_batch(buf, out, zones=zones, destroyed=gone)
            assert res.decoded == len(batch)
            assert out == [c for _, c, d in batch if not d and c.zone in zones]
            assert gone == [c for _, c, d in batch if d and c.zone in zones]


@SETTINGS
@given(st.lists(entries(), min_size=1, max_size=4), st.data())
def test_truncated_buffer_decodes_complete_prefix(batch: list[tuple[bytes, Connection, bool]],
                                                  data: st.DataObject) -> None:
    buf = b"".join(m for m, _, _ in batch)
    cut = data.draw(st.integers(0, len(buf) - 1))
    ends, pos = [], 0
    for m, _, _ in batch:
        pos += len(m)
        ends.append(pos)
    complete = sum(1 for e in ends if e <= cut)
    for decoder in (Decoder(compiled=False), Decoder()):
        out, res = decode_all(decoder, buf[:cut])
        assert out == [c for _, c, _ in batch[:complete]]
        # A cut inside a message's header is invisible (< 16 bytes left); else it is counted.
        partial = cut not in ends and cut - (ends[complete - 1] if complete else 0) >= 16
        assert res.skipped == (1 if partial else 0)


@SETTINGS
@given(st.lists(entries(), min_size=1, max_size=3), st.data())
def test_mutated_messages_never_raise(batch: list[tuple[bytes, Connection, bool]], data: st.DataObject) -> None:
    buf = mutated(b"".join(m for m, _, _ in batch), data)
    generic, gres = decode_all(Decoder(), bytes(buf))
    assert gres.decoded == len(generic)
    for c in generic:
        assert_valid(c)


@SETTINGS
@given(st.binary(max_size=2048))
def test_random_bytes_never_raise(buf: bytes) -> None:
    out, res = decode_all(Decoder(), buf)
    assert res.decoded == len(out)
    for c in out:
        assert_valid(c)


@SETTINGS
@given(st.binary(min_size=4, max_size=600), st.sampled_from([CT_NEW, CT_DELETE]), st.sampled_from([2, 10]))
def test_random_ct_payload_never_raises(payload: bytes, mtype: int, family: int) -> None:
    """Garbage behind a valid nlmsghdr + nfgenmsg reaches the attribute walk."""
    msg = struct.pack("=IHHIIBBH", 20 + len(payload), mtype, NLM_F_MULTI, 1, 0, family, 0, 0) + payload
    msg += b"\0" * (-len(msg) % 4)
    out, res = decode_all(Decoder(), msg * 2)
    assert res.decoded + res.skipped == 2
    for c in out:
        assert_valid(c)


# -- specific cases -------------------------------------------------------------------------

def both_tuples() -> list[Any]:
    return [("CTA_TUPLE_ORIG", ip4_tuple("1.1.1.1", "2.2.2.2")), ("CTA_TUPLE_REPLY", ip4_tuple("2.2.2.2", "1.1.1.1"))]


def test_error_done_and_other_messages() -> None:
    ok = ct_message(both_tuples())
    err = struct.pack("=IHHIIi", 36, NLMSG_ERROR, 0, 1, 0, -1) + b"\0" * 16  # EPERM + original header
    ack = struct.pack("=IHHIIi", 36, NLMSG_ERROR, 0, 1, 0, 0) + b"\0" * 16
    stats = struct.pack("=IHHIIBBH", 20, (1 << 8) | 5, 0, 1, 0, 0, 0, 0)
    out, res = decode_all(Decoder(), ok + ack + stats + err + done_message(105) + ok)
    assert len(out) == 1 and res.ignored == 1
    assert (res.errno, res.done) == (1, True)  # first errno wins; nothing read after DONE
    out, res = decode_all(Decoder(), done_message(105))
    assert (res.errno, res.done) == (105, True)
    intr = bytearray(ok)
    intr[6] |= 0x10  # NLM_F_DUMP_INTR
    assert decode_all(Decoder(), bytes(intr))[1].interrupted


def test_missing_tuple_or_wrong_family_is_skipped() -> None:
    only_orig = ct_message([("CTA_TUPLE_ORIG", ip4_tuple("1.1.1.1", "2.2.2.2"))])
    v4_in_v6 = ct_message(both_tuples(), family=socket.AF_INET6)
    for decoder in (Decoder(), Decoder(compiled=False)):
        out, res = decode_all(decoder, only_orig + v4_in_v6)
        assert out == [] and res.skipped == 2


def test_tuple_zone_is_used_without_cta_zone() -> None:
    """Directional zones (conntrack --orig-zone) come as CTA_TUPLE_ZONE, unknown to pyroute2."""
    base = ct_message(both_tuples())
    # Append CTA_TUPLE_ZONE (3) = 7 to the original tuple by hand and fix up the lengths.
    zone_attr = struct.pack("=HH", 6, 3) + struct.pack(">H", 7) + b"\0\0"
    olen = struct.unpack_from("=H", base, 20)[0]
    msg = bytearray(base[:20 + olen] + zone_attr + base[20 + olen:])
    struct.pack_into("=H", msg, 20, olen + len(zone_attr))
    struct.pack_into("=I", msg, 0, len(msg))
    for decoder in (Decoder(), Decoder(compiled=False)):
        for _ in range(2):
            out, _ = decode_all(decoder, bytes(msg))
            assert [c.zone for c in out] == [7]


def test_module_level_decode_batch() -> None:
    msg = ct_message([("CTA_TUPLE_ORIG", ip4_tuple("1.1.1.1", "2.2.2.2", sport=5, dport=53)),
                ("CTA_TUPLE_REPLY", ip4_tuple("2.2.2.2", "1.1.1.1", sport=53, dport=5)), ("CTA_MARK", 3)])
    out: list[Connection] = []
    res = decode_batch(msg * 3, out)
    assert res.decoded == 3 and [c.mark for c in out] == [3, 3, 3]
    assert out[0].key == (0, PROTO_UDP, b"\1\1\1\1", 5, b"\2\2\2\2", 53)
