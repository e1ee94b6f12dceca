"""Flow records: an :class:`~flow_exporter.store.Export` turned into the Avro record's fields.

Field names and meanings are the contract in ``schemas/flow_record.avsc``.
"""

from __future__ import annotations

import json
import socket
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, TCP_STATE_NAMES
from flow_exporter.flow import Export

SCHEMA_FILE = "flow_record.avsc"

# Keys of the Kubernetes fields the enrichment fills; null until then.
K8S_FIELDS = (
    "sourcePodName",
    "sourcePodNamespace",
    "sourceNodeName",
    "sourcePodLabels",
    "destinationPodName",
    "destinationPodNamespace",
    "destinationNodeName",
    "destinationPodLabels",
    "destinationServicePortName",
    "destinationService",
)


def schema_path() -> Path:
    """The schema file, as package data (in a checkout, ``flow_exporter/schemas`` links to ``schemas/``)."""
    return Path(str(resources.files("flow_exporter") / "schemas" / SCHEMA_FILE))


@lru_cache(maxsize=1)
def load_schema() -> dict[str, Any]:
    return json.loads(schema_path().read_text())


@lru_cache(maxsize=65536)
def _ip(family: int, packed: bytes) -> str:
    # Cached: the same few thousand addresses recur in every poll.
    return socket.inet_ntop(family, packed)


def build_record(export: Export, node: str, export_ms: int) -> dict[str, Any]:
    """The record dict for one export (what the Avro writer serializes)."""
    tr = export.tracked
    c = tr.conn
    fam = c.family
    icmp = c.proto in (PROTO_ICMP, PROTO_ICMPV6)
    tcp_state = None
    if c.proto == PROTO_TCP and c.tcp_state is not None and 0 <= c.tcp_state < len(TCP_STATE_NAMES):
        tcp_state = TCP_STATE_NAMES[c.tcp_state]
    totals = export.totals
    deltas = export.deltas
    rec: dict[str, Any] = {
        "connectionId": export.flow_id,
        "sequence": export.sequence,
        "exporterNode": node,
        "exportTime": export_ms,
        "flowStart": tr.first_seen_ns // 1_000_000,
        "flowEnd": max(export.flow_end_ns, tr.first_seen_ns) // 1_000_000,
        "flowEndReason": export.reason,
        "ipVersion": 4 if fam == socket.AF_INET else 6,
        "protocol": c.proto,
        "sourceAddress": _ip(fam, c.orig_src),
        "sourcePort": c.orig_sport,
        "destinationAddress": _ip(fam, c.reply_src),
        "destinationPort": c.orig_dport if icmp else c.reply_sport,
        "originalDestinationAddress": _ip(fam, c.orig_dst),
        "originalDestinationPort": c.orig_dport,
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
        "flowType": 0,
        "flags": tr.flags,
    }
    meta = tr.meta
    for name in K8S_FIELDS:
        rec[name] = meta.get(name) if meta else None
    if meta:
        rec["flowType"] = meta.get("flowType", 0)
    return rec


def partition_key(export: Export) -> bytes:
    """Direction-independent key: both ends of one connection land on one partition.

    Two exporters that see the same connection (source node and destination
    node) see the same post-DNAT endpoints, so sorting them gives equal keys.
    """
    _zone, proto, src, sport, dst, dport = export.tracked.key
    a = (src, sport)
    b = (dst, dport)
    lo, hi = (a, b) if a <= b else (b, a)
    return bytes((proto,)) + lo[0] + lo[1].to_bytes(2, "big") + hi[0] + hi[1].to_bytes(2, "big")
