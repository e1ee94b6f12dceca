"""The downstream Spark job end to end: lab traffic -> exporter -> real broker -> Spark -> Parquet.

One scenario, one topic, one Spark run per counting mode (the JVM start dominates), checked by
three tests:

* plain: connections that one exporter process saw from start to end;
* restart: connections alive across exporter restarts with a state directory (SIGKILL mid-way,
  start, SIGTERM, start), which the restarted processes continue at their next sequence; a
  connection also starts and ends while no exporter runs;
* Kubernetes names and windows.

The conntrack table is flushed between the two phases, so the restarted exporter does not see
the plain phase's connections. Both cases must give, per (source, destination), the packet and
byte totals ``conntrack -L`` reported just before the exporter stopped. A few synthetic records
check the Kubernetes-name mapping, and a last one, an hour ahead, moves the watermark past
every window so that an available-now run emits them all. The last test checks the job's
per-connection arithmetic alone, without Spark.
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import Producer

from devtools.kafka import KafkaBroker
from devtools.lab import CtEntry, CtTable, Lab
from downstream.spark_flows import HighWater
from flow_exporter.record import schema_path
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.paths import REPO
from tests.support.records import read_records

pytestmark = pytest.mark.spark

JOB = REPO / "downstream" / "spark_flows.py"
WINDOW_S = 10
# Short-run JVM flags: C1 only and the serial GC roughly halve this run's CPU on two cores.
SPARK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

Group = tuple[str, str]
Counts = tuple[int, int]  # packets, bytes; both directions


def endpoint(addr: str, port: int | None) -> str:
    ip = ipaddress.ip_address(addr)
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def ct_group(e: CtEntry) -> Group:
    """The job's (source, destination) for a conntrack entry: no pod names, so addresses."""
    return str(ipaddress.ip_address(e.orig_src)), endpoint(e.reply_src, e.reply_sport)


def ct_totals(entries: Iterable[CtEntry]) -> dict[Group, Counts]:
    out: dict[Group, Counts] = defaultdict(lambda: (0, 0))
    for e in entries:
        assert e.orig_packets is not None and e.reply_packets is not None, e.raw  # accounting is on
        assert e.orig_bytes is not None and e.reply_bytes is not None, e.raw
        p, b = out[ct_group(e)]
        out[ct_group(e)] = (p + e.orig_packets + e.reply_packets, b + e.orig_bytes + e.reply_bytes)
    return dict(out)


def record_group(r: dict[str, Any]) -> Group:
    return r["sourceAddress"], endpoint(r["destinationAddress"], r["destinationPort"])


def readme_rule(records: list[dict[str, Any]]) -> dict[Group, Counts]:
    """The README's consumer rule: drop duplicates by (connectionId, sequence), sum the deltas."""
    seen: set[tuple[int, int]] = set()
    out: dict[Group, Counts] = defaultdict(lambda: (0, 0))
    for r in records:
        if (r["connectionId"], r["sequence"]) in seen:
            continue
        seen.add((r["connectionId"], r["sequence"]))
        p, b = out[record_group(r)]
        out[record_group(r)] = (
            p + r["packetDeltaCount"] + r["reversePacketDeltaCount"],
            b + r["octetDeltaCount"] + r["reverseOctetDeltaCount"],
        )
    return dict(out)


# --------------------------------------------------------------------------- synthetic records

K8S_GROUPS: dict[Group, Counts] = {
    # destinationService wins over the destination pod; pod names win over addresses.
    ("shop/web-0", "shop/cart:80/TCP"): (7 + 5, 700 + 500),
    ("shop/web-0", "shop/db-0"): (3 + 2, 300 + 200),
}
CLOCK_GROUP: Group = ("test/clock", "test/clock")


def synthetic_record(
    port: int,
    source_pod: tuple[str, str],
    dest_pod: tuple[str, str],
    service: str | None,
    export_ms: int,
    totals: tuple[int, int, int, int],
) -> dict[str, Any]:
    """A complete FlowRecord with Kubernetes fields, as enrichment will fill them."""
    return {
        "connectionId": uuid.uuid4().int >> 65,
        "exporterNode": "synthetic",
        "flowStart": export_ms - 1000,
        "ipVersion": 4,
        "protocol": 6,
        "sourceAddress": "10.250.0.1",
        "sourcePort": port,
        "destinationAddress": "10.250.0.2",
        "destinationPort": 8080,
        "originalDestinationAddress": "10.250.0.2",
        "originalDestinationPort": 8080,
        "zone": 0,
        "ctId": port,
        "ctMark": 0,
        "sourcePodName": source_pod[1],
        "sourcePodNamespace": source_pod[0],
        "destinationPodName": dest_pod[1],
        "destinationPodNamespace": dest_pod[0],
        "destinationService": service,
        "sequence": 0,
        "exportTime": export_ms,
        "flowEnd": export_ms,
        "flowEndReason": 3,
        "flags": 0,
        "packetTotalCount": totals[0],
        "octetTotalCount": totals[1],
        "reversePacketTotalCount": totals[2],
        "reverseOctetTotalCount": totals[3],
        "packetDeltaCount": totals[0],
        "octetDeltaCount": totals[1],
        "reversePacketDeltaCount": totals[2],
        "reverseOctetDeltaCount": totals[3],
    }


def produce_synthetic(bootstrap: str, topic: str) -> None:
    schema = fastavro.parse_schema(json.loads(schema_path().read_text()))
    now_ms = time.time_ns() // 1_000_000
    records = [
        synthetic_record(40001, ("shop", "web-0"), ("shop", "cart-7"), "shop/cart:80/TCP", now_ms, (7, 700, 5, 500)),
        synthetic_record(40002, ("shop", "web-0"), ("shop", "db-0"), None, now_ms, (3, 300, 2, 200)),
        # The clock: an hour ahead, so the watermark passes every real window.
        synthetic_record(40003, ("test", "clock"), ("test", "clock"), "test/clock", now_ms + 3_600_000, (1, 1, 0, 0)),
    ]
    producer = Producer({"bootstrap.servers": bootstrap})
    for r in records:
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, schema, r)
        producer.produce(topic, buf.getvalue())
    assert producer.flush(30) == 0


# --------------------------------------------------------------------------- the scenario


@dataclass
class Scenario:
    plain_ct: dict[Group, Counts]
    restart_ct: dict[Group, Counts]
    records: list[dict[str, Any]]
    rows: list[dict[str, Any]]  # the default mode (deltas: the README's consumer rule)
    totals_rows: list[dict[str, Any]]  # --mode totals
    long_b: Any  # the LongConnection that spans the restarts
    spark_seconds: float

    def spark_totals(self, mode: str = "deltas") -> dict[Group, Counts]:
        out: dict[Group, Counts] = defaultdict(lambda: (0, 0))
        for row in self.rows if mode == "deltas" else self.totals_rows:
            key = (row["source"], row["destination"])
            p, b = out[key]
            out[key] = (p + row["packets"], b + row["bytes"])
        return dict(out)


def quiet_then_snapshot(lab: Lab) -> CtTable:
    """Let the exporter poll the final counters (1 s poll interval), then read the table."""
    time.sleep(2.5)
    return lab.conntrack_entries()


def run_spark(bootstrap: str, topic: str, workdir: Path, *mode: str) -> tuple[list[dict[str, Any]], float]:
    import pyarrow.parquet as pq

    workdir.mkdir(parents=True, exist_ok=True)
    out = workdir / "flows.parquet"
    cmd = [
        sys.executable,
        str(JOB),
        "--bootstrap-servers",
        bootstrap,
        "--topic",
        topic,
        "--available-now",
        "--parquet",
        str(out),
        "--checkpoint",
        str(workdir / "checkpoint"),
        "--window",
        f"{WINDOW_S} seconds",
        # Small batches: the per-connection state must carry over from batch to batch. A
        # watermark longer than the scenario keeps records of the two partitions from being late.
        "--max-offsets-per-trigger",
        "10",
        "--watermark",
        "5 minutes",
        f"--driver-java-options={SPARK_JVM}",
        *mode,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    elapsed = time.monotonic() - t0
    (workdir / "spark.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith('{"spark_flows"')))["spark_flows"]
    assert summary["input_rows"] > 0
    assert summary["batches"] >= 3, summary  # several data batches, then the one that closes windows
    return pq.read_table(out).to_pylist(), elapsed


@pytest.fixture(scope="module")
def scenario(kafka_broker: KafkaBroker, tmp_path_factory: pytest.TempPathFactory) -> Scenario:
    work = tmp_path_factory.mktemp("spark-e2e")
    topic = f"spark-e2e-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic, partitions=2)
    bootstrap = kafka_broker.bootstrap
    with Lab(pods=3) as lab:
        p1, p2, p3 = lab.pods
        svc = lab.add_service(lab.vip4(), 80, p3, 8080)

        # Plain: one exporter process from the first packet to the last.
        exporter = start_exporter(lab, bootstrap, topic, work / "exporter-1.log")
        try:
            long_a = lab.open_tcp(p1, p3, 7000)
            lab.tcp_exchange(p1, p2, 9000, 1000, 5000)
            lab.tcp_exchange(p2, p1, 9001, 3000, 700, family=6)
            lab.udp_exchange(p2, p3, 5300, 100, 400, count=3)
            lab.tcp_exchange(p2, svc, 80, 200, 20_000)
            lab.tcp_exchange(p2, svc, 80, 300, 1_000)  # a second connection in the same group
            for _ in range(3):
                long_a.send(1500)
                time.sleep(1)
            plain = quiet_then_snapshot(lab)
            stop_exporter(exporter, work / "exporter-1.log")  # long_a gets a forced final record
        finally:
            if exporter.poll() is None:
                exporter.kill()
        long_a.close()
        time.sleep(0.5)  # the last ACK of the close, before the flush
        for _ in range(20):
            lab.flush_conntrack()
            if lab.conntrack_count() == 0:
                break
            time.sleep(0.1)
        assert lab.conntrack_count() == 0

        # Restarts: connections alive across exporter restarts that keep a state directory.
        state = ("--set", f"state.dir={work / 'state'}")
        exporter = start_exporter(lab, bootstrap, topic, work / "exporter-2.log", *state)
        try:
            long_b = lab.open_tcp(p3, p1, 7100)
            lab.tcp_exchange(p1, p2, 9100, 2000, 3000)  # ended; still in the table (TIME_WAIT) at restart
            lab.udp_exchange(p3, p2, 5400, 80, 160, count=4)
            for _ in range(4):  # several active-timeout records (2 s) before the restart
                long_b.send(1000)
                time.sleep(1)
            time.sleep(1.5)
            exporter.kill()  # SIGKILL, records in flight
            exporter.wait(10)
            # No exporter: a connection that starts and ends unseen, and more bytes on long_b.
            lab.tcp_exchange(p1, p2, 9100, 500, 500)
            long_b.send(2000)
            exporter = start_exporter(lab, bootstrap, topic, work / "exporter-3.log", *state)
            lab.udp_exchange(p3, p2, 5400, 80, 160, count=2)
            for _ in range(3):
                long_b.send(1000)
                time.sleep(1)
            stop_exporter(exporter, work / "exporter-3.log")  # SIGTERM
            long_b.send(500)
            exporter = start_exporter(lab, bootstrap, topic, work / "exporter-4.log", *state)
            long_b.send(700)
            restart = quiet_then_snapshot(lab)
            stop_exporter(exporter, work / "exporter-4.log")
        finally:
            if exporter.poll() is None:
                exporter.kill()
        long_b.close()

    produce_synthetic(bootstrap, topic)
    records = read_records(bootstrap, topic, expect_at_least=10)
    rows, seconds = run_spark(bootstrap, topic, work / "deltas")
    totals_rows, _ = run_spark(bootstrap, topic, work / "totals", "--mode", "totals")
    return Scenario(ct_totals(plain), ct_totals(restart), records, rows, totals_rows, long_b, seconds)


# --------------------------------------------------------------------------- checks


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("mode", ["deltas", "totals"])
def test_plain_totals_equal_conntrack(scenario: Scenario, mode: str) -> None:
    got = scenario.spark_totals(mode)
    expected = scenario.plain_ct
    assert len(expected) >= 5, expected
    assert {g: got.get(g) for g in expected} == expected
    # The README's rule, computed here without Spark, agrees.
    rule = readme_rule(scenario.records)
    assert {g: rule.get(g) for g in expected} == expected


@pytest.mark.lab
@pytest.mark.kafka
@pytest.mark.parametrize("mode", ["deltas", "totals"])
def test_restart_totals_equal_conntrack(scenario: Scenario, mode: str) -> None:
    got = scenario.spark_totals(mode)
    expected = scenario.restart_ct
    assert len(expected) >= 3, expected
    assert not set(expected) & set(scenario.plain_ct), "the two phases must not share groups"
    assert {g: got.get(g) for g in expected} == expected
    rule = readme_rule(scenario.records)
    assert {g: rule.get(g) for g in expected} == expected

    # The premise: long_b lived through a SIGKILL and a SIGTERM, and its records are one connectionId
    # whose sequences continued across the three processes (no second sequence 0).
    lb = scenario.long_b
    recs = [r for r in scenario.records if r["sourceAddress"] == lb.client_ip and r["sourcePort"] == lb.client_port]
    assert len({r["connectionId"] for r in recs}) == 1
    assert len({r["exporterNode"] for r in recs}) == 1
    assert sorted({r["sequence"] for r in recs}) == list(range(len({r["sequence"] for r in recs})))
    assert len({r["sequence"] for r in recs}) >= 5


@pytest.mark.lab
@pytest.mark.kafka
def test_kubernetes_names_and_windows(scenario: Scenario) -> None:
    got = scenario.spark_totals()
    for group, counts in K8S_GROUPS.items():
        assert got.get(group) == counts, group
    # The clock's window is never closed; every real window is, and only real groups are output.
    assert CLOCK_GROUP not in got
    assert set(got) == set(scenario.plain_ct) | set(scenario.restart_ct) | set(K8S_GROUPS)
    for row in scenario.rows:
        start, end = row["window_start"], row["window_end"]
        assert (end - start).total_seconds() == WINDOW_S
        assert start.timestamp() % WINDOW_S == 0
        assert row["packets"] == row["forward_packets"] + row["reverse_packets"]
        assert row["bytes"] == row["forward_bytes"] + row["reverse_bytes"]
    # long_b's bytes spread over several windows, and still add up (checked above).
    lb = scenario.long_b
    lb_group = (lb.client_ip, endpoint(lb.backend_ip, lb.backend_port))
    assert sum(1 for r in scenario.rows if (r["source"], r["destination"]) == lb_group) >= 2


# --------------------------------------------------------------------------- the stateful step alone


def test_high_water_increments_survive_restart_and_resend() -> None:
    """The per-connection arithmetic of totals mode, without Spark (numpy and pandas only)."""
    import numpy as np

    def batch(marks: HighWater, rows: list[tuple[int, int, int]]) -> list[int]:
        """rows: (connection, event ms, packets); returns each row's packet increment, in row order."""
        cid = np.array([r[0] for r in rows], np.int64)
        ms = np.array([r[1] for r in rows], np.int64)
        totals = np.array([[r[2], r[2] * 100, 0, 0] for r in rows], np.int64)
        order, inc = marks.advance(cid, ms, totals)
        out = [0] * len(rows)
        for k, i in enumerate(order):
            out[i] = int(inc[k, 0])
            assert inc[k, 1] == 100 * inc[k, 0] and (inc[k] >= 0).all()
        return out

    marks = HighWater.empty()
    # Connection 7 grows 5 -> 9; connection -3 (ids are signed) appears; rows arrive out of order.
    assert batch(marks, [(7, 2000, 9), (7, 1000, 5), (-3, 1500, 4)]) == [4, 5, 4]
    marks = HighWater.from_bytes(marks.to_bytes())  # state as Spark stores it between batches
    # A restarted exporter re-exports 7 with its full totals (nothing new), then 2 more packets;
    # a redelivered duplicate adds nothing; a re-sent record with more packets adds the difference.
    assert batch(marks, [(7, 3000, 9), (7, 4000, 11), (7, 4000, 11), (-3, 3500, 6), (-3, 3500, 7)]) == [0, 2, 0, 2, 1]
    assert list(marks.ids) == [-3, 7] and [int(h[0]) for h in marks.high] == [7, 11]
    assert list(marks.last) == [3500, 4000]
    marks.expire(3600)  # -3's newest record is older: forgotten
    assert list(marks.ids) == [7]

    rng = np.random.default_rng(5)
    marks, seen = HighWater.empty(), {}
    for _ in range(20):
        n = int(rng.integers(1, 40))
        cid = rng.integers(-4, 4, n).astype(np.int64)
        ms = rng.integers(0, 10_000, n).astype(np.int64)
        totals = rng.integers(0, 1000, (n, 4)).astype(np.int64)
        order, inc = marks.advance(cid, ms, totals)
        for k, i in enumerate(order):  # brute force, in the order advance() took the rows
            high = seen.get(int(cid[i]), np.zeros(4, np.int64))
            assert (inc[k] == np.maximum(high, totals[i]) - high).all()
            seen[int(cid[i])] = np.maximum(high, totals[i])
    assert sorted(seen) == list(marks.ids)
    assert all((marks.high[j] == seen[int(c)]).all() for j, c in enumerate(marks.ids))
