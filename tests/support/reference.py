"""The reference encoding the hand-written encoder is tested against: a record dict, then fastavro.

Test-only: the exporter encodes with :mod:`flow_exporter.sink.encoder` (a benchmark showed the
generic path too slow). This builds the same record the plain way, field by field from an
:class:`~flow_exporter.flow.Export`, and serializes it with fastavro's schemaless writer, so
the two can be compared byte for byte.
"""

from __future__ import annotations

import io
import socket
from functools import lru_cache
from typing import Any

import fastavro

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, TCP_STATE_NAMES
from flow_exporter.flow import Export
from flow_exporter.record import META_FIELDS, load_schema


@lru_cache(maxsize=65536)
def _ip(family: int, packed: bytes) -> str:
    # Cached: the same few thousand addresses recur in every poll.
    return socket.inet_ntop(family, packed)


def build_record(
    export: Export,
    node: str,
    export_ms: int,
    cluster: str = "",
    attributes: dict[str, str] | None = None,
    sampling_probability: float = 1.0,
) -> dict[str, Any]:
    """The record dict for one export (what the Avro writer serializes)."""
    c = export.conn
    assert c is not None, "a connection's first record carries its fields"
    fam = c.family
    icmp = c.proto in (PROTO_ICMP, PROTO_ICMPV6)
    tcp_state = None
    state = export.tcp_state
    if c.proto == PROTO_TCP and state is not None and 0 <= state < len(TCP_STATE_NAMES):
        tcp_state = TCP_STATE_NAMES[state]
    totals = export.totals
    deltas = export.deltas
    snat = (c.reply_dst, None if icmp else c.reply_dport) != (c.orig_src, None if icmp else c.orig_sport)
    rec: dict[str, Any] = {
        "connectionId": export.flow_id,
        "sequence": export.sequence,
        "exporterNode": node,
        "clusterName": cluster or None,
        "exportTime": export_ms,
        "flowStart": export.first_seen_ns // 1_000_000,
        "flowEnd": max(export.flow_end_ns, export.first_seen_ns) // 1_000_000,
        "flowEndReason": export.reason,
        "ipVersion": 4 if fam == socket.AF_INET else 6,
        "protocol": c.proto,
        "sourceAddress": _ip(fam, c.orig_src),
        "sourcePort": c.orig_sport,
        "destinationAddress": _ip(fam, c.reply_src),
        "destinationPort": c.orig_dport if icmp else c.reply_sport,
        "originalDestinationAddress": _ip(fam, c.orig_dst),
        "originalDestinationPort": c.orig_dport,
        # Source NAT: the reply goes to the translated source (an independent restatement of the rule).
        "translatedSourceAddress": None if not snat else _ip(fam, c.reply_dst),
        "translatedSourcePort": None if not snat or icmp else c.reply_dport,
        "icmpType": c.icmp_type if icmp else None,
        "icmpCode": c.icmp_code if icmp else None,
        "zone": c.zone,
        "tcpState": tcp_state,
        "ctMark": c.mark,
        "ctLabels": c.labels,
        "ctId": c.ct_id,
        "packetTotalCount": totals[0],
        "octetTotalCount": totals[1],
        "reversePacketTotalCount": totals[2],
        "reverseOctetTotalCount": totals[3],
        "packetDeltaCount": deltas[0],
        "octetDeltaCount": deltas[1],
        "reversePacketDeltaCount": deltas[2],
        "reverseOctetDeltaCount": deltas[3],
        "attributes": dict(attributes or {}),
        "samplingProbability": sampling_probability,
        "flowType": 0,
        "flags": export.flags,
        "communityId": _community_id(fam, c),
        "reporter": 0,
    }
    meta = export.meta
    for name in META_FIELDS:
        rec[name] = meta.get(name) if meta else None
    if meta:
        rec["flowType"] = meta.get("flowType", 0)
        rec["reporter"] = (meta.get("sourceNodeName") == node) + 2 * (meta.get("destinationNodeName") == node)
    return rec


def _community_id(fam: int, c: Any) -> str:
    """The Community ID from Corelight's ``communityid`` package (not the exporter's own code)."""
    import communityid

    src, dst = _ip(fam, c.orig_src), _ip(fam, c.reply_src)
    if c.proto == 1:
        tpl = communityid.FlowTuple.make_icmp(src, dst, c.icmp_type, c.icmp_code)
    elif c.proto == 58:
        tpl = communityid.FlowTuple.make_icmp6(src, dst, c.icmp_type, c.icmp_code)
    elif c.proto in (6, 17, 132):
        tpl = communityid.FlowTuple(c.proto, src, dst, c.orig_sport, c.reply_sport)
    else:
        tpl = communityid.FlowTuple(c.proto, src, dst)
    return communityid.CommunityID(0).calc(tpl)


class AvroSerializer:
    """Encodes one record dict to bare Avro binary (no header, no schema id), and decodes it back."""

    def __init__(self, schema: dict[str, Any] | None = None) -> None:
        self.schema = fastavro.parse_schema(schema or load_schema())
        self._buf = io.BytesIO()

    def __call__(self, record: dict[str, Any]) -> bytes:
        buf = self._buf
        buf.seek(0)
        buf.truncate()
        fastavro.schemaless_writer(buf, self.schema, record)
        return buf.getvalue()

    def decode(self, data: bytes) -> dict[str, Any]:
        return fastavro.schemaless_reader(io.BytesIO(data), self.schema, self.schema)
