"""Completeness markers end to end: an event overrun and a broker crash, and how the jobs mark windows.

Real parts: a namespace lab, the exporter with ``markers.topic`` (a round every second), its own
broker (killed in the second test), the Spark and Flink jobs with ``--markers-topic``.

* Overrun: the exporter is frozen (SIGSTOP) while a burst of conntrack entries is inserted, with a
  4 KiB event socket, so the kernel drops events; thawed, it counts them. The freeze sits inside
  one 10 s window, and exactly that window must come out ``lossy``; every other one ``complete``.
* Broker crash: the broker is killed (SIGKILL) mid-window for several seconds, then started again.
  Nothing is lost (the exporter resends), so every window comes out ``complete`` and the counts equal
  ``conntrack -L``; the markers show the outage: no marker round is confirmed inside it, the first
  one after it covers it whole.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fastavro
import pytest
from confluent_kafka import Consumer

from devtools.kafka import KafkaBroker
from devtools.lab import Lab
from flow_exporter.completeness import marker_schema
from tests.support.downstream import (
    WINDOW_S,
    JobRun,
    ct_connection,
    produce_synthetic,
    read_json_rows,
    read_parquet_rows,
    run_flink,
    run_spark,
)
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka, pytest.mark.spark]

MARKERS = ("--set", "markers.interval=1s")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    with KafkaBroker(tmp_path_factory.mktemp("completeness-broker")) as b:
        yield b


def read_markers(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"m{time.time_ns()}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    schema = marker_schema()
    out: list[dict[str, Any]] = []
    idle = time.monotonic() + 20  # the first message may take a group join; then 3 s of quiet ends it
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


def window_of(t: float) -> int:
    """The start (epoch seconds) of the window holding time ``t``."""
    return int(t - t % WINDOW_S)


def wait_into_window(offset: float) -> None:
    """Sleep until ``offset`` seconds after the start of a window (the next one, if past it)."""
    now = time.time()
    delay = offset - now % WINDOW_S
    time.sleep(delay if delay > 0.2 else delay + WINDOW_S)


def completeness(job: str, out: Path) -> dict[int, str]:
    rows = read_parquet_rows(out) if job == "spark" else read_json_rows(out)
    return {int(r["window_start"].timestamp()): r["status"] for r in rows}


def run_jobs(bootstrap: str, topic: str, markers: str, work: Path) -> dict[str, tuple[JobRun, dict[int, str]]]:
    produce_synthetic(bootstrap, topic, clock_only=True)  # closes Spark's windows
    spark = run_spark(
        bootstrap, topic, work / "spark", "--markers-topic", markers, "--max-offsets-per-trigger", "2000", min_batches=2
    )
    flink = run_flink(bootstrap, topic, work / "flink", "--markers-topic", markers)
    return {
        "spark": (spark, completeness("spark", work / "spark" / "tables" / "window_completeness")),
        "flink": (flink, completeness("flink", work / "flink" / "tables" / "window_completeness")),
    }


def test_an_event_overrun_marks_exactly_its_window_lossy(broker: KafkaBroker, tmp_path: Path) -> None:
    topic, markers = f"flows-{uuid.uuid4().hex[:6]}", f"markers-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, partitions=2)
    broker.create_topic(markers)
    log = tmp_path / "exporter.log"
    with Lab(pods=3) as lab:
        p0, p1, p2 = lab.pods
        exporter = start_exporter(
            lab, broker.bootstrap, topic, log, *MARKERS,
            "--set", f"markers.topic={markers}", "--set", "conntrack.eventBuffer=4096",
        )  # fmt: skip
        try:
            lab.tcp_exchange(p0, p1, 9000, 500, 4000)
            wait_into_window(3.0)  # the freeze and its marker interval inside one window
            os.kill(exporter.pid, signal.SIGSTOP)
            frozen_at = time.time()
            script = "".join(
                f"-I -s 10.254.{i // 250}.{i % 250 + 1} -d 10.254.255.1 -p udp --sport {20000 + i} --dport 53 -t 30\n"
                for i in range(150)
            )
            for line in script.splitlines():
                subprocess.run(["ip", "netns", "exec", lab.node_ns, "conntrack", *line.split()], capture_output=True)
            os.kill(exporter.pid, signal.SIGCONT)
            thawed_at = time.time()
            assert window_of(frozen_at) == window_of(thawed_at + 1.5), "the freeze overran its window"
            time.sleep(1.5)
            lab.tcp_exchange(p1, p2, 9001, 800, 3000)
            wait_into_window(2.0)
            lab.tcp_exchange(p2, p0, 9002, 300, 900)
            wait_into_window(2.0)  # the last traffic window has ended before the exporter stops
        finally:
            stop_exporter(exporter, log)
        stopped_at = time.time()
    sent = read_markers(broker.bootstrap, markers)
    lossy_markers = {(m["since"], m["until"]) for m in sent if m["eventLosses"]}
    assert len(lossy_markers) == 1, (len(sent), sent[-3:])
    ((since, until),) = lossy_markers
    assert since.timestamp() <= thawed_at + 0.5 and until.timestamp() >= thawed_at - 0.5
    assert "events lost" in log.read_text()
    for job, (run, status) in run_jobs(broker.bootstrap, topic, markers, tmp_path).items():
        windows = {int(r["window_start"].timestamp()) for r in run.windows if r["source"].startswith("10.")}
        assert len(windows) >= 2 and window_of(thawed_at) in windows, (job, windows)
        # The windows that ended while the exporter ran: the frozen one lossy, the rest complete. A window
        # still open when it stopped stays unconfirmed: its final markers vouch only for records before then.
        expected = {}
        for w in windows:
            if w == window_of(thawed_at):
                expected[w] = "lossy"
            else:
                expected[w] = "complete" if w + WINDOW_S <= stopped_at - 1 else "unconfirmed"
        assert {w: status.get(w) for w in windows} == expected, job
        assert list(expected.values()).count("complete") >= 1


def test_a_broker_crash_loses_nothing_and_the_markers_show_it(broker: KafkaBroker, tmp_path: Path) -> None:
    topic, markers = f"flows-{uuid.uuid4().hex[:6]}", f"markers-{uuid.uuid4().hex[:6]}"
    broker.create_topic(topic, partitions=2)
    broker.create_topic(markers)
    log = tmp_path / "exporter.log"
    with Lab(pods=3) as lab:
        p0, p1, p2 = lab.pods
        exporter = start_exporter(
            lab, broker.bootstrap, topic, log, *MARKERS, "--set", f"markers.topic={markers}",
            "--set", "retry.initialBackoff=0.3s", "--set", "retry.maxBackoff=1s",
        )  # fmt: skip
        try:
            long = lab.open_tcp(p0, p1, 7000)
            lab.tcp_exchange(p1, p2, 9000, 500, 4000)
            wait_into_window(2.0)
            broker.kill()  # SIGKILL, mid-window
            killed_at = time.time()
            for _ in range(6):  # traffic and records (active timeouts) while no broker runs
                long.send(1000)
                time.sleep(1)
            lab.tcp_exchange(p2, p0, 9001, 300, 3000)
            broker.start()
            restarted_at = time.time()
            long.send(500)
            wait_into_window(2.0)
            lab.tcp_exchange(p0, p2, 9002, 200, 900)
            time.sleep(2.5)
            truth = {ct_connection(e): e for e in lab.conntrack_entries()}
            wait_into_window(2.0)
        finally:
            stop_exporter(exporter, log)
        stopped_at = time.time()
        long.close()
    sent = read_markers(broker.bootstrap, markers)
    # No round was confirmed while the broker was down: the first confirmed after it covers the outage.
    assert any(m["since"].timestamp() <= killed_at and m["until"].timestamp() >= restarted_at for m in sent)
    # upTo never passed a record that was still waiting for the broker: the first record built after
    # the kill (its exportTime, as read back from the topic) holds back every marker built while down.
    records = read_records(broker.bootstrap, topic, expect_at_least=5)
    first_after = min(r["exportTime"] for r in records if r["exportTime"].timestamp() > killed_at)
    during = [m for m in sent if killed_at <= m["until"].timestamp() <= restarted_at]
    assert all(m["upTo"] <= first_after for m in during)
    assert any(m["until"].timestamp() >= first_after.timestamp() + 1 for m in during)
    assert all(m["eventLosses"] == m["recordsGivenUp"] == m["connectionsGivenUp"] == 0 for m in sent)
    for job, (run, status) in run_jobs(broker.bootstrap, topic, markers, tmp_path).items():
        windows = {int(r["window_start"].timestamp()) for r in run.windows if r["source"].startswith("10.")}
        assert window_of(killed_at) in windows and window_of(restarted_at) in windows, (job, windows)
        expected = {w: "complete" if w + WINDOW_S <= stopped_at - 1 else "unconfirmed" for w in windows}
        assert {w: status.get(w) for w in windows} == expected, job
        # Nothing was lost: every connection's counts are the kernel's.
        rows = {
            (r["protocol"], r["sourceAddress"], r["sourcePort"], r["destinationAddress"], r["destinationPort"]): r
            for r in run.connections
        }
        for key, e in truth.items():
            row = rows[key]
            assert (row["forward_packets"], row["forward_bytes"]) == (e.orig_packets, e.orig_bytes), (job, e.raw)
            assert (row["reverse_packets"], row["reverse_bytes"]) == (e.reply_packets, e.reply_bytes), (job, e.raw)
