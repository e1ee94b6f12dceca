"""Hand-written Avro encoder for FlowRecord, straight from an Export (no record dict).

Why by hand: fastavro's ``schemaless_writer`` costs ~19 µs per record here (about
52k records/s, bench/bench_export.py), more than everything else on the export
path together. This encoder writes the same bytes (tests/unit/test_encoder.py proves
it against fastavro on generated records) at a fraction of the cost by:

* following the schema's field order, which puts the fields fixed for a
  connection's life first, so that prefix is encoded once per connection and cached
  on the tracked connection (re-encoded only if the ct mark, labels or
  Kubernetes metadata change);
* table lookups for ports, zones and small integers, a cache for addresses;
* one ``b"".join`` per record.

It is tied to ``schemas/flow_record.avsc``: a schema change must change this file
too, and the byte-for-byte test fails until it does.

The export path prepares records a batch at a time (:meth:`RecordEncoder.prepare_all`): with the
compiled module (``flow_exporter/_records.c``) one call writes every record's value and key, and
:meth:`RecordEncoder.static` writes a connection's prefix with ``_prefix.c``; :func:`prepare_each` and
the pure prefix are the same work in Python, the reference the property tests hold the compiled code
to, and the path for any other encoder and for any value the compiled code hands back.
"""

from __future__ import annotations

import hashlib
import socket
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Protocol, cast, runtime_checkable

from flow_exporter.community_id import community_id
from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, TCP_STATE_NAMES
from flow_exporter.flow import Export
from flow_exporter.native import compiled
from flow_exporter.record import K8S_FIELDS, partition_key

Encode = Callable[[Export, int], bytes]
Failures = list[tuple[Export, Exception]]


@runtime_checkable
class BatchEncoder(Protocol):
    """An encoder that also prepares a whole batch in one call (``RecordEncoder``, registry framing)."""

    def __call__(self, export: Export, export_ms: int) -> bytes: ...

    def prepare_all(
        self, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
    ) -> Failures: ...


def prepare_each(
    encode: Encode, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
) -> Failures:
    """Prepare every record not prepared yet: its topic (unless None), then value, key and export time.

    The value is ``framing`` (a registry's header) and the encoded record; the key is the
    record's partition key. A record whose encoding raises keeps no value and comes back with
    its exception: the caller gives it up. This is the reference the compiled
    ``prepare_records`` is held to, one record at a time.
    """
    failures: Failures = []
    for e in exports:
        if e.value is not None:
            continue  # prepared before: a resend is the same bytes
        if topic is not None:
            e.topic = topic
        try:
            value = framing + encode(e, export_ms)
            key = partition_key(e)
        except Exception as exc:
            failures.append((e, exc))
            continue
        e.value = value
        e.export_ms = export_ms
        e.key = key
    return failures


def prepare_with(
    encode: Encode, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
) -> Failures:
    """``encode``'s own batch preparation when it has one, else :func:`prepare_each`."""
    if isinstance(encode, BatchEncoder):
        return encode.prepare_all(exports, export_ms, topic, framing)
    return prepare_each(encode, exports, export_ms, topic, framing)


def zigzag_varint(n: int) -> bytes:
    """Avro ``long``/``int``: zigzag, then little-endian base-128 varint.

    Built from 14-bit table lookups (two varint bytes each) instead of a per-byte
    loop: three times faster for the 4-6 byte values counters and times need.
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


def _zigzag_uncached(n: int) -> bytes:
    return _unsigned_tail((n << 1) ^ (n >> 63))


_SMALL = [bytes([z]) for z in range(0x80)]
_U14 = [_unsigned_tail(z) for z in range(0x4000)]  # every 1- and 2-byte varint
_C14 = [bytes(((z & 0x7F) | 0x80, (z >> 7) | 0x80)) for z in range(0x4000)]  # 14 bits, more to come
# Every port (and zone, and ICMP type<<8|code) value: 65536 entries, ~2 MiB once per process.
_U16 = [_zigzag_uncached(n) for n in range(65536)]
_NULL = b"\x00"  # union branch 0 (null)
_SOME = b"\x02"  # union branch 1
_TCP_STATES = [_SOME + _U16[len(s)] + s.encode() for s in TCP_STATE_NAMES]
_NO_K8S = _NULL * len(K8S_FIELDS) + _U16[0]  # all Kubernetes fields null, flowType 0


def _string(s: str) -> bytes:
    b = s.encode()
    return zigzag_varint(len(b)) + b


@lru_cache(maxsize=65536)
def _address(family: int, packed: bytes) -> bytes:
    return _string(socket.inet_ntop(family, packed))


def _opt_string(s: str | None) -> bytes:
    return _NULL if s is None else _SOME + _string(s)


def _opt_map(m: dict[str, str] | None) -> bytes:
    if m is None:
        return _NULL
    if not m:
        return _SOME + _U16[0]
    parts = [_SOME, zigzag_varint(len(m))]
    for k, v in m.items():
        parts.append(_string(k))
        parts.append(_string(v))
    parts.append(_U16[0])
    return b"".join(parts)


def _k8s(meta: dict[str, Any] | None) -> bytes:
    if not meta:
        return _NO_K8S
    parts = []
    for name in K8S_FIELDS:
        v = meta.get(name)
        parts.append(_opt_map(v) if name.endswith("Labels") else _opt_string(v))
    parts.append(zigzag_varint(meta.get("flowType", 0)))
    return b"".join(parts)


def reporter(node: str, meta: dict[str, Any] | None) -> int:
    """The record's ``reporter``: 1 when the source pod runs on ``node``, plus 2 when the destination pod does."""
    if not meta:
        return 0
    return (1 if meta.get("sourceNodeName") == node else 0) | (2 if meta.get("destinationNodeName") == node else 0)


def _sha1(data: bytes) -> Any:
    """hashlib's SHA-1 for the Community ID, which is not a security use (FIPS builds allow it then)."""
    return hashlib.sha1(data, usedforsecurity=False)


def flow_hash(c: Any, seed: int) -> str:
    """The Community ID of a connection row: source, and the destination reached (after DNAT)."""
    if c.proto in (PROTO_ICMP, PROTO_ICMPV6):
        return community_id(c.proto, c.orig_src, c.reply_src, c.icmp_type, c.icmp_code, seed)
    return community_id(c.proto, c.orig_src, c.reply_src, c.orig_sport, c.reply_sport, seed)


def _snat(family: int, c: Any, icmp: bool) -> tuple[bytes, bytes]:
    """translatedSourceAddress, translatedSourcePort: the reply direction's destination, when it is not the source.

    The reply tuple is where the reply goes: after SNAT (masquerade, an egress address) that is
    the translated source, not the original one. ICMP has no ports: its address only.
    """
    if c.reply_dst == c.orig_src and (icmp or c.reply_dport == c.orig_sport):
        return _NULL, _NULL
    return _SOME + _address(family, c.reply_dst), _NULL if icmp else _SOME + _U16[c.reply_dport]


class RecordEncoder:
    """Encodes exports of one exporter node as bare Avro FlowRecord values."""

    def __init__(self, node: str, community_id_seed: int = 0, cluster: str = "", *, compiled_path: bool = True) -> None:
        self.node = node
        self._native = compiled(compiled_path)
        # exporterNode and clusterName: the same in every record of this exporter
        self._node = _string(node) + (_SOME + _string(cluster) if cluster else _NULL)
        self._seed = community_id_seed
        self._ms: int | None = None  # no batch yet (not -1: that is a valid time, whose bytes are not b"")
        self._ms_bytes = b""
        # What the compiled prefix needs of this encoder (_prefix.c); SHA-1 is hashlib's.
        self._prefix_context = (
            self._node, node, community_id_seed, _sha1,
            tuple((name, name.endswith("Labels")) for name in K8S_FIELDS),
            "flowType", "sourceNodeName", "destinationNodeName",
        )  # fmt: skip

    def static(self, export: Export) -> bytes:
        """The connection-lifetime prefix (connectionId .. reporter), left on ``export``.

        The store keeps it for the connection's next records once this one is delivered
        (store.acknowledge) and drops it when the mark, labels or metadata change.
        """
        if export.prefix is not None:
            return export.prefix
        native = self._native
        prefix = NotImplemented if native is None else native.encode_prefix(export, self._prefix_context)
        if prefix is NotImplemented:
            prefix = self.pure_static(export)
        # The prefix holds all the record needs of the connection's fields: a record in flight does not keep
        # them (~0.5 KB a record; at 1M connections the records of one active timeout go out in a burst).
        export.prefix, export.conn = prefix, None
        return cast(bytes, prefix)

    def pure_static(self, export: Export) -> bytes:
        """:meth:`static` in Python: the reference for ``_prefix.c``, and what encodes any value it hands back."""
        c = export.conn
        assert c is not None, "an export without a prefix carries its connection's fields"
        fam = c.family
        icmp = c.proto in (PROTO_ICMP, PROTO_ICMPV6)
        labels = c.labels
        parts = [
            zigzag_varint(export.flow_id),
            self._node,
            zigzag_varint(export.first_seen_ns // 1_000_000),
            _SMALL[8] if fam == socket.AF_INET else _SMALL[12],  # ipVersion 4 / 6
            _U16[c.proto],
            _address(fam, c.orig_src),
            _U16[c.orig_sport],
            _address(fam, c.reply_src),
            _U16[c.orig_dport if icmp else c.reply_sport],
            _address(fam, c.orig_dst),
            _U16[c.orig_dport],
            *_snat(fam, c, icmp),
            _NULL if not icmp or c.icmp_type is None else _SOME + _U16[c.icmp_type],
            _NULL if not icmp or c.icmp_code is None else _SOME + _U16[c.icmp_code],
            _U16[c.zone],
            zigzag_varint(c.ct_id),
            zigzag_varint(c.mark),
            _NULL if labels is None else _SOME + zigzag_varint(len(labels)) + labels,
            _k8s(export.meta),
            zigzag_varint(export.flags),
            _string(flow_hash(c, self._seed)),  # once per connection: the prefix is cached
            _SMALL[reporter(self.node, export.meta) << 1],
        ]
        prefix = export.prefix = b"".join(parts)
        return prefix

    def __call__(self, export: Export, export_ms: int) -> bytes:
        return self.encode(export, export_ms)

    def prepare_all(
        self, exports: list[Export], export_ms: int, topic: str | None = None, framing: bytes = b""
    ) -> Failures:
        """:func:`prepare_each` with this encoder, in one compiled call when the module is built."""
        native = self._native
        if native is not None:
            failures = native.prepare_records(
                exports, export_ms, self.static, self.encode, partition_key, _TCP_STATES, topic, framing
            )
            if failures is not NotImplemented:
                return cast(Failures, failures)
        return prepare_each(self.encode, exports, export_ms, topic, framing)

    def encode(self, export: Export, export_ms: int) -> bytes:
        t = export.totals
        d = export.deltas
        z = zigzag_varint
        state = export.tcp_state
        key = export.conn_key
        if export_ms != self._ms:  # one export time per batch: encode it once
            self._ms = export_ms
            self._ms_bytes = z(export_ms)
        return b"".join(
            (
                self.static(export),
                z(export.sequence),
                self._ms_bytes,
                z(max(export.flow_end_ns, export.first_seen_ns) // 1_000_000),
                _SMALL[export.reason << 1],
                _TCP_STATES[state]
                if state is not None and key is not None and key[1] == PROTO_TCP and 0 <= state < len(_TCP_STATES)
                else _NULL,
                z(t[0]),
                z(t[1]),
                z(t[2]),
                z(t[3]),
                z(d[0]),
                z(d[1]),
                z(d[2]),
                z(d[3]),
            )
        )
