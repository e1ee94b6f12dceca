"""Faults on real parts: broker outages, missing topic, failing dumps, missing privilege, SIGTERM with Kafka down.

The property checked after every outage: every connection reaches the topic, and
per connection the deltas (after dropping duplicates by connectionId and
sequence) sum to the final totals ``conntrack -L`` showed.
"""

from __future__ import annotations

import errno
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.kafka import KafkaBroker
from devtools.lab import Lab
from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.connection import Connection
from flow_exporter.conntrack.dumper import ConntrackDumper
from flow_exporter.conntrack.errors import ConntrackDumpInterrupted, ConntrackError, ConntrackOverrun
from flow_exporter.ports import DecodeResult
from flow_exporter.sink import KafkaSink
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.timeouts import Timeouts
from tests.support.exporter_process import start_exporter, stop_exporter
from tests.support.records import read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

COUNTERS = ("packetTotalCount", "octetTotalCount", "reversePacketTotalCount", "reverseOctetTotalCount")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[KafkaBroker]:
    """A broker of the test's own: these tests stop and kill it."""
    with KafkaBroker(tmp_path / "kafka") as b:
        yield b


def dedup(records: list[dict]) -> tuple[dict[int, list[dict]], int]:
    """Records per connection, duplicates by (connectionId, sequence) dropped; and how many were dropped."""
    seen: dict[tuple[int, int], dict] = {}
    dups = 0
    for r in records:
        k = (r["connectionId"], r["sequence"])
        if k in seen:
            dups += 1
            continue
        seen[k] = r
    groups: dict[int, list[dict]] = {}
    for r in seen.values():
        groups.setdefault(r["connectionId"], []).append(r)
    for rs in groups.values():
        rs.sort(key=lambda r: r["sequence"])
    return groups, dups


def check_against_conntrack(groups: dict[int, list[dict]], seen: dict, exchanges: list[Any]) -> None:
    by_src = {(rs[0]["sourceAddress"], rs[0]["sourcePort"]): rs for rs in groups.values()}
    for ex in exchanges:
        ct = seen.get((ex.client_ip, ex.client_port))
        assert ct is not None, ex
        rs = by_src.get((ex.client_ip, ex.client_port))
        assert rs is not None, f"connection {ex.client_ip}:{ex.client_port} never reached the topic"
        assert [r["sequence"] for r in rs] == list(range(len(rs)))
        last = rs[-1]
        assert tuple(last[c] for c in COUNTERS) == (ct.orig_packets, ct.orig_bytes, ct.reply_packets, ct.reply_bytes)
        for c in COUNTERS:
            assert sum(r[c.replace("Total", "Delta")] for r in rs) == last[c], c


def outage(lab: Lab, broker: KafkaBroker, tmp_path: Path, down: str, seconds: float) -> tuple[int, int]:
    topic = f"outage-{down}"
    broker.create_topic(topic, partitions=3)
    p1, p2, p3 = lab.pods
    log = tmp_path / "exporter.log"
    proc = start_exporter(lab, broker.bootstrap, topic, log, "--set", "shutdown.grace=60s")
    exchanges: list[Any] = []
    seen: dict[tuple[str, int], Any] = {}

    def snapshot() -> None:
        """The last counters conntrack showed for each connection (UDP entries expire after 30 s)."""
        for e in lab.conntrack_entries():
            seen[(e.orig_src, e.orig_sport)] = e

    try:
        long_conn = lab.open_tcp(p1, p3, 7100)
        exchanges.append(long_conn)
        exchanges += [lab.tcp_exchange(p1, p2, 8100, 500, 5000) for _ in range(3)]
        time.sleep(3)
        snapshot()
        if down == "kill":
            broker.kill()
        else:
            broker.stop()
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # traffic while the broker is away
            exchanges.append(lab.tcp_exchange(p2, p3, 8101, 300, 3000))
            exchanges.append(lab.udp_exchange(p3, p1, 5600, 80, 200))
            long_conn.send(2000)
            snapshot()
            time.sleep(max(0.0, min(5.0, end - time.monotonic())))
        broker.start()
        exchanges += [lab.tcp_exchange(p1, p2, 8102, 100, 1000) for _ in range(2)]
        long_conn.send(1000)
        time.sleep(8)  # records of the outage delivered, later ones exported
        snapshot()
        text = stop_exporter(proc, log, grace=60)  # long_conn still open: forced final record
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in text
    assert "final records were not delivered" not in text
    groups, dups = dedup(read_records(broker.bootstrap, topic, expect_at_least=len(exchanges), timeout=60))
    check_against_conntrack(groups, seen, [e for e in exchanges if e is not long_conn])
    long_recs = next(rs for rs in groups.values() if rs[0]["sourcePort"] == long_conn.client_port)
    ct_long = seen[(long_conn.client_ip, long_conn.client_port)]
    assert long_recs[-1]["octetTotalCount"] >= ct_long.orig_bytes
    assert sum(r["octetDeltaCount"] for r in long_recs) == long_recs[-1]["octetTotalCount"]
    long_conn.close()
    return len(exchanges), dups


def test_broker_stopped_60s_during_traffic_loses_nothing(lab: Lab, broker: KafkaBroker, tmp_path: Path) -> None:
    n, dups = outage(lab, broker, tmp_path, "stop", 60)
    assert n > 20
    print(f"outage stop: {n} connections, 0 lost, {dups} duplicates")


def test_broker_sigkilled_and_restarted_loses_nothing(lab: Lab, broker: KafkaBroker, tmp_path: Path) -> None:
    n, dups = outage(lab, broker, tmp_path, "kill", 15)
    print(f"outage kill: {n} connections, 0 lost, {dups} duplicates")


def test_missing_topic_is_reported_and_retried_without_crash(lab: Lab, tmp_path: Path) -> None:
    with KafkaBroker(tmp_path / "kafka", auto_create_topics=False) as b:
        log = tmp_path / "exporter.log"
        cmd = [
            sys.executable, "-m", "flow_exporter", "run", "--netns", lab.node_ns, "--bootstrap-servers", b.bootstrap,
            "--topic", "not-yet", "--set", "retry.initialBackoff=0.2s", "--set", "retry.maxBackoff=1s",
            "--set", "metrics.port=0", "--set", "conntrack.pollInterval=1s",
        ]  # fmt: skip
        with log.open("wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 20
            while "kafka topic(s) missing: not-yet" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            time.sleep(3)
            assert proc.poll() is None, "exited instead of retrying"
            retries = log.read_text().count("kafka topic(s) missing")
            assert 2 <= retries <= 10, f"{retries} retries in ~3 s: backoff not working"
            b.create_topic("not-yet")
            while "first poll" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline + 20, log.read_text()
                time.sleep(0.2)
            ex = lab.tcp_exchange(lab.pods[0], lab.pods[1], 8200, 10, 10)
            time.sleep(3)
            text = stop_exporter(proc, log)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert "broker reachable" in text and "Traceback" not in text
        records = read_records(b.bootstrap, "not-yet", expect_at_least=1)
        assert any(r["sourcePort"] == ex.client_port for r in records)


class FlakySource:
    """The real dumper, with the kernel's transient failures injected in front of it."""

    def __init__(self, real: ConntrackDumper, failures: list[BaseException]) -> None:
        self.real = real
        self.failures = failures

    @property
    def skipped(self) -> int:
        return self.real.skipped

    def dump_buffers(
        self, apply: Callable[[memoryview], DecodeResult], zones: Collection[int] | None = None
    ) -> int | None:
        if self.failures:
            raise self.failures.pop(0)
        return self.real.dump_buffers(apply, zones)

    def dump_into(self, consume: Callable[[list[Connection]], None], zones: Collection[int] | None = None) -> int:
        if self.failures:
            raise self.failures.pop(0)
        return self.real.dump_into(consume, zones)

    def count(self) -> int:
        return self.real.count()

    def max_entries(self) -> int:
        return self.real.max_entries()

    def kernel_stats(self) -> dict[str, int]:
        return self.real.kernel_stats()


def test_failing_dumps_are_retried_with_backoff_and_counted(lab: Lab, kafka_broker: Any, kafka_topic: str) -> None:
    lab.tcp_exchange(lab.pods[0], lab.pods[1], 8300, 100, 100)
    failures: list[BaseException] = [
        ConntrackDumpInterrupted(errno.EINTR, "dump interrupted"),
        ConntrackOverrun(errno.ENOBUFS, "receive buffer overrun"),
        ConntrackError(errno.EMSGSIZE, "truncated message"),
    ]
    source = FlakySource(ConntrackDumper(netns=lab.node_ns), failures)
    sink = KafkaSink({"bootstrap.servers": kafka_broker.bootstrap}, kafka_topic, RecordEncoder("n").encode)
    exp = Exporter(
        source,
        sink,
        ExporterOptions(timeouts=Timeouts(0.5, 1, 2), node_name="n", retry_initial=0.1, retry_max=0.4),
    )
    t0 = time.monotonic()
    th = threading.Thread(target=exp.run)
    th.start()
    assert exp.lifecycle.first_poll_done.wait(10)
    elapsed = time.monotonic() - t0
    exp.stop_event.set()
    th.join(20)
    assert exp.stats.poll_errors == 3 and not failures
    assert 0.15 <= elapsed < 5, f"three retries took {elapsed:.2f}s: no backoff, or too much"
    assert exp.fatal is None and exp.outcome.lost == 0


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed")
def test_no_cap_net_admin_exits_with_a_message(lab: Lab, kafka_broker: Any, kafka_topic: str) -> None:
    cmd = [
        "setpriv", "--bounding-set=-net_admin", "--inh-caps=-net_admin",
        sys.executable, "-m", "flow_exporter", "run", "--netns", lab.node_ns, "--bootstrap-servers",
        kafka_broker.bootstrap, "--topic", kafka_topic, "--set", "metrics.port=0",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr  # a configuration problem, found before anything waits (issue 43)
    assert "needs CAP_NET_ADMIN" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_sigterm_with_kafka_down_logs_exactly_what_was_lost(lab: Lab, broker: KafkaBroker, tmp_path: Path) -> None:
    broker.create_topic("down")
    p1, p2, p3 = lab.pods
    log = tmp_path / "exporter.log"
    proc = start_exporter(lab, broker.bootstrap, "down", log, "--set", "shutdown.grace=5s")
    try:
        conns = [lab.open_tcp(p1, p2, 7200), lab.open_tcp(p2, p3, 7201), lab.open_tcp(p3, p1, 7202)]
        time.sleep(4)  # their first records delivered
        broker.stop()
        for c in conns:
            c.send(500)
        time.sleep(2)
        tracked = len(lab.conntrack_entries())
        t0 = time.monotonic()
        text = stop_exporter(proc, log, grace=5)
        assert time.monotonic() - t0 < 5 + 3
    finally:
        if proc.poll() is None:
            proc.kill()
        for c in conns:
            c.close()
    m = re.search(r"grace period over, (\d+) connections' final records were not delivered", text)
    assert m, text
    assert int(m.group(1)) == tracked
