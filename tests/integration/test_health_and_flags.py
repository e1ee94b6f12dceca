"""The conntrack health stream with flow export off, and counter-fidelity flags, on a real lab and broker.

Ground truth comes from the kernel's own tools in the node namespace: ``conntrack -C`` style
counts (``Lab.conntrack_count``) and ``conntrack -S`` for the per-CPU statistics, with invalid
packets (UDP with a wrong checksum, which conntrack refuses) made on purpose so a statistic moves.
"""

from __future__ import annotations

import io
import re
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import Consumer

from devtools.kafka import KafkaBroker
from devtools.lab import Lab
from flow_exporter.conntrack_health import health_schema
from flow_exporter.flow import COUNTERS_RESET, NO_COUNTERS
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

BAD_CHECKSUM_UDP = """
import socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
for i in range(int(sys.argv[2])):
    payload = b"x" * 10
    s.sendto(struct.pack("!HHHH", 41000 + i, 9999, 8 + len(payload), 0x1234) + payload, (sys.argv[1], 0))
"""


def send_invalid(lab: Lab, count: int) -> None:
    """``count`` UDP packets with a wrong checksum from pod 0 to pod 1 through the node."""
    src, dst = lab.pods[0], lab.pods[1]
    subprocess.run(
        ["ip", "netns", "exec", src.netns, "python3", "-c", BAD_CHECKSUM_UDP, dst.ipv4, str(count)], check=True
    )


def kernel_stats(lab: Lab) -> dict[str, int]:
    """``conntrack -S`` in the node namespace, summed over CPUs."""
    out = subprocess.run(
        ["ip", "netns", "exec", lab.node_ns, "conntrack", "-S"], capture_output=True, text=True, check=True
    ).stdout
    totals: dict[str, int] = {}
    for name, value in re.findall(r"(\w+)=(\d+)", out):
        if name != "cpu":
            totals[name] = totals.get(name, 0) + int(value)
    return totals


def health_records(bootstrap: str, topic: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"h{time.time_ns()}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    out: list[dict[str, Any]] = []
    schema = health_schema()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if out:
                    break
                continue
            assert msg.error() is None, msg.error()
            rec = fastavro.schemaless_reader(io.BytesIO(msg.value()), schema, schema)
            rec["_key"] = msg.key()
            out.append(rec)
    finally:
        consumer.close()
    return out


def test_health_stream_with_flow_export_off(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    flows_topic, health_topic = f"flows-{uuid.uuid4().hex[:8]}", f"health-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(flows_topic)
    kafka_broker.create_topic(health_topic)
    log = tmp_path / "exporter.log"
    with Lab(pods=3) as lab:
        exporter = start_exporter(
            lab, kafka_broker.bootstrap, flows_topic, log,
            "--set", "export.flows=false", "--set", f"health.topic={health_topic}", "--set", "health.interval=1s",
        )  # fmt: skip
        try:
            p0, p1, p2 = lab.pods
            lab.tcp_exchange(p0, p1, 9000, 1000, 2000)
            lab.udp_exchange(p1, p2, 5300, 50, 60, count=2)
            send_invalid(lab, 7)
            time.sleep(3.5)  # the table holds still now (TIME_WAIT, UDP timeouts): two polls and records after
            entries, stats = lab.conntrack_count(), kernel_stats(lab)
            time.sleep(2.5)
        finally:
            stop_exporter(exporter, log)  # sends one last health record
    records = health_records(kafka_broker.bootstrap, health_topic)
    assert len(records) >= 3
    last = records[-1]
    assert {r["_key"] for r in records} == {b"lab-node"} and {r["exporterNode"] for r in records} == {"lab-node"}
    assert last["flowExport"] is False and last["intervalSeconds"] == 1.0
    assert entries == 2 and last["conntrackEntries"] == entries
    assert last["zoneEntries"] == {"0": entries}
    assert last["invalid"] == stats["invalid"] == 7
    for field, stat in (("insertFailed", "insert_failed"), ("drop", "drop"), ("earlyDrop", "early_drop")):
        assert last[field] == stats[stat], field
    assert last["polls"] >= 3 and last["connectionsTracked"] == entries and last["eventLosses"] == 0
    times = [r["time"] for r in records]
    assert times == sorted(times)
    # Flow export off: connections were tracked, nothing went to the flow topic.
    assert read_records(kafka_broker.bootstrap, flows_topic, expect_at_least=0, timeout=3) == []


def test_records_flag_missing_counters_and_counter_resets(kafka_broker: KafkaBroker, tmp_path: Path) -> None:
    """nf_conntrack_acct off: flag 4 (and zeros); on again: no flag; zeroed (conntrack -L -z): flag 2."""
    topic = f"flags-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic)
    log = tmp_path / "exporter.log"
    with Lab(pods=2) as lab:
        acct = "net.netfilter.nf_conntrack_acct"
        lab.run_in(lab.node_ns, "sysctl", "-qw", f"{acct}=0")
        # conntrack.compiled still loads (older configs) and is ignored with a warning: the build is chosen once
        exporter = start_exporter(
            lab, kafka_broker.bootstrap, topic, log, "--set", "conntrack.setSysctls=false",
            "--set", "conntrack.compiled=false",
        )  # fmt: skip
        try:
            p0, p1 = lab.pods
            uncounted = lab.tcp_exchange(p0, p1, 9000, 1000, 2000)
            lab.run_in(lab.node_ns, "sysctl", "-qw", f"{acct}=1")
            counted = lab.open_tcp(p0, p1, 9001)
            counted.send(3000)
            time.sleep(2.5)  # polled with its counters
            lab.run_in(lab.node_ns, "conntrack", "-L", "-z")  # lists, and zeroes every entry's counters
            counted.send(500)
            time.sleep(2.5)
            entries = {e.orig_sport: e for e in lab.conntrack_entries()}
        finally:
            stop_exporter(exporter, log)
        counted.close()
    text = log.read_text()
    assert "build=compiled" in text and "conntrack.compiled: false has no effect" in text, text[-3000:]
    records = read_records(kafka_broker.bootstrap, topic, expect_at_least=3)
    by_port: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        by_port.setdefault(r["sourcePort"], []).append(r)
    no_acct = by_port[uncounted.client_port]
    assert no_acct and all(r["flags"] & NO_COUNTERS for r in no_acct)
    assert all(r["packetTotalCount"] == r["reversePacketTotalCount"] == 0 for r in no_acct)
    assert entries[uncounted.client_port].orig_packets is None  # the kernel kept no counters either
    ids = {}
    for r in by_port[counted.client_port]:
        ids.setdefault(r["connectionId"], []).append(r)
    assert len(ids) == 2  # the reset ended one connectionId and started the next
    (before,) = [recs for recs in ids.values() if not recs[0]["flags"] & COUNTERS_RESET]
    (after,) = [recs for recs in ids.values() if recs[0]["flags"] & COUNTERS_RESET]
    assert all(not r["flags"] & NO_COUNTERS for r in before + after)
    assert all(r["flags"] & COUNTERS_RESET for r in after)
    e = entries[counted.client_port]
    last = max(after, key=lambda r: r["sequence"])
    assert (last["packetTotalCount"], last["octetTotalCount"]) == (e.orig_packets, e.orig_bytes)
