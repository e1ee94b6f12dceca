"""Consistent sampling on real parts: two node namespaces, three exporters, conntrack as the truth.

Two labs are two nodes linked by a cable (as in test_two_nodes); traffic between their pods passes both
conntrack tables: a few hundred exchanges, and 2,000 short UDP flows from the churn generator. Node A and
node B run exporters with ``sampling.probability`` 1/4 and one seed; a third exporter reads node A's table
with another seed, a fourth with the first seed at 1/16. Expected sets come from ``conntrack -L`` of each node and
the README's rule computed independently (SipHash-2-4 from the ``siphash24`` package, test_sampling's
``kept``), never from the exporter's code.

The checks: each exporter reports exactly the connections the rule keeps from its table, each with the
kernel's counters and ``samplingProbability`` 0.25 in every record; nodes A and B keep the same inter-node
connections (the agreement the cross-node rule needs); the other seed keeps another set; the health stream's
final record counts every connection met (observed) and the kept ones (selected) exactly. The estimate of
node A's bytes from each sample (sum of bytes / p) is printed beside conntrack's total, with its standard error.
"""

from __future__ import annotations

import math
import subprocess
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from devtools.churn import build_churn
from devtools.kafka import KafkaBroker
from devtools.lab import CtEntry, Lab
from flow_exporter.conntrack_health import health_schema
from tests.support.downstream import ct_connection
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import read_records, read_until_quiet
from tests.unit.test_sampling import kept

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

SEED, OTHER_SEED = "cluster-seed", "another-seed"
FLOWS, RATE = 2000, 1000  # the churn generator's: 2 s of short UDP flows between the nodes
Conn = tuple[int, str, int, str, int]


def read_health(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    return [h for _, _, h in read_until_quiet(bootstrap, topic, health_schema())]


def rule(seed: str, p: float, e: CtEntry) -> bool:
    proto, src, sport, dst, dport = ct_connection(e)
    if proto in (1, 58):  # ICMP: the echo identifier on both ends
        sport = dport = int(e.orig_extra["id"])
    return kept(seed, p, 6 if ":" in src else 4, proto, src, sport, dst, dport)


def churn(lab_a: Lab, lab_b: Lab, work: Path) -> int:
    """FLOWS short UDP flows from node A's first pod to node B's: how many were sent (one conntrack entry each)."""
    tool = build_churn()
    (a0, _), (b0, _) = lab_a.pods, lab_b.pods
    server = subprocess.Popen(["ip", "netns", "exec", b0.netns, str(tool), "server", b0.ipv4, "6000", "1"])
    try:
        time.sleep(0.5)  # bound before the first datagram (an unanswered flow is still a conntrack entry)
        out = subprocess.run(
            ["ip", "netns", "exec", a0.netns, str(tool), "client", a0.ipv4, b0.ipv4, "6000", "1", str(RATE),
             str(FLOWS / RATE), "20000", "59999", str(work / "churn-status")],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(10)
    return int(out.stdout.split()[0])


def test_two_nodes_with_one_seed_keep_the_same_connections(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    topic, health = f"sampled-{uuid.uuid4().hex[:8]}", f"sampled-health-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=2)
    kafka_broker.create_topic(health, partitions=1)
    runs = {
        "node-a": ("a", SEED, 0.25), "node-b": ("b", SEED, 0.25), "node-a2": ("a", OTHER_SEED, 0.25),
        "node-a16": ("a", SEED, 1 / 16),
    }  # fmt: skip
    with Lab("sampa", pods=2) as lab_a, Lab("sampb", pods=2) as lab_b:
        lab_a.link(lab_b)
        labs = {"a": lab_a, "b": lab_b}
        procs = {}
        try:
            for node, (lab, seed, p) in runs.items():
                log = tmp_path / f"{node}.log"
                procs[node] = (
                    start_exporter(
                        labs[lab], kafka_broker.bootstrap, topic, log, "--node-name", node,
                        "--set", f"sampling.probability={p}", "--set", f"sampling.seed={seed}",
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
            flows = churn(lab_a, lab_b, tmp_path)
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
        assert r["samplingProbability"] == runs[r["exporterNode"]][2]
        conn = (r["protocol"], r["sourceAddress"], r["sourcePort"], r["destinationAddress"], r["destinationPort"])
        reported[r["exporterNode"]][conn] = r
        ids[r["exporterNode"]].add(r["connectionId"])
    inter = {ct_connection(e) for e in tables["a"]} & {ct_connection(e) for e in tables["b"]}
    assert len(inter) == 88 + flows, len(inter)  # 40 + 40 UDP, 8 TCP, the churn's
    kept_sets = {}
    for node, (lab, seed, p) in runs.items():
        entries = {ct_connection(e): e for e in tables[lab]}
        want = {c for c, e in entries.items() if rule(seed, p, e)}
        assert 0 < len(want) < len(entries)
        assert set(reported[node]) == want, node
        for c in want:  # every kept connection with the kernel's counters
            e, r = entries[c], reported[node][c]
            assert (r["packetTotalCount"], r["octetTotalCount"]) == (e.orig_packets, e.orig_bytes), e.raw
            assert (r["reversePacketTotalCount"], r["reverseOctetTotalCount"]) == (e.reply_packets, e.reply_bytes)
        (last,) = [h for h in health_records if h["exporterNode"] == node and h["time"] == max(
            x["time"] for x in health_records if x["exporterNode"] == node)]  # fmt: skip
        assert last["samplingProbability"] == p
        assert last["connectionsSelected"] == len(ids[node]) == len(want)
        assert last["connectionsObserved"] == len(entries)
        kept_sets[node] = want

        def octets(r: dict[str, Any]) -> int:
            return int(r["octetTotalCount"] + r["reverseOctetTotalCount"])

        truth = sum((e.orig_bytes or 0) + (e.reply_bytes or 0) for e in entries.values())
        estimate = sum(octets(r) / p for r in reported[node].values())
        se = math.sqrt(sum((1 - p) / p**2 * octets(r) ** 2 for r in reported[node].values()))
        error = f"{(estimate - truth) / truth:+.2%}), standard error {se:,.0f} ({se / truth:.2%})"
        print(f"{node} p={p}: kept {len(want)}/{len(entries)}; bytes {estimate:,.0f} estimated, {truth:,} in "
              f"conntrack ({error}")  # fmt: skip
    assert kept_sets["node-a"] & inter == kept_sets["node-b"] & inter  # one choice on both nodes
    assert kept_sets["node-a2"] != kept_sets["node-a"]  # another seed, another sample
    assert kept_sets["node-a16"] < kept_sets["node-a"]  # the same seed: 1/16's sample is inside 1/4's
    a, b, other = (kept_sets[n] & inter for n in ("node-a", "node-b", "node-a2"))
    print(
        f"kept of {len(inter)} inter-node connections: node A's exporter {len(a)}, node B's {len(b)}, "
        f"both {len(a & b)}; the other seed {len(other)}, {len(other & a)} of them also in the first seed's"
    )
