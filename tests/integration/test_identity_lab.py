"""Allocated connectionIds on real parts: a node over its cap rolled, and a DESTROY read after its tombstone died.

connectionIds are allocated once, never derived again from a connection's fields, so an
incarnation the store forgot and meets again can never restart an old id at sequence 0.
Two ways to meet one again, each checked against ``conntrack``'s own counters with the
records read back through the reference Avro decoder:

* the connections given up at ``limits.maxConnections`` live on, and keep sending, while
  the exporter is restarted (SIGTERM and SIGKILL) on the same ``state.dir``: the new process
  knows them from the checkpoint and reports nothing more of them;
* a DESTROY event read after the tombstone of its (swept, reported, forgotten) connection
  expired: it is reported under a new connectionId flagged adopted, and the README's totals
  rule stays exact.
"""

from __future__ import annotations

import re
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from devtools.lab import Lab, run_in
from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.connection import Connection
from flow_exporter.conntrack.dumper import ConntrackDumper
from flow_exporter.conntrack.events import ConntrackEvents
from flow_exporter.flow import ADOPTED, COUNTERS_RESET, END_OF_FLOW, LACK_OF_RESOURCES
from flow_exporter.metrics import Metrics
from flow_exporter.sink import KafkaSink
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.timeouts import Timeouts
from tests.integration.test_accounting_lab import Traffic, ct_counts, metric_value, of_client, summed
from tests.support import contract
from tests.support.exporter_process import free_port, scrape, start_exporter, stop_exporter
from tests.support.records import read_records

pytestmark = [pytest.mark.lab, pytest.mark.kafka]

CAP = 40
LIVE = 60


def given_up_total(text: str) -> float:
    return sum(
        metric_value(text, "flow_exporter_connections_given_up_total", f'{{reason="{r}"}}')
        for r in ("cap_refused", "cap_idle")
    )


def wait_metric(port: int, what: str, check: Any, timeout: float = 20.0) -> str:
    """Scrape /metrics until ``check(text)`` holds; the last text."""
    deadline = time.monotonic() + timeout
    while True:
        code, text = scrape(port, "/metrics")
        if code == 200 and check(text):
            return text
        assert time.monotonic() < deadline, f"{what}: not reached in {timeout}s\n{text}"
        time.sleep(0.25)


# --------------------------------------------------------------------------- a node over its cap, rolled


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_node_over_its_cap_rolled_keeps_given_up_connections_given_up(
    lab: Lab, kafka_broker: Any, kafka_topic: str, tmp_path: Path, how: signal.Signals
) -> None:
    """60 live connections over a cap of 40, the exporter restarted while all 60 keep sending.

    The first process gives 20 up (one reason-5 record each); the second, on the same
    state.dir, continues the 40 it tracked and gives nothing up again: no new reason-5
    record, no record at all for the 20, and the 40 add up to conntrack's counters.
    """
    p1, p2, p3 = lab.pods
    opts = ["--set", f"state.dir={tmp_path / 'state'}", "--set", f"limits.maxConnections={CAP}"]
    port1, port2 = free_port(), free_port()
    log1, log2 = tmp_path / "run1.log", tmp_path / "run2.log"
    assert lab.conntrack_count() == 0  # the node's table holds the lab's connections only
    proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log1, *opts, metrics_port=port1)
    traffic = None
    conns = []
    try:
        # Opened while the exporter runs: none is adopted, the first 40 it meets are tracked.
        conns = [lab.open_tcp([p1, p2][i % 2], p3, 7700) for i in range(LIVE)]
        traffic = Traffic(conns, size=300, every=0.5)
        wait_metric(port1, "20 connections given up", lambda t: given_up_total(t) >= LIVE - CAP)
        time.sleep(2.5)  # more traffic polled on all 60 (the given-up ones too), records delivered
        _, first = scrape(port1, "/metrics")
        stopping = datetime.now(UTC)
        if how == signal.SIGTERM:
            stop_exporter(proc, log1)
        else:
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(10) == -signal.SIGKILL
        time.sleep(1.0)  # the 60 keep sending while no exporter runs
        restarted = datetime.now(UTC)
        proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log2, *opts, metrics_port=port2)
        time.sleep(7.0)  # three active timeouts (2 s) of the second process, traffic on all 60
        _, second = scrape(port2, "/metrics")
        traffic.stop()
        time.sleep(1.5)  # the last bytes polled
        table = lab.conntrack_entries()
        truth = {(c.client_ip, c.client_port): table.for_exchange(c) for c in conns}
        stop_exporter(proc, log2)  # SIGTERM: forced ends for the 40
    finally:
        if traffic is not None:
            traffic.stop()
        if proc.poll() is None:
            proc.kill()
    logs = log1.read_text() + log2.read_text()
    assert "Traceback" not in logs
    assert "continuing: checkpoint" in log2.read_text()
    assert given_up_total(first) == LIVE - CAP  # each extra connection once, no thrash
    assert len(table) == LIVE, [e.raw for e in table]
    assert given_up_total(second) == 0  # the second process gave nothing up: it knew the 20 already
    assert metric_value(second, "flow_exporter_connections_readmitted_total") == 0
    assert metric_value(second, "flow_exporter_connections_restored_total") == CAP  # the 40 continued

    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=LIVE, timeout=60)
    groups = contract.check(records)  # one content per (connectionId, sequence), no gaps
    pairs = {(r["connectionId"], r["sequence"]): r for rs in groups.values() for r in rs}
    given_up = [r for r in pairs.values() if r["flowEndReason"] == LACK_OF_RESOURCES]
    assert len(given_up) == LIVE - CAP, f"{len(given_up)} reason-5 records"
    assert all(r["sequence"] == 0 and r["exportTime"] < stopping for r in given_up)
    gave_up = {(r["sourceAddress"], r["sourcePort"]) for r in given_up}
    assert len(gave_up) == LIVE - CAP and gave_up <= set(truth)
    assert not any(r["flags"] & (ADOPTED | COUNTERS_RESET) for r in records)
    for (ip, port), ct in truth.items():
        assert ct is not None, (ip, port)
        mine = of_client(groups, ip, port)
        assert len(mine) == 1, f"{ip}:{port}: {len(mine)} connectionIds across the restart"
        (rs,) = mine.values()
        if (ip, port) in gave_up:
            # Its one record, before the restart; nothing since, though it kept sending.
            assert [r["flowEndReason"] for r in rs] == [LACK_OF_RESOURCES], (ip, port, rs)
            assert contract.consumer_sum(rs) != ct_counts(ct)  # its later traffic is not exported, as documented
        else:
            assert LACK_OF_RESOURCES not in [r["flowEndReason"] for r in rs]
            assert any(r["exportTime"] > restarted for r in rs)  # continued by the second process
            assert summed(mine) == ct_counts(ct), (ip, port)
    for c in conns:
        c.close()


# --------------------------------------------------------------------------- a DESTROY read after its tombstone died


def _plain(v: Any) -> Any:
    """A decoded timestamp-millis as the long on the wire (readable in a failure message)."""
    return round(v.timestamp() * 1000) if isinstance(v, datetime) else v


class Clock:
    """The exporter's monotonic clock, moved by the test: the tombstone's 60 s pass at once."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class HeldDestroys:
    """Between the event socket and the exporter: NEW events pass at once, DESTROY events wait for ``release``."""

    def __init__(self, exporter: Exporter) -> None:
        self.exporter = exporter
        self.held: list[Connection] = []

    def on_events(self, new: list[Connection], destroyed: list[Connection]) -> None:
        if new:
            self.exporter.apply_events(new, [])
        self.held.extend(destroyed)

    def release(self) -> list[Connection]:
        held, self.held = self.held, []
        self.exporter.apply_events([], held)
        return held


def test_destroy_read_after_its_tombstone_expired_gets_a_new_adopted_connection_id(
    lab: Lab, kafka_broker: Any, kafka_topic: str
) -> None:
    """The exporter's loops driven step by step on real parts; the DESTROY handed over after the tombstone's life.

    The sweep ends the connection with the counters of the last poll; the kernel's final
    counters come only with the DESTROY, read once the store has forgotten the connection
    for good. With nothing left to continue from, they must not reuse the old connectionId
    (at sequence 0, a pair that already has a content): a new connectionId, flagged adopted,
    carries them, and the totals rule gives conntrack's final counters.
    """
    p1, p2, _ = lab.pods
    clock = Clock()
    sink = KafkaSink({"bootstrap.servers": kafka_broker.bootstrap}, kafka_topic, RecordEncoder("late").encode)
    source = ConntrackDumper(netns=lab.node_ns)
    # The real tombstone life (60 s at this poll interval) on a clock the test moves: no 60 s wait,
    # and exporter.store.tombstone_ttl is left as the product sets it.
    exporter = Exporter(source, sink, ExporterOptions(timeouts=Timeouts(1, 1, 1), node_name="late"), clock=clock)
    metrics = Metrics()
    metrics.bind(exporter.readings)
    gate = HeldDestroys(exporter)
    events = ConntrackEvents(gate.on_events, lambda: None, netns=lab.node_ns)  # thread not started

    def poll(after: float) -> None:
        clock.advance(after)
        # A dump begins over 100 ms (the store's margin) after what came before it; the listener
        # reads the NEW events that late too (a lag any listener may have), then is caught up:
        # every NEW applied, every DESTROY held.
        time.sleep(0.15)
        events.drain()
        exporter.poll_once()

    def deliver() -> None:
        exporter.expire_once()
        sink.flush(10)
        exporter._apply_reports()

    ttl = exporter.store.tombstone_ttl
    assert ttl >= 60.0
    try:
        poll(0)  # the exporter runs before the connection starts: nothing found live, nothing adopted
        ex = lab.udp_exchange(p1, p2, 5700, 100, 200, count=2)
        poll(1.1)
        poll(1.1)
        deliver()  # sequence 0
        lab.udp_exchange(p1, p2, 5700, 100, 200, count=3, sport=ex.client_port)
        seen = lab.wait_entry(ex, lambda e: (e.orig_packets or 0) >= 5)
        poll(1.1)  # the store sees these counters: the last a dump shows
        deliver()
        lab.udp_exchange(p1, p2, 5700, 100, 200, count=2, sport=ex.client_port)
        truth = lab.wait_entry(ex, lambda e: (e.orig_packets or 0) >= 7)  # the kernel's final counters
        run_in(lab.node_ns, "conntrack", "-D", "-p", "udp", "--orig-port-src", str(ex.client_port))
        poll(1.1)  # the sweep ends it with the counters last dumped; its DESTROY (the final ones) is held
        deliver()
        assert len(gate.held) == 1 and gate.held[0].orig_sport == ex.client_port
        assert exporter.store.lookup(gate.held[0].key) is None  # reported and forgotten: a tombstone is left
        poll(ttl + 1.0)  # past the tombstone's life: this sweep drops it
        deliver()
        (late,) = gate.release()
        deliver()
        deliver()
        readings = exporter.readings()
        text = generate_latest(metrics.registry).decode()
    finally:
        events.stop()
        source.close()
        sink.flush(10)
    assert ct_counts(truth) == (late.orig_packets, late.orig_bytes, late.reply_packets, late.reply_bytes)
    assert readings.connections_readmitted == 1
    assert readings.late_events_continued == 0  # not continued: nothing was left to continue
    assert metric_value(text, "flow_exporter_connections_readmitted_total") == 1

    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=3)
    groups = contract.check(records)  # one content per (connectionId, sequence), no gaps
    mine = of_client(groups, ex.client_ip, ex.client_port)
    assert len(mine) == 2, mine
    (old,) = [rs for rs in mine.values() if not rs[0]["flags"] & ADOPTED]
    (new,) = [rs for rs in mine.values() if rs[0]["flags"] & ADOPTED]
    # The swept connection: its records stop at the counters the last poll saw.
    assert contract.totals_of(old[-1]) == ct_counts(seen)
    assert old[-1]["flowEndReason"] == END_OF_FLOW
    # The late DESTROY: a new id, its one record with the kernel's final counters, every record of it flagged.
    assert [r["sequence"] for r in new] == [0] and all(r["flags"] & ADOPTED for r in new)
    assert new[0]["flowEndReason"] == END_OF_FLOW
    assert contract.totals_of(new[0]) == ct_counts(truth)
    assert contract.consumer_sum(new) == ct_counts(truth)  # adopted: its deltas hold what the old id told too
    # The totals rule: per conntrack incarnation, the highest totals seen.
    incarnation = ("exporterNode", "zone", "protocol", "sourceAddress", "sourcePort",
                   "destinationAddress", "destinationPort", "ctId", "flowStart")  # fmt: skip
    rows = [r for rs in mine.values() for r in rs]
    differ = [f for f in incarnation if len({r[f] for r in rows}) > 1]
    assert not differ, (
        f"one incarnation, {len({tuple(r[f] for f in incarnation) for r in rows})} totals-rule keys; "
        f"kernel start {late.start_ns // 1_000_000} ms; records (connectionId, sequence, flags, field: value): "
        + repr([(r["connectionId"], r["sequence"], r["flags"], {f: _plain(r[f]) for f in differ}) for r in rows])
    )
    assert max(contract.totals_of(r) for r in rows) == ct_counts(truth)
    assert re.search(r"^flow_exporter_late_destroys_dropped_total 0\.0$", text, re.M)


# --------------------------------------------------------------------------- known only from its NEW at SIGTERM


def test_a_connection_seen_only_through_its_new_event_at_sigterm_keeps_its_connection_id(
    lab: Lab, kafka_broker: Any, kafka_topic: str, tmp_path: Path
) -> None:
    """A TCP connection opened ~0.3 s before SIGTERM, after the exporter's last poll: the exporter knows it only
    from its NEW event (no start stamp). Before, its final record left a checkpoint row without a start; the next
    process's dump showed the kernel's start, the row could not be told from a later incarnation, and the entry
    went on under a new connectionId flagged adopted (the consumer rule counted the final record's packets twice).
    The shutdown's last dump learns the start first: one connectionId across the restart, no flag, conntrack's
    counters exactly."""
    p1, _, p3 = lab.pods
    state = ["--set", f"state.dir={tmp_path / 'state'}"]
    port1, port2 = free_port(), free_port()
    log1, log2 = tmp_path / "run1.log", tmp_path / "run2.log"
    # One poll at start, the next 60 s later: what opens after the first is known from its NEW event only.
    proc = start_exporter(
        lab, kafka_broker.bootstrap, kafka_topic, log1, *state, "--set", "conntrack.pollInterval=60s",
        metrics_port=port1,
    )  # fmt: skip
    conn = None
    try:
        wait_metric(port1, "the first poll", lambda t: metric_value(t, "flow_exporter_polls_total") >= 1)
        conn = lab.open_tcp(p1, p3, 7750)
        conn.send(4000)
        from_events = "flow_exporter_connections_added_from_events_total"
        wait_metric(port1, "its NEW event", lambda t: metric_value(t, from_events) >= 1)
        assert metric_value(scrape(port1, "/metrics")[1], "flow_exporter_polls_total") == 1
        stop_exporter(proc, log1)  # its final record (reason 4), built after the last dump
        conn.send(3000)
        proc = start_exporter(lab, kafka_broker.bootstrap, kafka_topic, log2, *state, metrics_port=port2)
        wait_metric(port2, "a poll", lambda t: metric_value(t, "flow_exporter_polls_total") >= 2)
        conn.send(2000)
        time.sleep(3.0)  # an active timeout (2 s) of the second process: a record of the continued id
        truth = lab.conntrack_entries().for_exchange(conn)
        _, second = scrape(port2, "/metrics")
        stop_exporter(proc, log2)
    finally:
        if proc.poll() is None:
            proc.kill()
        if conn is not None:
            conn.close()
    assert "Traceback" not in log1.read_text() + log2.read_text()
    assert metric_value(second, "flow_exporter_connections_restored_total") == 1
    assert metric_value(second, "flow_exporter_connections_readmitted_total") == 0
    assert truth is not None
    records = read_records(kafka_broker.bootstrap, kafka_topic, expect_at_least=3, timeout=60)
    groups = contract.check(records)
    mine = of_client(groups, conn.client_ip, conn.client_port)
    assert len(mine) == 1, f"{len(mine)} connectionIds across the restart: {mine}"
    (rs,) = mine.values()
    assert rs[0]["flowEndReason"] == 4 and len(rs) >= 3
    assert not any(r["flags"] & ADOPTED for r in rs)
    assert contract.consumer_sum(rs) == ct_counts(truth)
