"""The exporter end to end on real parts: lab traffic -> kernel conntrack -> exporter -> real broker.

Records are decoded with the reference Apache ``avro`` package (not fastavro, which
the exporter writes with), and checked against what ``conntrack -L`` reported.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import avro.io
import avro.schema
import pytest
from confluent_kafka import Consumer

from devtools.lab import CtEntry, Lab
from flow_exporter.record import schema_path

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

ACTIVE, IDLE, END, FORCED = 2, 1, 3, 4


def read_records(bootstrap: str, topic: str, expect_at_least: int = 1, timeout: float = 30.0) -> list[dict]:
    """Every record on the topic, decoded with the reference avro implementation."""
    schema = avro.schema.parse(schema_path().read_text())
    reader = avro.io.DatumReader(schema)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"t-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    out: list[dict] = []
    deadline = time.monotonic() + timeout
    idle_since = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if len(out) >= expect_at_least:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > 3:
                        break
                continue
            idle_since = None
            assert msg.error() is None, msg.error()
            out.append(reader.read(avro.io.BinaryDecoder(io.BytesIO(msg.value()))))
    finally:
        consumer.close()
    return out


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(pods=3) as lab:
        yield lab


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert m, f"{name} missing"
    return float(m.group(1))


def start_exporter(
    lab: Lab, bootstrap: str, topic: str, log: Path, *extra: str, metrics_port: int = 0
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "flow_exporter",
        "run",
        "--netns",
        lab.node_ns,
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--node-name",
        "lab-node",
        "--set",
        "conntrack.pollInterval=1s",
        "--set",
        "expiry.activeTimeout=2s",
        "--set",
        "expiry.idleTimeout=4s",
        "--set",
        "shutdown.grace=15s",
        "--set",
        f"metrics.port={metrics_port}",
        "--set",
        "metrics.address=127.0.0.1",
        *extra,
    ]
    fh = log.open("wb")
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 20
    while "first poll" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return proc


def stop_exporter(proc: subprocess.Popen[bytes], log: Path, grace: float = 15.0) -> str:
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=grace + 5)
    text = log.read_text()
    assert rc == 0, text
    assert time.monotonic() - t0 <= grace, text
    return text


def by_connection(records: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["connectionId"]].append(r)
    for recs in groups.values():
        recs.sort(key=lambda r: r["sequence"])
    return groups


def records_of(groups: dict[int, list[dict]], src: str, sport: int, proto: int) -> list[dict]:
    hits = [
        recs
        for recs in groups.values()
        if recs[0]["sourceAddress"] == src and recs[0]["sourcePort"] == sport and recs[0]["protocol"] == proto
    ]
    assert len(hits) == 1, f"{len(hits)} connections from {src}:{sport}/{proto}"
    return hits[0]


def assert_consistent(recs: list[dict], ct: CtEntry) -> None:
    """Totals equal conntrack -L, deltas sum to the totals, sequence numbers have no gaps."""
    assert [r["sequence"] for r in recs] == list(range(len(recs)))
    last = recs[-1]
    assert (
        last["packetTotalCount"],
        last["octetTotalCount"],
        last["reversePacketTotalCount"],
        last["reverseOctetTotalCount"],
    ) == (ct.orig_packets, ct.orig_bytes, ct.reply_packets, ct.reply_bytes), json.dumps(last, default=str)
    for total, delta in (
        ("packetTotalCount", "packetDeltaCount"),
        ("octetTotalCount", "octetDeltaCount"),
        ("reversePacketTotalCount", "reversePacketDeltaCount"),
        ("reverseOctetTotalCount", "reverseOctetDeltaCount"),
    ):
        assert sum(r[delta] for r in recs) == last[total], delta
        assert all(r[delta] >= 0 for r in recs)
    assert last["flowEndReason"] in (END, FORCED)


def test_lab_traffic_reaches_kafka_with_exact_counters(
    lab: Lab, kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    p1, p2, p3 = lab.pods
    svc = lab.add_service(lab.vip4(), 80, p3, 8080, vip6=lab.vip6())
    log = tmp_path / "exporter.log"
    port = free_port()
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log, metrics_port=port)
    try:
        long_conn = lab.open_tcp(p1, p3, 7000)
        tcp4 = lab.tcp_exchange(p1, p2, 9000, 1000, 5000, family=4)
        tcp6 = lab.tcp_exchange(p2, p1, 9001, 3000, 700, family=6)
        udp4 = lab.udp_exchange(p2, p3, 5300, 100, 400, family=4, count=3)
        udp6 = lab.udp_exchange(p3, p1, 5301, 60, 1200, family=6)
        via_svc = lab.tcp_exchange(p2, svc, 80, 200, 20_000, family=4)
        for _ in range(8):  # ~8 s of activity: several active-timeout records
            long_conn.send(1500)
            time.sleep(1)
        time.sleep(6)  # > idle timeout for the UDP flows, and end-of-flow for the closed ones
        assert scrape(port, "/healthz") == (200, "ok\n")
        assert scrape(port, "/readyz") == (200, "ok\n")
        code, text = scrape(port, "/metrics")
        assert code == 200
        assert metric(text, "flow_exporter_connections_tracked") >= 6
        assert metric(text, "flow_exporter_conntrack_entries") >= 6
        assert metric(text, "flow_exporter_conntrack_max") > 0
        assert metric(text, "flow_exporter_records_acknowledged") >= 6
        assert metric(text, "flow_exporter_records_failed") == 0
        assert metric(text, "flow_exporter_bytes_produced") > 0
        assert metric(text, "flow_exporter_poll_duration_seconds_count") >= 5
        table = lab.conntrack_entries()
        cts = {
            name: table.for_exchange(ex)
            for name, ex in [("tcp4", tcp4), ("tcp6", tcp6), ("udp4", udp4), ("udp6", udp6), ("svc", via_svc)]
        }
        ct_long = table.for_exchange(long_conn)
        text = stop_exporter(proc, log)  # long_conn still open: it gets a forced final record
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in text
    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=6)
    groups = by_connection(records)

    for name, ex in [("tcp4", tcp4), ("tcp6", tcp6), ("udp4", udp4), ("udp6", udp6), ("svc", via_svc)]:
        ct = cts[name]
        assert ct is not None, name
        recs = records_of(groups, ex.client_ip, ex.client_port, 6 if ex.proto == "tcp" else 17)
        assert_consistent(recs, ct)
        assert recs[0]["exporterNode"] == "lab-node"
        assert recs[0]["ipVersion"] == ex.family
        reasons = [r["flowEndReason"] for r in recs]
        if ex.proto == "tcp":
            assert reasons[-1] == END, (name, reasons)
            assert recs[-1]["tcpState"] in ("TIME_WAIT", "CLOSE")
        else:
            assert IDLE in reasons, (name, reasons)
            assert recs[-1]["tcpState"] is None

    svc_last = records_of(groups, via_svc.client_ip, via_svc.client_port, 6)[-1]
    assert svc_last["originalDestinationAddress"] == svc.vip4 and svc_last["originalDestinationPort"] == 80
    assert svc_last["destinationAddress"] == p3.ipv4 and svc_last["destinationPort"] == 8080
    plain = records_of(groups, tcp4.client_ip, tcp4.client_port, 6)[-1]
    assert plain["originalDestinationAddress"] == plain["destinationAddress"] == p2.ipv4

    long_recs = records_of(groups, long_conn.client_ip, long_conn.client_port, 6)
    reasons = [r["flowEndReason"] for r in long_recs]
    assert reasons.count(ACTIVE) >= 2 and reasons[-1] == FORCED, reasons
    assert ct_long is not None
    assert [r["sequence"] for r in long_recs] == list(range(len(long_recs)))
    for f in ("packetTotalCount", "octetTotalCount"):
        assert sum(r[f.replace("Total", "Delta")] for r in long_recs) == long_recs[-1][f]
        assert long_recs[-1][f] >= getattr(ct_long, "orig_packets" if "packet" in f else "orig_bytes")
    long_conn.close()

    # Every connection the exporter tracked got a final record before it exited.
    for recs in groups.values():
        assert recs[-1]["flowEndReason"] in (END, FORCED), recs[-1]
