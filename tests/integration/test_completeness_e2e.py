"""Completeness markers end to end: an event overrun and a broker crash, and how the jobs mark windows.

Real parts: a namespace lab, the exporter with ``markers.topic`` (a round every second), its own
broker (killed in the second test), the Spark and Flink jobs with ``--markers-topic``.

* Overrun: the exporter is frozen (SIGSTOP) while a burst of conntrack entries is inserted, with a
  4 KiB event socket, so the kernel drops events; thawed, it counts them. The freeze sits inside
  one 10 s window, and exactly that window must come out ``lossy``; every other one ``complete``.
* Broker crash: the broker is killed (SIGKILL) mid-window for several seconds, then started again.
  Nothing is lost (the exporter resends), so every window comes out ``complete`` and the counts equal
  ``conntrack -L``; the markers show the outage without repeating it: at most one round is built
  while the broker is down (it waits, frozen, and the next round covers the rest of the outage),
  and by the README's marker rule the distinct markers' ``recordsAcknowledged`` add up to exactly
  the records on each partition.

Both tests read the markers by that rule: (exporterNode, topic, partition, since) names one content
(copies must be identical), and one exporter's rounds follow one another without overlap.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import fastavro
import pytest

from devtools.kafka import KafkaBroker
from devtools.lab import Lab
from flow_exporter.completeness import marker_schema
from flow_exporter.record import schema_path
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
from tests.support.records import read_records, read_until_quiet

pytestmark = [pytest.mark.lab, pytest.mark.kafka, pytest.mark.spark]

MARKERS = ("--set", "markers.interval=1s")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaBroker]:
    with KafkaBroker(tmp_path_factory.mktemp("completeness-broker")) as b:
        yield b


def read_markers(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    return [m for _, _, m in read_until_quiet(bootstrap, topic, marker_schema())]


MarkerId = tuple[str, str, int, Any]  # exporterNode, topic, partition, since


def by_the_rule(sent: list[dict[str, Any]]) -> dict[MarkerId, dict[str, Any]]:
    """The README's marker rule: (exporterNode, topic, partition, since) names one marker; keep one copy.

    Also checks what makes the rule exact: the copies are identical, and the rounds (the distinct
    intervals, one exporter here) follow one another, each starting at the previous one's until.
    """
    distinct: dict[MarkerId, dict[str, Any]] = {}
    for m in sent:
        kept = distinct.setdefault((m["exporterNode"], m["topic"], m["partition"], m["since"]), m)
        assert kept == m, (kept, m)
    rounds = sorted({(m["since"], m["until"]) for m in distinct.values()})
    assert len({since for since, _ in rounds}) == len(rounds), rounds  # one until per round
    for (_, until), (since, _) in pairwise(rounds):
        assert since == until, rounds
    return distinct


def flow_partitions(bootstrap: str, topic: str) -> dict[int, tuple[int, int]]:
    """Per partition of the flow topic: distinct (connectionId, sequence) pairs, and the highest offset."""
    schema = fastavro.parse_schema(json.loads(schema_path().read_text()))
    pairs: dict[int, set[tuple[int, int]]] = {}
    last: dict[int, int] = {}
    for partition, offset, r in read_until_quiet(bootstrap, topic, schema):
        pairs.setdefault(partition, set()).add((r["connectionId"], r["sequence"]))
        last[partition] = max(last.get(partition, -1), offset)
    return {p: (len(pairs[p]), last[p]) for p in pairs}


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
    by_the_rule(sent)
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
            restarting_at = time.time()  # no broker process from killed_at until here
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
    distinct = by_the_rule(sent)
    # No round is confirmed without a broker, and none is built while one is pending: of the ~6 ticks
    # of the outage, at most the first built a round (none, if the one built before the kill was
    # still unconfirmed then); it waited, frozen, and the next round covers the rest of the outage.
    built_while_down = {m["since"] for m in distinct.values() if killed_at <= m["until"].timestamp() <= restarting_at}
    assert len(built_while_down) <= 1, sorted(built_while_down)
    # upTo never passed a record that was still waiting for the broker: the first record built after
    # the kill (its exportTime, as read back from the topic) holds back every marker built while down.
    records = read_records(broker.bootstrap, topic, expect_at_least=5)
    first_after = min(r["exportTime"] for r in records if r["exportTime"].timestamp() > killed_at)
    during = [m for m in distinct.values() if killed_at <= m["until"].timestamp() <= restarting_at]
    assert all(m["upTo"] <= first_after for m in during)
    assert all(m["eventLosses"] == m["recordsGivenUp"] == m["connectionsGivenUp"] == 0 for m in sent)
    # Summed by the rule, the markers count every record acknowledged once, outage included (no record
    # was given up, none timed out): the distinct (connectionId, sequence) pairs of each partition; and
    # the highest lastOffset is the partition's last offset (read before the jobs add synthetic records).
    acknowledged: Counter[int] = Counter()
    last_offset: dict[int, int] = {}
    for (_, _, partition, _), m in distinct.items():
        if partition >= 0:
            acknowledged[partition] += m["recordsAcknowledged"]
            last_offset[partition] = max(last_offset.get(partition, -1), m["lastOffset"])
    on_topic = flow_partitions(broker.bootstrap, topic)
    assert {p: (acknowledged[p], last_offset[p]) for p in last_offset} == on_topic
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
