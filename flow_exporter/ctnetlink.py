# cython: boundscheck=False, wraparound=False, initializedcheck=False
"""ctnetlink messages decoded into :class:`~flow_exporter.connection.Connection` objects, written once (issue 39).

One walk over a recv() buffer of IPCTNL_MSG_CT_NEW/DELETE messages, in Cython's pure-Python mode: compiled, it
reads the buffer through a typed view and each attribute costs a few C loads; interpreted (no compiler, or
``FLOW_EXPORTER_INTERPRETED``), the same code runs on a memoryview, several times slower (measured:
docs/performance.md#issue-39-the-interpreted-build-of-the-poll-fused-poll). It replaces a pure
decoder that learned per-layout templates and the hand-written C walk of the events and dump paths.

Why by hand and not pyroute2: ``NFCTSocket.dump()`` builds a tree of message objects per entry, far too slow
for a 1M-entry table polled every few seconds (bench/bench_compiled.py; measured:
docs/performance.md#targets-performance-issue-earlier).

The rules (``flow_exporter.conntrack.decode`` states the fields; tests/unit/test_decode.py holds them to
pyroute2 and to the entries the tests put in the kernel):

* A message is skipped, and counted, when any attribute header in a list it walks is out of bounds or shorter
  than a header, a value's payload is shorter than its format, an address belongs to the other family than
  the nfgenmsg's, or either tuple lacks its source, destination or protocol. The buffer's walk stops at a
  message header whose length is out of bounds (counted as skipped) and at NLMSG_DONE.
* When an attribute occurs twice, the first occurrence wins (as pyroute2's get_attr); the second is still
  checked for its length.
* Values are big-endian, as ctnetlink puts them; the netlink and attribute headers are in the host's order.

Compiled without bounds checks (the directive line above): every read is inside a message whose length was
checked against the buffer and an attribute whose header was checked against its list; the sanitizer job
(tools/sanitize.sh) runs the decoder's tests, hostile bytes included, on an ASAN build.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Container
from typing import TYPE_CHECKING

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, Connection

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:
    from cython.cimports.libc.string import memcpy  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["CT_DELETE", "CT_NEW", "NLMSG_DONE", "NLMSG_ERROR", "decode"]

# netlink / nfnetlink constants (linux/netlink.h, linux/netfilter/nfnetlink_conntrack.h)
NLMSG_HDRLEN = 16
NFGEN_HDRLEN = 4
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_DUMP_INTR = 0x10
NLA_TYPE_MASK = 0x3FFF  # ~(NLA_F_NESTED | NLA_F_NET_BYTEORDER)
CT_NEW = (1 << 8) | 0  # NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW
CT_DELETE = (1 << 8) | 2  # ... | IPCTNL_MSG_CT_DELETE

_HDR: cython.Py_ssize_t = NLMSG_HDRLEN
_MSG_MIN: cython.Py_ssize_t = NLMSG_HDRLEN + NFGEN_HDRLEN
_ERROR: cython.int = NLMSG_ERROR
_DONE: cython.int = NLMSG_DONE
_INTR: cython.int = NLM_F_DUMP_INTR
_TYPE_MASK: cython.int = NLA_TYPE_MASK
_NEW: cython.int = CT_NEW
_DELETE: cython.int = CT_DELETE
_INET: cython.int = 2  # AF_INET
_INET6: cython.int = 10  # AF_INET6
_ICMP: cython.uint = PROTO_ICMP
_ICMPV6: cython.uint = PROTO_ICMPV6
_LITTLE: cython.bint = sys.byteorder == "little"  # the headers' order
_ONE: cython.ulonglong = 1  # a value's bit is _ONE << f (not a cast: interpreted, Cython's cast is a slow call)

# Where each value goes in a walk's value table: twelve per tuple (the original's at 0, the reply's at _R),
# then the message's own. An address (and the labels) keeps its offset in the buffer there, not its bytes.
_SRC: cython.int = 0
_DST: cython.int = 1
_PROTO: cython.int = 2
_SPORT: cython.int = 3
_DPORT: cython.int = 4
_ICMP_ID: cython.int = 5
_ICMP_TYPE: cython.int = 6
_ICMP_CODE: cython.int = 7
_ICMP6_ID: cython.int = 8
_ICMP6_TYPE: cython.int = 9
_ICMP6_CODE: cython.int = 10
_TZONE: cython.int = 11
_R: cython.int = 12
_STATUS: cython.int = 24
_MARK: cython.int = 25
_ID: cython.int = 26
_ZONE: cython.int = 27
_OPK: cython.int = 28
_OBY: cython.int = 29
_OPK32: cython.int = 30
_OBY32: cython.int = 31
_RPK: cython.int = 32
_RBY: cython.int = 33
_RPK32: cython.int = 34
_RBY32: cython.int = 35
_START: cython.int = 36
_STOP: cython.int = 37
_TCP: cython.int = 38
_LABELS: cython.int = 39
_N_VALUES = 40


@cython.final
@cython.cclass
class _Walk:
    """One buffer's walk: the buffer (compiled, a typed view), where the walk is (``off``) and what it counted, and
    the values of the message at hand (``have``: a bit per value found; ``v``: the values, an address's offset;
    ``labels_len``)."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.v = array("Q", bytes(8 * _N_VALUES))
        self.have = 0
        self.family = 0
        self.labels_len = 0
        self.off = 0
        self.decoded = self.skipped = self.ignored = self.kept = 0
        self.err_no = 0
        self.done = self.interrupted = False


def _u16(w: _Walk, at: cython.Py_ssize_t) -> cython.uint:
    """A header's 16-bit field, in the host's order (compiled: one load, the machine's order)."""
    if cython.compiled:
        x: cython.ushort = 0
        memcpy(cython.address(x), cython.address(w.buf[at]), 2)
        return x
    if _LITTLE:
        return w.buf[at] | (w.buf[at + 1] << 8)
    return (w.buf[at] << 8) | w.buf[at + 1]


def _u32(w: _Walk, at: cython.Py_ssize_t) -> cython.uint:
    """A header's 32-bit field, in the host's order (compiled: one load, the machine's order)."""
    if cython.compiled:
        x: cython.uint = 0
        memcpy(cython.address(x), cython.address(w.buf[at]), 4)
        return x
    if _LITTLE:
        return _u16(w, at) | (_u16(w, at + 2) << 16)
    return (_u16(w, at) << 16) | _u16(w, at + 2)


def _attrs_ok(w: _Walk, at: cython.Py_ssize_t, end: cython.Py_ssize_t) -> cython.bint:
    """Whether every attribute header of the list [at, end) is at least a header long and within it."""
    ln: cython.Py_ssize_t
    while at + 4 <= end:
        ln = _u16(w, at)
        if ln < 4 or at + ln > end:
            return False
        at += (ln + 3) & ~3
    return True


def _put(w: _Walk, f: cython.int, pos: cython.Py_ssize_t, plen: cython.Py_ssize_t, size: cython.int) -> cython.bint:
    """Value ``f``, ``size`` bytes big-endian at ``pos``, unless one came first; False when the payload is short.
    An address or the labels: its offset."""
    if plen < size:
        return False
    bit: cython.ulonglong = _ONE << f
    if w.have & bit:
        return True
    w.have |= bit
    if f in (_SRC, _DST, _R + _SRC, _R + _DST, _LABELS):
        w.v[f] = pos
        return True
    x: cython.ulonglong = 0
    i: cython.Py_ssize_t
    for i in range(pos, pos + size):
        x = (x << 8) | w.buf[i]
    w.v[f] = x
    return True


def _walk_tuple(w: _Walk, at: cython.Py_ssize_t, end: cython.Py_ssize_t, base: cython.int) -> cython.bint:
    """CTA_TUPLE_ORIG or _REPLY: its addresses (CTA_TUPLE_IP), ports or ICMP fields (CTA_TUPLE_PROTO), zone."""
    if not _attrs_ok(w, at, end):
        return False
    ln: cython.Py_ssize_t
    ty: cython.int
    pos: cython.Py_ssize_t
    plen: cython.Py_ssize_t
    i: cython.Py_ssize_t
    ilen: cython.Py_ssize_t
    ity: cython.int
    family: cython.int
    size: cython.int
    f: cython.int
    while at + 4 <= end:
        ln = _u16(w, at)
        ty = _u16(w, at + 2) & _TYPE_MASK
        pos = at + 4
        plen = ln - 4
        at += (ln + 3) & ~3
        if ty == 1:  # CTA_TUPLE_IP
            if not _attrs_ok(w, pos, pos + plen):
                return False
            i = pos
            while i + 4 <= pos + plen:
                ilen = _u16(w, i)
                ity = _u16(w, i + 2) & _TYPE_MASK
                if 1 <= ity <= 4:
                    family = _INET if ity <= 2 else _INET6
                    if family != w.family:
                        return False  # an address of the other family
                    size = 4 if ity <= 2 else 16
                    f = _SRC if ity % 2 == 1 else _DST
                    if not _put(w, base + f, i + 4, ilen - 4, size):
                        return False
                i += (ilen + 3) & ~3
        elif ty == 2:  # CTA_TUPLE_PROTO
            if not _attrs_ok(w, pos, pos + plen):
                return False
            i = pos
            while i + 4 <= pos + plen:
                ilen = _u16(w, i)
                ity = _u16(w, i + 2) & _TYPE_MASK
                if 1 <= ity <= 9:
                    # proto, sport, dport, icmp id, type, code, icmpv6 id, type, code: in the value table's order
                    size = 1 if ity in (1, 5, 6, 8, 9) else 2
                    if not _put(w, base + _PROTO + ity - 1, i + 4, ilen - 4, size):
                        return False
                i += (ilen + 3) & ~3
        elif ty == 3 and not _put(w, base + _TZONE, pos, plen, 2):  # CTA_TUPLE_ZONE
            return False
    return True


def _walk_nested(
    w: _Walk, at: cython.Py_ssize_t, end: cython.Py_ssize_t, first: cython.int, count: cython.int, wide: cython.int
) -> cython.bint:
    """A nested list whose types 1..``count`` go to values ``first``.. (the first ``wide`` of them 8 bytes, the
    rest 4): CTA_COUNTERS_* and CTA_TIMESTAMP."""
    if not _attrs_ok(w, at, end):
        return False
    ln: cython.Py_ssize_t
    ty: cython.int
    while at + 4 <= end:
        ln = _u16(w, at)
        ty = _u16(w, at + 2) & _TYPE_MASK
        if 1 <= ty <= count and not _put(w, first + ty - 1, at + 4, ln - 4, 8 if ty <= wide else 4):
            return False
        at += (ln + 3) & ~3
    return True


def _walk_tcp(w: _Walk, at: cython.Py_ssize_t, end: cython.Py_ssize_t) -> cython.bint:
    """CTA_PROTOINFO > CTA_PROTOINFO_TCP > CTA_PROTOINFO_TCP_STATE."""
    if not _attrs_ok(w, at, end):
        return False
    ln: cython.Py_ssize_t
    i: cython.Py_ssize_t
    ilen: cython.Py_ssize_t
    stop: cython.Py_ssize_t
    while at + 4 <= end:
        ln = _u16(w, at)
        if _u16(w, at + 2) & _TYPE_MASK == 1:
            i = at + 4
            stop = at + ln
            if not _attrs_ok(w, i, stop):
                return False
            while i + 4 <= stop:
                ilen = _u16(w, i)
                if _u16(w, i + 2) & _TYPE_MASK == 1 and not _put(w, _TCP, i + 4, ilen - 4, 1):
                    return False
                i += (ilen + 3) & ~3
        at += (ln + 3) & ~3
    return True


_REQUIRED: cython.ulonglong = (
    (1 << _SRC) | (1 << _DST) | (1 << _PROTO) | (1 << (_R + _SRC)) | (1 << (_R + _DST)) | (1 << (_R + _PROTO))
)


def _walk_message(w: _Walk, off: cython.Py_ssize_t, mlen: cython.Py_ssize_t) -> cython.bint:
    """The message at ``off`` walked into the value table: False when it is to be skipped."""
    if mlen < _MSG_MIN:
        return False
    family: cython.int = w.buf[off + _HDR]
    if family != _INET and family != _INET6:
        return False
    w.have = 0
    w.family = family
    at: cython.Py_ssize_t = off + _MSG_MIN
    end: cython.Py_ssize_t = off + mlen
    if not _attrs_ok(w, at, end):
        return False
    ln: cython.Py_ssize_t
    ty: cython.int
    pos: cython.Py_ssize_t
    plen: cython.Py_ssize_t
    ok: cython.bint
    while at + 4 <= end:
        ln = _u16(w, at)
        ty = _u16(w, at + 2) & _TYPE_MASK
        pos = at + 4
        plen = ln - 4
        at += (ln + 3) & ~3
        if ty == 1 or ty == 2:  # CTA_TUPLE_ORIG, CTA_TUPLE_REPLY
            ok = _walk_tuple(w, pos, pos + plen, 0 if ty == 1 else _R)
        elif ty == 3:  # CTA_STATUS
            ok = _put(w, _STATUS, pos, plen, 4)
        elif ty == 8:  # CTA_MARK
            ok = _put(w, _MARK, pos, plen, 4)
        elif ty == 12:  # CTA_ID
            ok = _put(w, _ID, pos, plen, 4)
        elif ty == 18:  # CTA_ZONE
            ok = _put(w, _ZONE, pos, plen, 2)
        elif ty == 9 or ty == 10:  # CTA_COUNTERS_ORIG, _REPLY: packets, bytes (64 bits), then their 32-bit forms
            ok = _walk_nested(w, pos, pos + plen, _OPK if ty == 9 else _RPK, 4, 2)
        elif ty == 20:  # CTA_TIMESTAMP: start, stop
            ok = _walk_nested(w, pos, pos + plen, _START, 2, 2)
        elif ty == 4:  # CTA_PROTOINFO
            ok = _walk_tcp(w, pos, pos + plen)
        elif ty == 22 and plen > 0:  # CTA_LABELS: as long as the kernel's bitmap is
            if not _has(w, _LABELS):
                w.labels_len = plen
            ok = _put(w, _LABELS, pos, plen, plen)
        else:
            ok = True
        if not ok:
            return False
    return (w.have & _REQUIRED) == _REQUIRED


def _pick(w: _Walk, f: cython.int) -> cython.ulonglong:
    """Value ``f``, 0 when the message had none."""
    return w.v[f] if w.have >> f & 1 else 0


def _has(w: _Walk, f: cython.int) -> cython.bint:
    return (w.have >> f & 1) != 0


def _bytes_at(w: _Walk, f: cython.int, size: cython.Py_ssize_t) -> bytes:
    """An address (or the labels) as bytes: compiled, copied straight from the buffer (no view object)."""
    at: cython.Py_ssize_t = w.v[f]
    if cython.compiled:
        copied: bytes = cython.cast(cython.p_const_char, cython.address(w.buf[at]))[:size]
        return copied
    return bytes(w.buf[at : at + size])


def _s32(w: _Walk, at: cython.Py_ssize_t) -> cython.long:
    """A header's signed 32-bit field (an errno), in the host's order."""
    x: cython.long = _u32(w, at)
    return x - 0x100000000 if x >= 0x80000000 else x


def _zone(w: _Walk) -> cython.ulonglong:
    """CTA_ZONE, else the original tuple's zone, else the reply's (directional zones), else 0."""
    if _has(w, _ZONE):
        return w.v[_ZONE]
    if _has(w, _TZONE):
        return w.v[_TZONE]
    return _pick(w, _R + _TZONE)


@cython.final
@cython.cclass
class _Row:
    """A walked message's values as the Connection's fields (the ports as the store keys them: for ICMP the id,
    and type << 8 | code); the fused poll compares them with the store's columns without making a Connection."""

    def __init__(self) -> None:
        self.proto = 0
        self.sport = self.dport = self.rsport = self.rdport = 0
        self.zone = self.ct_id = self.mark = self.status = self.start = self.stop = 0
        self.opk = self.oby = self.rpk = self.rby = 0
        self.icmp_type = self.icmp_code = self.icmp_id = 0
        self.tcp = -1
        self.counted = self.labelled = self.icmp = False


def _row_of(w: _Walk, r: _Row) -> None:
    """The walked message's values into ``r``: every rule of what a message means, for both paths."""
    proto: cython.uint = w.v[_PROTO]
    tid: cython.int
    r.proto = proto
    r.icmp = proto in (_ICMP, _ICMPV6)
    if r.icmp:  # ports: the id, and type << 8 | code; icmp_* the original tuple's
        tid = _ICMP_ID if proto == _ICMP else _ICMP6_ID
        r.sport = r.icmp_id = _pick(w, tid)
        r.icmp_type = _pick(w, tid + 1)
        r.icmp_code = _pick(w, tid + 2)
        r.dport = (r.icmp_type << 8) | r.icmp_code
        r.rsport = _pick(w, _R + tid)
        r.rdport = (_pick(w, _R + tid + 1) << 8) | _pick(w, _R + tid + 2)
    else:
        r.sport = _pick(w, _SPORT)
        r.dport = _pick(w, _DPORT)
        r.rsport = _pick(w, _R + _SPORT)
        r.rdport = _pick(w, _R + _DPORT)
        r.icmp_type = r.icmp_code = r.icmp_id = 0
    r.zone = _zone(w)
    r.ct_id = _pick(w, _ID)
    r.mark = _pick(w, _MARK)
    r.status = _pick(w, _STATUS)
    r.tcp = w.v[_TCP] if _has(w, _TCP) else -1
    r.opk = w.v[_OPK] if _has(w, _OPK) else _pick(w, _OPK32)
    r.oby = w.v[_OBY] if _has(w, _OBY) else _pick(w, _OBY32)
    r.rpk = w.v[_RPK] if _has(w, _RPK) else _pick(w, _RPK32)
    r.rby = w.v[_RBY] if _has(w, _RBY) else _pick(w, _RBY32)
    r.start = _pick(w, _START)
    r.stop = _pick(w, _STOP)
    r.counted = _has(w, _OPK) or _has(w, _OPK32) or _has(w, _RPK) or _has(w, _RPK32)
    r.labelled = False
    i: cython.Py_ssize_t
    at: cython.Py_ssize_t
    if _has(w, _LABELS):  # all zero: none (the kernel never sends it; one way to say "no labels")
        at = w.v[_LABELS]
        for i in range(at, at + w.labels_len):
            if w.buf[i]:
                r.labelled = True
                break


def _address(w: _Walk, f: cython.int) -> bytes:
    """An address of the walked message (``_SRC``, ``_DST``, or those plus ``_R``), as bytes."""
    return _bytes_at(w, f, 4 if w.family == _INET else 16)


def _connection(w: _Walk, r: _Row) -> Connection:
    """The Connection of the walked message, from its row (compiled: its fields are struct members, set in place)."""
    c: Connection = Connection.__new__(Connection)
    c.family = w.family
    c.proto = r.proto
    c.orig_src = _address(w, _SRC)
    c.orig_dst = _address(w, _DST)
    c.reply_src = _address(w, _R + _SRC)
    c.reply_dst = _address(w, _R + _DST)
    c.orig_sport = r.sport
    c.orig_dport = r.dport
    c.reply_sport = r.rsport
    c.reply_dport = r.rdport
    if r.icmp:
        c.icmp_type = r.icmp_type
        c.icmp_code = r.icmp_code
        c.icmp_id = r.icmp_id
    else:
        c.icmp_type = c.icmp_code = c.icmp_id = None
    c.zone = r.zone
    c.ct_id = r.ct_id
    c.mark = r.mark
    c.labels = _bytes_at(w, _LABELS, w.labels_len) if r.labelled else None
    c.status = r.status
    c.tcp_state = r.tcp if r.tcp >= 0 else None
    c.orig_packets = r.opk
    c.orig_bytes = r.oby
    c.reply_packets = r.rpk
    c.reply_bytes = r.rby
    c.start_ns = r.start
    c.stop_ns = r.stop
    c.counted = r.counted
    return c


def _next_entry(w: _Walk, zones: Container[int] | None) -> cython.int:
    """Walk to the buffer's next CT_NEW/CT_DELETE message that decodes and whose zone is in ``zones`` (None: any):
    its type, or 0 at the buffer's end. What it passes is counted in ``w`` (:func:`_result`)."""
    n: cython.Py_ssize_t = len(w.buf)
    off: cython.Py_ssize_t
    mlen: cython.Py_ssize_t
    mtype: cython.int
    err: cython.long
    while w.off + _HDR <= n:
        off = w.off
        mlen = _u32(w, off)
        mtype = _u16(w, off + 4)
        if mlen < _HDR or mlen > n - off:
            w.skipped += 1  # cannot find the next message: the rest is lost
            w.off = n
            return 0
        if _u16(w, off + 6) & _INTR:  # set on any message of the dump, NLMSG_DONE included
            w.interrupted = True
        w.off = off + ((mlen + 3) & ~3)
        if mtype in (_NEW, _DELETE):
            if not _walk_message(w, off, mlen):
                w.skipped += 1
            else:
                w.decoded += 1
                if zones is None or _zone(w) in zones:
                    w.kept += 1
                    return mtype
        elif mtype == _DONE:
            w.done = True
            if mlen >= _HDR + 4:
                err = _s32(w, off + _HDR)
                if err < 0 and not w.err_no:
                    w.err_no = -err
            w.off = n
            return 0
        elif mtype == _ERROR:
            if mlen < _HDR + 4:
                w.skipped += 1
            else:
                err = _s32(w, off + _HDR)
                if err and not w.err_no:
                    w.err_no = -err if err < 0 else err  # 0 is an ACK
        else:
            w.ignored += 1
    return 0


def _result(w: _Walk) -> tuple[int, int, int, bool, int, bool, int]:
    """(decoded, skipped, ignored, done, errno, interrupted, kept): the fields of
    :class:`flow_exporter.ports.DecodeResult`."""
    return w.decoded, w.skipped, w.ignored, w.done, w.err_no, w.interrupted, w.kept


def decode(
    buf: memoryview, out: list[Connection], zones: Container[int] | None, destroyed: list[Connection] | None
) -> tuple[int, int, int, bool, int, bool, int]:
    """A Connection per CT_NEW/CT_DELETE message of ``buf`` (a bytes-like buffer of bytes) appended to
    ``out`` (to ``destroyed`` for a CT_DELETE when it is given), if its zone is in ``zones`` (None: any).

    Returns (decoded, skipped, ignored, done, errno, interrupted, kept): the fields of
    :class:`flow_exporter.ports.DecodeResult`. Never raises on what the buffer holds.
    """
    w = _Walk(buf)
    r = _Row()
    mtype: cython.int = _next_entry(w, zones)
    while mtype:
        _row_of(w, r)
        conn = _connection(w, r)
        if destroyed is not None and mtype == _DELETE:
            destroyed.append(conn)
        else:
            out.append(conn)
        mtype = _next_entry(w, zones)
    return _result(w)
