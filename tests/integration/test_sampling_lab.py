"""Consistent sampling on real parts: two node namespaces, three exporters, conntrack as the truth.

Two labs are two nodes linked by a cable (as in test_two_nodes); traffic between their pods passes both
conntrack tables. Node A and node B run exporters with ``sampling.probability`` 1/4 and one seed; a third
exporter reads node A's table with another seed. Expected sets come from ``conntrack -L`` of each node and
the README's rule computed independently (SipHash-2-4 from the ``siphash24`` package, test_sampling's
``kept``), never from the exporter's code.

The checks: each exporter reports exactly the connections the rule keeps from its table, each with the
kernel's counters and ``samplingProbability`` 0.25 in every record; nodes A and B keep the same inter-node
connections (the agreement the cross-node rule needs); the other seed keeps another set; the health stream's
final record counts every connection met (observed) and the kept ones (selected) exactly.
"""

from __future__ import annotations

import io
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import Consumer

from devtools.kafka import KafkaBroker
from devtools.lab import CtEntry, Lab
from flow_exporter.conntrack_health import health_schema
from tests.support.downstream import ct_connection
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import read_records
from tests.unit.test_sampling import kept

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

P = 0.25
SEED, OTHER_SEED = "cluster-seed", "another-seed"
Conn = tuple[int, str, int, str, int]


def read_health(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"h{time.time_ns()}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    schema = health_schema()
    out: list[dict[str, Any]] = []
    idle = time.monotonic() + 20
    try:
        while time.monotonic() - idle < 3:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append(fastavro.schemaless_reader(io.BytesIO(msg.value()), schema, schema))
            idle = time.monotonic()
    finally:
        consumer.close()
    return out


def rule(seed: str, e: CtEntry) -> bool:
    proto, src, sport, dst, dport = ct_connection(e)
    if proto in (1, 58):  # ICMP: the echo identifier on both ends
        sport = dport = int(e.orig_extra["id"])
    return kept(seed, P, 6 if ":" in src else 4, proto, src, sport, dst, dport)


def test_two_nodes_with_one_seed_keep_the_same_connections(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    topic, health = f"sampled-{uuid.uuid4().hex[:8]}", f"sampled-health-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=2)
    kafka_broker.create_topic(health, partitions=1)
    runs = {"node-a": ("a", SEED), "node-b": ("b", SEED), "node-a2": ("a", OTHER_SEED)}
    with Lab("sampa", pods=2) as lab_a, Lab("sampb", pods=2) as lab_b:
        lab_a.link(lab_b)
        labs = {"a": lab_a, "b": lab_b}
        procs = {}
        try:
            for node, (lab, seed) in runs.items():
                log = tmp_path / f"{node}.log"
                procs[node] = (
                    start_exporter(
                        labs[lab], kafka_broker.bootstrap, topic, log, "--node-name", node,
                        "--set", "sampling.probability=1/4", "--set", f"sampling.seed={seed}",
                        "--set", f"health.topic={health}", "--set", "health.interval=60s",
                    ),
                    log,
                )  # fmt: skip
            (a0, a1), (b0, b1) = lab_a.pods, lab_b.pods
            for i in range(40):  # between nodes both ways, IPv4 and IPv6; and within node A
                lab_a.udp_exchange(a0, b0, 5300, 10 + i, 20)
                lab_b.udp_exchange(b1, a1, 5301, 30, 5 + i, family=6)
                lab_a.udp_exchange(a0, a1, 5302, 7, 9)
            for i in range(8):
                lab_a.tcp_exchange(a1, b1, 9000, 100 * i, 300)
            time.sleep(2.5)  # a poll after the last packet
            tables = {lab: list(labs[lab].conntrack_entries()) for lab in labs}
        finally:
            for proc, log in procs.values():
                if proc.poll() is None:
                    stop_exporter(proc, log)
        for _, log in procs.values():
            assert "Traceback" not in log.read_text()

    records = read_records(kafka_broker.bootstrap, topic, expect_at_least=30)
    health_records = read_health(kafka_broker.bootstrap, health)
    reported: dict[str, dict[Conn, dict[str, Any]]] = defaultdict(dict)  # node -> connection -> last record
    ids: dict[str, set[int]] = defaultdict(set)
    for r in sorted(records, key=lambda r: r["sequence"]):
        assert r["samplingProbability"] == P
        conn = (r["protocol"], r["sourceAddress"], r["sourcePort"], r["destinationAddress"], r["destinationPort"])
        reported[r["exporterNode"]][conn] = r
        ids[r["exporterNode"]].add(r["connectionId"])
    inter = {ct_connection(e) for e in tables["a"]} & {ct_connection(e) for e in tables["b"]}
    assert len(inter) == 88, len(inter)  # 40 + 40 UDP, 8 TCP
    kept_sets = {}
    for node, (lab, seed) in runs.items():
        entries = {ct_connection(e): e for e in tables[lab]}
        want = {c for c, e in entries.items() if rule(seed, e)}
        assert 0 < len(want) < len(entries)
        assert set(reported[node]) == want, node
        for c in want:  # every kept connection with the kernel's counters
            e, r = entries[c], reported[node][c]
            assert (r["packetTotalCount"], r["octetTotalCount"]) == (e.orig_packets, e.orig_bytes), e.raw
            assert (r["reversePacketTotalCount"], r["reverseOctetTotalCount"]) == (e.reply_packets, e.reply_bytes)
        (last,) = [h for h in health_records if h["exporterNode"] == node and h["time"] == max(
            x["time"] for x in health_records if x["exporterNode"] == node)]  # fmt: skip
        assert last["samplingProbability"] == P
        assert last["connectionsSelected"] == len(ids[node]) == len(want)
        assert last["connectionsObserved"] == len(entries)
        kept_sets[node] = want
    assert kept_sets["node-a"] & inter == kept_sets["node-b"] & inter  # one choice on both nodes
    assert kept_sets["node-a2"] != kept_sets["node-a"]  # another seed, another sample
    print(
        f"kept of {len(inter)} inter-node connections: {len(kept_sets['node-a'] & inter)} on both nodes; "
        f"node A {len(kept_sets['node-a'])}/{len(tables['a'])}, other seed {len(kept_sets['node-a2'])}"
    )
