"""A FlowRecord's bytes: its Avro value, its Kafka key, a batch prepared; written once (issue 39).

The Avro encoding of ``schemas/flow_record.avsc`` straight from an :class:`~flow_exporter.flow.Export`,
in Cython's pure-Python mode: compiled, each field is a few C stores into one reused buffer and the
record's fields are read as struct members; interpreted, the same code appends each field's bytes
(varints from tables) and joins them once. ``tests/unit/test_encoder.py`` holds both builds to the bytes
fastavro writes, and ``tests/unit/test_record_bytes.py`` holds them to each other on hostile values.

Why by hand: fastavro's ``schemaless_writer`` costs more per record than everything else on the export path
together (bench/bench_export.py; measured: docs/performance.md#export-throughput-local-broker-delivery-confirmed).
The schema's field order puts the fields fixed for a connection's life first: that prefix is encoded once
per connection (:meth:`RecordEncoder.static`) and cached on the tracked connection by the store (re-encoded
only if the ct mark, labels or Kubernetes metadata change); a record writes its prefix and its own fields
(:meth:`RecordEncoder.encode`).
Why compiled: on a node with churn nearly every record is its connection's first, and the pure prefix held
the GIL for a visible share of the process at 20,000 new connections/s.

A value that does not fit its field raises, the same error in both builds: ``TypeError`` (an int, bytes or
str of another type), ``OverflowError`` (an int past its field: 64 signed bits for longs, 16 unsigned bits
for ports and zones, 8 for the protocol), ``ValueError`` (an address of neither family's length, or a
record without its prefix or connection); a batch gives such a record up (:func:`prepare`).

It is tied to ``schemas/flow_record.avsc``: a schema change must change this file too, and the byte-for-byte
test fails until it does.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, TCP_STATE_NAMES
from flow_exporter.export import Export
from flow_exporter.record import META_FIELDS

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:  # C's memcpy and the bytearray's and bytes' own constructors (interpreted, parts are joined)
    from cython.cimports.cpython.bytearray import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyByteArray_AS_STRING,
        PyByteArray_Resize,
    )
    from cython.cimports.cpython.bytes import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyBytes_AS_STRING,
        PyBytes_FromStringAndSize,
    )
    from cython.cimports.cpython.long import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyLong_AsLongLongAndOverflow,
    )
    from cython.cimports.cpython.unicode import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyUnicode_AsUTF8AndSize,
    )
    from cython.cimports.flow_exporter.community_id import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        community_id_ascii,
    )
    from cython.cimports.flow_exporter.export import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        as_export,
    )
    from cython.cimports.libc.string import memcpy  # type: ignore[import-untyped,import-not-found,unused-ignore]
else:
    from flow_exporter.community_id import community_id_ascii
    from flow_exporter.export import as_export

__all__ = ["Encode", "Failures", "RecordEncoder", "partition_key", "prepare", "reporter", "zigzag_varint"]

Encode = Callable[[Export, int], bytes]
Failures = list[tuple[Export, Exception]]

_TCP: cython.longlong = PROTO_TCP
_ICMP: cython.longlong = PROTO_ICMP
_ICMPV6: cython.longlong = PROTO_ICMPV6
_AF_INET: cython.longlong = socket.AF_INET
_AF_INET6: cython.longlong = socket.AF_INET6
_I64_MIN = -0x8000000000000000
_I64_MAX = 0x7FFFFFFFFFFFFFFF


# ---------------------------------------------------------------- varints (the interpreted build's tables)


def zigzag_varint(n: int) -> bytes:
    """Avro ``long``/``int``: zigzag, then little-endian base-128 varint (any int64).

    Built from 14-bit table lookups (two varint bytes each) instead of a per-byte loop: three times
    faster interpreted for the 4-6 byte values counters and times need.
    """
    z = (n << 1) ^ (n >> 63)
    if z < 0x4000:
        return _U14[z]
    if z < 0x10000000:
        return _C14[z & 0x3FFF] + _U14[z >> 14]
    if z < 0x40000000000:
        return _C14[z & 0x3FFF] + _C14[(z >> 14) & 0x3FFF] + _U14[z >> 28]
    return _C14[z & 0x3FFF] + _C14[(z >> 14) & 0x3FFF] + _C14[(z >> 28) & 0x3FFF] + _unsigned_tail(z >> 42)


def _unsigned_tail(z: int) -> bytes:
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


_U14 = [_unsigned_tail(z) for z in range(0x4000)]  # every 1- and 2-byte varint
_C14 = [bytes(((z & 0x7F) | 0x80, (z >> 7) | 0x80)) for z in range(0x4000)]  # 14 bits, more to come
# tcpState: a union's branch 1 and the state's name, or null (a byte 0)
_TCP_STATES: list[bytes] = [b"\x02" + zigzag_varint(len(s)) + s.encode() for s in TCP_STATE_NAMES]
_K8S: tuple[tuple[str, bool], ...] = tuple((name, name.endswith("Labels")) for name in META_FIELDS)
_NO_K8S: bytes = b"\x00" * len(META_FIELDS) + b"\x00"  # all Kubernetes and network fields null, flowType 0


# ---------------------------------------------------------------- checked values


def _long(v: object) -> cython.longlong:
    """``v`` when it is an int that fits 64 signed bits (an Avro long), else OverflowError (TypeError: not an int)."""
    if not isinstance(v, int):
        raise TypeError(f"an int is needed, not {type(v).__name__}")
    if cython.compiled:  # no try block around C's conversion: its set-up costs more than the conversion
        overflow: cython.int = 0
        i: cython.longlong = PyLong_AsLongLongAndOverflow(v, cython.address(overflow))
        if overflow:
            raise OverflowError(f"{v} does not fit 64 signed bits")
    elif v < _I64_MIN or v > _I64_MAX:
        raise OverflowError(f"{v} does not fit 64 signed bits")
    else:
        i = v
    return i


def _small(v: object, bits: cython.int) -> cython.longlong:
    """``v`` when it is an int that fits ``bits`` unsigned bits (a port, a zone, the protocol), else OverflowError."""
    i: cython.longlong = _long(v)
    if i < 0 or i >> bits:
        raise OverflowError(f"{v} does not fit {bits} unsigned bits")
    return i


def _utf8(s: object) -> bytes:
    if not isinstance(s, str):
        raise TypeError(f"a str is needed, not {type(s).__name__}")
    return s.encode()


@cython.boundscheck(False)
@cython.wraparound(False)
def _put_address(o: _Out, family: cython.longlong, packed: object) -> None:
    """A packed address as its text (an Avro string), as inet_ntop writes it.

    IPv4 is four decimal octets written here, IPv6 (compressed zeros) is the socket module's: no cache of
    formatted addresses (one held memory for every distinct peer of a node, for no gain at 250k)."""
    if not isinstance(packed, bytes):
        raise TypeError(f"an address is bytes, not {type(packed).__name__}")
    a: bytes = packed
    if family != _AF_INET:
        o.text(socket.inet_ntop(socket.AF_INET6, a))  # ValueError unless 16 bytes
        return
    if len(a) != 4:
        raise ValueError(f"an IPv4 address of {len(a)} bytes")
    n: cython.int = 3
    i: cython.int
    v: cython.uchar
    for i in range(4):
        v = a[i]
        n += 3 if v >= 100 else 2 if v >= 10 else 1
    o.varint(n)
    for i in range(4):
        v = a[i]
        if i:
            o.u8(46)  # "."
        if v >= 100:
            o.u8(48 + v // 100)
        if v >= 10:
            o.u8(48 + v // 10 % 10)
        o.u8(48 + v % 10)


def reporter(node: str, meta: dict[str, Any] | None) -> int:
    """The record's ``reporter``: 1 when the source pod runs on ``node``, plus 2 when the destination pod does."""
    if not meta:
        return 0
    return (1 if meta.get("sourceNodeName") == node else 0) | (2 if meta.get("destinationNodeName") == node else 0)


# ---------------------------------------------------------------- the output buffer


@cython.final
@cython.cclass
class _Out:
    """Bytes written field by field, then taken as one bytes object; reused for every value.

    Compiled: stored at a pointer into a scratch bytearray that grows (taken again after a resize) and is
    copied once into the result; interpreted: each field's bytes appended to a list and joined.
    """

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.pos = 0
        self.cap = 512
        self.out = bytearray(self.cap)
        if cython.compiled:
            self.buf = cython.cast(cython.p_uchar, PyByteArray_AS_STRING(self.out))

    def reset(self) -> None:
        self.pos = 0
        if not cython.compiled:
            self.parts = []

    def room(self, n: cython.Py_ssize_t) -> cython.int:
        if self.pos + n > self.cap:
            self.cap = max(2 * self.cap, self.pos + n)
            if cython.compiled:
                PyByteArray_Resize(self.out, self.cap)
                self.buf = cython.cast(cython.p_uchar, PyByteArray_AS_STRING(self.out))
        return 0

    def u8(self, v: cython.uchar) -> cython.int:
        if cython.compiled:
            if self.pos >= self.cap:
                self.room(1)
            self.buf[self.pos] = v
        else:
            self.parts.append(_U14[v] if v < 0x80 else bytes((v,)))
        self.pos += 1
        return 0

    def varint(self, v: cython.longlong) -> cython.int:
        """An Avro long: zigzag, then base-128 little-endian."""
        if cython.compiled:
            if self.pos + 10 > self.cap:
                self.room(10)
            z: cython.ulonglong = (cython.cast(cython.ulonglong, v) << 1) ^ cython.cast(cython.ulonglong, v >> 63)
            p: cython.p_uchar = self.buf + self.pos
            i: cython.Py_ssize_t = 0
            while z >= 0x80:
                p[i] = (z & 0x7F) | 0x80
                z >>= 7
                i += 1
            p[i] = z
            self.pos += i + 1
        else:
            b = zigzag_varint(v)
            self.parts.append(b)
            self.pos += len(b)
        return 0

    def be16(self, v: cython.uint) -> cython.int:
        """A port in network order (the partition key's)."""
        self.u8(v >> 8)
        self.u8(v & 0xFF)
        return 0

    def raw(self, data: bytes) -> cython.int:
        n: cython.Py_ssize_t = len(data)
        if cython.compiled:
            if self.pos + n > self.cap:
                self.room(n)
            if n:
                memcpy(self.buf + self.pos, cython.cast(cython.p_char, data), n)
        else:
            self.parts.append(data)
        self.pos += n
        return 0

    def text(self, s: object) -> cython.int:
        """An Avro string: its UTF-8 (compiled, the str's own cached copy, no bytes object made)."""
        if cython.compiled:
            if not isinstance(s, str):
                raise TypeError(f"a str is needed, not {type(s).__name__}")
            n: cython.Py_ssize_t = 0
            p: cython.p_const_char = PyUnicode_AsUTF8AndSize(s, cython.address(n))  # UnicodeEncodeError: surrogates
            self.varint(n)
            if self.pos + n > self.cap:
                self.room(n)
            memcpy(self.buf + self.pos, p, n)
            self.pos += n
        else:
            b: bytes = _utf8(s)
            self.varint(len(b))
            self.raw(b)
        return 0

    def take_after(self, head: bytes, prefix: bytes) -> bytes:
        """``head + prefix`` and what was written since the last reset, as one bytes object (one copy of each)."""
        if cython.compiled:
            lh: cython.Py_ssize_t = len(head)
            lp: cython.Py_ssize_t = len(prefix)
            out = PyBytes_FromStringAndSize(cython.NULL, lh + lp + self.pos)
            p: cython.p_char = PyBytes_AS_STRING(out)
            memcpy(p, cython.cast(cython.p_char, head), lh)
            memcpy(cython.address(p[lh]), cython.cast(cython.p_char, prefix), lp)
            memcpy(cython.address(p[lh + lp]), self.buf, self.pos)
        else:
            out = b"".join((head, prefix, *self.parts))
        value: bytes = cython.cast(bytes, out)
        return value

    def take(self) -> bytes:
        """What was written since the last reset, as bytes."""
        if cython.compiled:
            out = PyBytes_FromStringAndSize(cython.cast(cython.p_char, self.buf), self.pos)
        else:
            out = b"".join(self.parts)
        value: bytes = cython.cast(bytes, out)
        return value


# ---------------------------------------------------------------- the record


@cython.final
@cython.cclass
class RecordEncoder:
    """Encodes the exports of one exporter node as bare Avro FlowRecord values (and prepares batches of them)."""

    def __init__(
        self,
        node: str,
        community_id_seed: int = 0,
        cluster: str = "",
        attributes: dict[str, str] | None = None,
        sampling_probability: float = 1.0,
        schedule: Any = None,
    ) -> None:
        self.node = node
        self.seed = community_id_seed
        self._out = _Out()
        # exporterNode and clusterName: the same in every record of this exporter
        o = self._out
        o.text(node)
        if cluster:
            o.u8(2)
            o.text(cluster)
        else:
            o.u8(0)
        self._node = o.take()
        # attributes (record.attributes) and samplingProbability (sampling.probability): the record's last fields,
        # the same bytes in every record of this exporter; or, while shedding may change the probability
        # (``schedule``: a sampling.Schedule), the probability of each record's first-seen time
        o.reset()
        _put_map(o, attributes or {})
        self._probability_at = None if schedule is None else schedule.probability_at
        self._attributes = o.take() + (struct.pack("<d", sampling_probability) if schedule is None else b"")

    def static(self, export: Export) -> bytes:
        """The connection-lifetime prefix (connectionId .. reporter), left on ``export``.

        The store keeps it for the connection's next records once this one is delivered
        (store.acknowledge) and drops it when the mark, labels or metadata change. The prefix holds all the
        record needs of the connection's fields: a record in flight does not keep them (memory per record in
        flight; at 1M connections the records of one active timeout go out in a burst).
        """
        return self._static(as_export(export))

    def _static(self, e: Export) -> bytes:
        """:meth:`static` of an Export."""
        prefix = e.prefix
        if prefix is None:
            o = self._out
            o.reset()
            self._put_prefix(o, e)
            prefix = o.take()
            e.prefix = prefix
            e.conn = None
        elif not isinstance(prefix, bytes):
            raise TypeError(f"a record's prefix is bytes, not {type(prefix).__name__}")
        return prefix

    def _put_prefix(self, o: _Out, e: Export) -> None:
        """connectionId, exporterNode, clusterName, ... reporter: schemas/flow_record.avsc's order."""
        c = e.conn
        if c is None:
            raise ValueError("a record without its prefix carries its connection's fields")
        fam: cython.longlong = _long(c.family)
        if fam != _AF_INET and fam != _AF_INET6:
            raise ValueError(f"address family {fam} is neither IPv4's nor IPv6's")
        proto: cython.longlong = _small(c.proto, 8)  # the Community ID takes it as one byte
        icmp: cython.bint = proto in (_ICMP, _ICMPV6)
        osrc, odst, rsrc, rdst = c.orig_src, c.orig_dst, c.reply_src, c.reply_dst
        osport: cython.longlong = _small(c.orig_sport, 16)
        odport: cython.longlong = _small(c.orig_dport, 16)
        o.varint(_long(e.flow_id))
        o.raw(self._node)
        o.varint(_long(e.first_seen_ns) // 1_000_000)
        o.u8(8 if fam == _AF_INET else 12)  # ipVersion 4 / 6
        o.varint(proto)
        _put_address(o, fam, osrc)
        o.varint(osport)
        _put_address(o, fam, rsrc)
        o.varint(odport if icmp else _small(c.reply_sport, 16))  # destinationPort: reached, after DNAT
        _put_address(o, fam, odst)
        o.varint(odport)
        # translatedSourceAddress, translatedSourcePort: where the reply goes (after SNAT), when it is not the
        # source. ICMP has no ports: its address only.
        rdport: cython.longlong = 0 if icmp else _small(c.reply_dport, 16)
        if rdst == osrc and (icmp or rdport == osport):
            o.u8(0)
            o.u8(0)
        else:
            o.u8(2)
            _put_address(o, fam, rdst)
            if icmp:
                o.u8(0)
            else:
                o.u8(2)
                o.varint(rdport)
        icmp_type = c.icmp_type if icmp else None
        icmp_code = c.icmp_code if icmp else None
        for v in (icmp_type, icmp_code):
            if v is None:
                o.u8(0)
            else:
                o.u8(2)
                o.varint(_small(v, 16))
        o.varint(_small(c.zone, 16))
        o.varint(_long(c.ct_id))
        o.varint(_long(c.mark))
        labels = c.labels
        if labels is None:
            o.u8(0)
        else:
            if not isinstance(labels, bytes):
                raise TypeError(f"ct labels are bytes, not {type(labels).__name__}")
            o.u8(2)
            o.varint(len(labels))
            o.raw(labels)
        meta = e.meta
        self._put_k8s(o, meta)
        o.varint(_long(e.flags))
        # flowHash: the Community ID of the source and the destination reached (after DNAT); ICMP: type, code
        if icmp:
            flow_hash = community_id_ascii(proto, osrc, rsrc, icmp_type, icmp_code, self.seed)
        else:
            flow_hash = community_id_ascii(proto, osrc, rsrc, osport, _small(c.reply_sport, 16), self.seed)
        o.varint(len(flow_hash))
        o.raw(flow_hash)
        o.u8(reporter(self.node, meta) << 1)

    def _put_k8s(self, o: _Out, meta: object) -> None:
        """The Kubernetes fields, then flowType: all null and flowType 0 without metadata."""
        if not meta:
            o.raw(_NO_K8S)
            return
        if not isinstance(meta, dict):
            raise TypeError(f"Kubernetes metadata is a dict, not {type(meta).__name__}")
        m: dict[str, Any] = meta
        for name, is_map in _K8S:
            v = m.get(name)
            if v is None:
                o.u8(0)
            elif not is_map:
                o.u8(2)
                o.text(v)
            else:
                if not isinstance(v, dict):
                    raise TypeError(f"{name} is a dict, not {type(v).__name__}")
                o.u8(2)
                _put_map(o, v)
        o.varint(_long(m.get("flowType", 0)))

    def _put_tail(self, o: _Out, e: Export, export_ms: cython.longlong) -> None:
        """The record's own fields after its prefix (sequence .. deltas), and the exporter's attributes."""
        o.varint(_long(e.sequence))
        o.varint(export_ms)
        end: cython.longlong = _long(e.flow_end_ns)
        first: cython.longlong = _long(e.first_seen_ns)
        o.varint(max(end, first) // 1_000_000)
        o.varint(_long(e.reason))
        # tcpState: named only for a TCP connection and a known state
        state = e.tcp_state
        key = e.conn_key
        named: cython.bint = False
        st: cython.longlong = 0
        if state is not None and key is not None:
            st = _long(state)
            named = _long(_key(key)[1]) == _TCP and 0 <= st < len(_TCP_STATES)
        if named:
            o.raw(_TCP_STATES[st])
        else:
            o.u8(0)
        _put_counters(o, e.totals)
        _put_counters(o, e.deltas)
        o.raw(self._attributes)
        if self._probability_at is not None:
            o.raw(struct.pack("<d", self._probability_at(first)))

    def encode(self, export: Export, export_ms: object) -> bytes:
        """The record's Avro value."""
        e: Export = as_export(export)
        ms: cython.longlong = _long(export_ms)
        prefix = self._static(e)  # before the reset: a prefix is written with the same buffer
        o = self._out
        o.reset()
        self._put_tail(o, e, ms)
        return o.take_after(b"", prefix)

    def __call__(self, export: Export, export_ms: int) -> bytes:
        return self.encode(export, export_ms)

    def prepare_all(
        self, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
    ) -> Failures:
        """:func:`prepare` with this encoder."""
        return prepare(self, exports, export_ms, topic, framing)


def _put_map(o: _Out, m: dict[Any, Any]) -> None:
    """An Avro map of strings: one block of its entries (none when empty), then the end block."""
    if m:
        o.varint(len(m))
        for k, s in m.items():
            o.text(k)
            o.text(s)
    o.u8(0)


@cython.boundscheck(False)
@cython.wraparound(False)
def _put_counters(o: _Out, counters: object) -> None:
    """A record's totals or deltas: four Avro longs (packets, bytes, reverse packets, reverse bytes)."""
    if type(counters) is not tuple:
        raise TypeError(f"counters are a tuple, not {type(counters).__name__}")
    t: tuple[Any, ...] = counters
    if len(t) != 4:
        raise ValueError(f"4 counters are needed, not {len(t)}")
    o.varint(_long(t[0]))
    o.varint(_long(t[1]))
    o.varint(_long(t[2]))
    o.varint(_long(t[3]))


def _key(key: object) -> tuple[Any, ...]:
    """A connection key: a tuple of six (zone, proto, src, sport, dst, dport)."""
    if type(key) is not tuple:
        raise TypeError(f"a connection key is a tuple, not {type(key).__name__}")
    k: tuple[Any, ...] = key
    if len(k) != 6:
        raise ValueError(f"a connection key has 6 fields, not {len(k)}")
    return k


@cython.boundscheck(False)
@cython.wraparound(False)
def _put_key(o: _Out, e: Export) -> None:
    """record partition key: the protocol, then the lower (address, port) end, then the other."""
    if e.conn_key is None:
        raise ValueError("a record without its connection's key")
    key: tuple[Any, ...] = _key(e.conn_key)
    proto, src, sport, dst, dport = key[1], key[2], key[3], key[4], key[5]
    if not isinstance(src, bytes) or not isinstance(dst, bytes):
        raise TypeError(f"addresses are bytes, not {type(src).__name__} and {type(dst).__name__}")
    sp: cython.longlong = _small(sport, 16)
    dp: cython.longlong = _small(dport, 16)
    o.u8(_small(proto, 8))
    if src < dst or (src == dst and sp <= dp):
        o.raw(src)
        o.be16(sp)
        o.raw(dst)
        o.be16(dp)
    else:
        o.raw(dst)
        o.be16(dp)
        o.raw(src)
        o.be16(sp)


def partition_key(export: Export) -> bytes:
    """Direction-independent key: both ends of one connection land on one partition.

    Two exporters that see the same connection (source node and destination node) see the same post-DNAT
    endpoints, so ordering them gives equal keys.
    """
    o = _Out()
    _put_key(o, as_export(export))
    return o.take()


def prepare(
    encode: Encode, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
) -> Failures:
    """Prepare every record not prepared yet: its topic (unless None), then value, key and export time.

    The value is ``framing`` (a registry's header) and the encoded record (by a :class:`RecordEncoder` in
    its own buffer, or by any other ``encode``); the key is the record's partition key. A record whose
    encoding raises keeps no value and comes back with its exception: the caller gives it up.
    """
    failures: Failures = []
    ms: cython.longlong = _long(export_ms)
    if not isinstance(framing, bytes):
        raise TypeError(f"framing is bytes, not {type(framing).__name__}")
    own: RecordEncoder | None = encode if isinstance(encode, RecordEncoder) else None
    o = own._out if own is not None else _Out()
    for x in exports:
        e: Export = as_export(x)
        if e.value is not None:
            continue  # prepared before: a resend is the same bytes
        if topic is not None:
            e.topic = topic
        try:
            if own is not None:
                prefix = own._static(e)  # before the reset: a prefix is written with the same buffer
                o.reset()
                own._put_tail(o, e, ms)
                value = o.take_after(framing, prefix)
            else:
                body = encode(e, export_ms)
                if not isinstance(body, bytes):
                    raise TypeError(f"the encoder returned {type(body).__name__}, not bytes")
                o.reset()
                value = o.take_after(framing, body)
            o.reset()
            _put_key(o, e)
            key = o.take()
        except Exception as exc:
            failures.append((e, exc))
            continue
        e.value = value
        e.export_ms = export_ms
        e.key = key
    return failures
