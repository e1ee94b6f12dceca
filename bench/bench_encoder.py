"""Encode cost of one fully enriched record: a connection's first (its cached prefix built) and a later one.

    .venv/bin/python -m bench.bench_encoder [--records 20000] [--rounds 7]

Every Kubernetes field is filled (a Service connection between two Deployments' pods in two zones,
cluster name set), so the figure is the largest record the exporter writes. To compare two versions,
run it from each checkout (``PYTHONPATH=<checkout>``) in turn, interleaved, on the same machine.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from typing import Any

from flow_exporter.connection import PROTO_TCP, Connection
from flow_exporter.flow import Export
from flow_exporter.record import META_FIELDS
from flow_exporter.sink.encoder import RecordEncoder

FILLED: dict[str, Any] = {
    "sourcePodName": "client-7d9f5c6b8-abcde",
    "sourcePodNamespace": "shop",
    "sourceNodeName": "node-a",
    "sourcePodLabels": {"app": "client"},
    "destinationPodName": "web-59b6f8d7c-xy2z1",
    "destinationPodNamespace": "shop",
    "destinationNodeName": "node-b",
    "destinationPodLabels": {"app": "web"},
    "destinationServicePortName": "shop/web:http",
    "destinationService": "shop/web:80/TCP",
    "sourceZone": "eu-west-1a",
    "destinationZone": "eu-west-1b",
    "sourceNodeAddress": "192.0.2.1",
    "destinationNodeAddress": "192.0.2.2",
    "sourceOwnerKind": "Deployment",
    "sourceOwnerName": "client",
    "destinationOwnerKind": "Deployment",
    "destinationOwnerName": "web",
}


def connection(i: int) -> Connection:
    client = bytes([10, 1, i >> 8 & 255, i & 255])
    return Connection(
        family=socket.AF_INET, proto=PROTO_TCP, orig_src=client, orig_dst=bytes([10, 96, 0, 10]),
        orig_sport=40000 + i % 20000, orig_dport=80, reply_src=bytes([10, 2, 0, 5]), reply_dst=client,
        reply_sport=8080, reply_dport=40000 + i % 20000, zone=0, ct_id=i, mark=0, labels=None, status=0x18E,
        tcp_state=3, orig_packets=10, orig_bytes=1000, reply_packets=9, reply_bytes=9000, start_ns=1, stop_ns=0,
        icmp_type=None, icmp_code=None, icmp_id=None,
    )  # fmt: skip


def export(i: int, meta: dict[str, Any]) -> Export:
    return Export(
        reason=2, sequence=1, totals=(10, 1000, 9, 9000), deltas=(1, 100, 1, 900), final=False,
        flow_end_ns=2 * 10**18, first_seen_ns=10**18, conn=connection(i), flow_id=i * 7919, meta=meta,
        conn_key=(None, PROTO_TCP),  # type: ignore[arg-type]  (only its protocol is read)
    )  # fmt: skip


def exports(n: int) -> list[Export]:
    meta = {k: FILLED.get(k) for k in META_FIELDS} | {"flowType": 2}
    return [export(i, meta) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    try:
        enc = RecordEncoder("node-a", 0, "prod-eu-1")  # type: ignore[call-arg]
    except TypeError:  # a version without clusterName
        enc = RecordEncoder("node-a", 0)
    first, later, size = [], [], 0
    for _ in range(args.rounds):
        batch = exports(args.records)
        t = time.perf_counter()
        out = [enc.encode(e, 1_733_300_000_000) for e in batch]
        first.append((time.perf_counter() - t) / args.records * 1e6)
        t = time.perf_counter()
        out = [enc.encode(e, 1_733_300_000_001) for e in batch]
        later.append((time.perf_counter() - t) / args.records * 1e6)
        size = len(out[0])
    print(
        f"first record {statistics.median(first):.2f} us, later record {statistics.median(later):.2f} us "
        f"(medians of {args.rounds} rounds of {args.records:,}); {size} bytes"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
