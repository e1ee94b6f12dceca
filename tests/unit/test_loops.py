"""The poll and expire loops against in-memory ports: a fake table, a fake broker, a fake clock.

What the lab tests check end to end with netlink and a real broker, checked here step by step
and in milliseconds: the records a connection gets over its life, what a failed or refused
delivery does, backpressure, shutdown, and that every counter reaches the metrics endpoint.
Records are decoded with fastavro from the bytes the fake broker accepted, never taken from
the exporter's own objects.
"""

from __future__ import annotations

import dataclasses
import io
import threading
import time

import fastavro
import pytest
from prometheus_client import generate_latest

from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.config import load
from flow_exporter.flow import ACTIVE_TIMEOUT, END_OF_FLOW, FORCED_END, IDLE_TIMEOUT, Export
from flow_exporter.lifecycle import Lifecycle
from flow_exporter.metrics import _CHECKPOINT_FAMILIES, _FAMILIES, Metrics
from flow_exporter.probes import readiness
from flow_exporter.readings import CheckpointReadings, Readings
from flow_exporter.record import load_schema
from flow_exporter.sink.discard import DiscardSink
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.timeouts import Timeouts
from tests.support.fakes import FakeBroker, FakeTable
from tests.support.store_builders import Clock, tcp, udp

SCHEMA = fastavro.parse_schema(load_schema())
TIMEOUTS = Timeouts(poll_interval=1.0, active=5.0, idle=15.0)


def decode(value: bytes) -> dict:
    return fastavro.schemaless_reader(io.BytesIO(value), SCHEMA, SCHEMA)


def rig(**kw: object) -> tuple[Exporter, FakeTable, FakeBroker, Clock]:
    clock = Clock()
    table = FakeTable()
    broker = FakeBroker(RecordEncoder("node-a").encode)
    options = {k: kw.pop(k) for k in list(kw) if k in ExporterOptions.__dataclass_fields__}
    exp = Exporter(table, broker, ExporterOptions(timeouts=TIMEOUTS, node_name="node-a", **options),  # type: ignore[arg-type]
                   clock=lambda: clock.now, wall_ns=clock.wall, **kw)  # type: ignore[arg-type]  # fmt: skip
    return exp, table, broker, clock


def step(exp: Exporter, broker: FakeBroker, clock: Clock, seconds: float = 1.0) -> int:
    """One poll interval: time passes, a poll, the expire loop's turn, the broker answers."""
    clock.tick(seconds)
    exp.poll_once()
    n = exp.expire_once()
    broker.poll(0)
    return n


def records(broker: FakeBroker) -> list[dict]:
    return [decode(a.value) for a in broker.accepted]


def test_a_connection_over_its_life() -> None:
    exp, table, broker, clock = rig()
    table.entries = [tcp(40000, packets=1)]
    for _ in range(6):  # first seen at the first poll: due 5 s later
        step(exp, broker, clock)
    assert [r["flowEndReason"] for r in records(broker)] == [ACTIVE_TIMEOUT]
    table.entries = [tcp(40000, packets=4)]
    for _ in range(5):
        step(exp, broker, clock)
    table.entries = [tcp(40000, packets=6, state=7)]  # TIME_WAIT: the connection is over
    step(exp, broker, clock)
    step(exp, broker, clock)  # the first delivery report is applied on the expire loop's next turn
    recs = records(broker)
    assert [(r["sequence"], r["flowEndReason"]) for r in recs] == [(0, ACTIVE_TIMEOUT), (1, ACTIVE_TIMEOUT),
                                                                   (2, END_OF_FLOW)]  # fmt: skip
    assert [r["packetDeltaCount"] for r in recs] == [1, 3, 2]
    assert [r["octetDeltaCount"] for r in recs] == [100, 300, 200]
    assert [r["reverseOctetDeltaCount"] for r in recs] == [200, 600, 400]
    assert recs[-1]["octetTotalCount"] == 600 and recs[-1]["reverseOctetTotalCount"] == 1200
    assert len({r["connectionId"] for r in recs}) == 1


def test_an_idle_udp_flow_ends_with_its_idle_record() -> None:
    exp, table, broker, clock = rig()
    table.entries = [udp(5353, packets=2)]
    for _ in range(16):
        step(exp, broker, clock)
    recs = records(broker)
    # Active records at 5 s and 10 s (the second with nothing new), idle 15 s after the last change.
    assert [r["flowEndReason"] for r in recs] == [ACTIVE_TIMEOUT, ACTIVE_TIMEOUT, IDLE_TIMEOUT]
    assert [r["packetDeltaCount"] for r in recs] == [2, 0, 0]


def test_a_failed_delivery_is_resent_as_the_same_bytes() -> None:
    exp, table, broker, clock = rig()
    table.entries = [tcp(40001, packets=3)]
    broker.mode = "down"
    for _ in range(6):
        step(exp, broker, clock)
    assert broker.counters.failed == 1 and broker.accepted == []
    first = [e.value for e in exp.store.in_flight()]
    table.entries = [tcp(40001, packets=9)]  # counters move while the broker is down
    broker.mode = "up"
    for _ in range(3):
        step(exp, broker, clock)
    assert [a.value for a in broker.accepted][:1] == first  # the frozen record, not a new one
    r = records(broker)[0]
    assert (r["sequence"], r["packetDeltaCount"]) == (0, 3)
    assert exp.readings().records_resent == 1


def test_a_failing_final_record_goes_again_only_after_its_backoff() -> None:
    """A gone connection's final record that keeps failing is offered once per backoff, not in a tight loop."""
    exp, table, broker, clock = rig()
    table.entries = [udp(40003, packets=2)]
    step(exp, broker, clock)
    table.entries = []  # gone: its end-of-flow record is due at once
    broker.mode = "down"
    exp.poll_once()
    for _ in range(50):  # the expire loop's turns within one instant: no resend before the backoff
        exp.expire_once()
        broker.poll(0)
    assert broker.counters.produced == 1 and broker.counters.failed == 1
    clock.tick(1.0)  # the first backoff (store.RETRY_DELAY)
    for _ in range(50):
        exp.expire_once()
        broker.poll(0)
    assert broker.counters.produced == 2  # once more, the same bytes
    broker.mode = "up"
    clock.tick(2.0)  # the second backoff doubles
    for _ in range(5):
        exp.expire_once()
        broker.poll(0)
    assert [(r["sourcePort"], r["flowEndReason"], r["packetTotalCount"]) for r in records(broker)] == [
        (40003, END_OF_FLOW, 2)]  # fmt: skip
    assert broker.counters.produced == 3 and len(exp.store) == 0


def test_a_refused_record_is_given_up_once_and_counted() -> None:
    exp, table, broker, clock = rig()
    table.entries = [tcp(40002)]
    broker.mode = "refuse"
    for _ in range(12):
        step(exp, broker, clock)
    r = exp.readings()
    assert (r.records_produced, r.records_failed, r.records_given_up, r.records_resent) == (2, 2, 2, 0)
    assert broker.accepted == []


def test_backpressure_holds_due_connections_and_coalesces_them() -> None:
    exp, table, broker, clock = rig(max_in_flight=2)
    table.entries = [tcp(41000 + i) for i in range(5)]
    clock.tick(1)
    exp.poll_once()
    clock.tick(5)
    assert exp.expire_once() == 2  # the rest stays due
    assert exp.expire_once() == 0 and broker.in_flight() == 2
    broker.poll(0)
    assert exp.expire_once() == 2
    broker.poll(0)
    assert exp.expire_once() == 1
    broker.poll(0)
    assert sorted(r["sourcePort"] for r in records(broker)) == [41000 + i for i in range(5)]


def test_the_poll_makes_room_for_the_table_in_one_step() -> None:
    """The store's columns grow to the kernel's count before the dump (not in steps past it); not when zones
    filter the table (the count is every zone's)."""
    exp, table, broker, clock = rig(max_connections=5000)
    table.entries = [tcp(1000 + i % 60000, orig_src=bytes([10, 1, i >> 8, i & 255])) for i in range(3000)]
    step(exp, broker, clock)
    assert len(exp.store) == 3000 and len(exp.store.table._keys) == 3000  # exactly: no slack past the table
    zoned, table, broker, clock = rig(zones=frozenset({0}))
    table.entries = [tcp(2000 + i) for i in range(100)]
    step(zoned, broker, clock)
    assert len(zoned.store) == 100 and len(zoned.store.table._keys) == 1024  # grown in the usual steps


def test_shutdown_sends_every_final_record() -> None:
    exp, table, broker, clock = rig(grace=5.0)
    table.entries = [tcp(42000), udp(5400, packets=4)]
    step(exp, broker, clock)
    assert exp.shutdown() == 0
    recs = records(broker)
    assert sorted((r["sourcePort"], r["flowEndReason"], r["packetDeltaCount"]) for r in recs) == [
        (5400, FORCED_END, 4), (42000, FORCED_END, 1)]  # fmt: skip
    assert dataclasses.astuple(exp.outcome) == (2, 0, 0)


def test_shutdown_sends_the_final_records_within_max_in_flight() -> None:
    """A table larger than limits.maxInFlight: its final records go in rounds, never more in flight than the cap."""
    exp, table, broker, clock = rig(grace=5.0, max_in_flight=3)
    table.entries = [tcp(42100 + i) for i in range(8)] + [udp(5500 + i, packets=2) for i in range(3)]
    step(exp, broker, clock)
    assert exp.shutdown() == 0
    recs = records(broker)
    assert broker.peak_in_flight == 3
    assert sorted(r["sourcePort"] for r in recs) == sorted([42100 + i for i in range(8)] + [5500 + i for i in range(3)])
    assert {r["flowEndReason"] for r in recs} == {FORCED_END}
    assert dataclasses.astuple(exp.outcome) == (11, 0, 0)


def test_shutdown_with_the_discarding_sink_goes_in_rounds_too() -> None:
    """export.flows false: records are settled at once and nothing is ever in flight; the rounds still end."""
    clock = Clock()
    table = FakeTable()
    sink = DiscardSink()
    exp = Exporter(table, sink, ExporterOptions(timeouts=TIMEOUTS, node_name="n", max_in_flight=3, grace=5.0),
                   clock=lambda: clock.now, wall_ns=clock.wall)  # fmt: skip
    table.entries = [tcp(42200 + i) for i in range(11)]
    clock.tick(1)
    exp.poll_once()
    assert exp.shutdown() == 0
    assert (sink.discarded, exp.outcome.final_records, exp.store.unfinished()) == (11, 11, 0)


def test_shutdown_with_the_broker_gone_reports_what_is_lost() -> None:
    exp, table, broker, clock = rig(grace=0.3)
    table.entries = [tcp(42001), tcp(42002)]
    step(exp, broker, clock)
    broker.mode = "down"
    assert exp.shutdown(time.monotonic() + 0.3) == 0
    assert broker.accepted == [] and dataclasses.astuple(exp.outcome) == (2, 0, 2)


def test_a_failing_dump_is_retried_with_backoff() -> None:
    exp, table, _broker, _clock = rig(retry_initial=0.001, retry_max=0.002)
    table.entries = [tcp(43000)]
    table.fail = [OSError(105, "No buffer space"), OSError(105, "No buffer space")]
    exp._poll_with_retry()
    assert (table.dumps, exp.stats.poll_errors, exp.stats.polls, len(exp.store)) == (3, 2, 1, 1)


def test_a_fatal_source_error_stops_the_poll_loop() -> None:
    exp, table, _broker, _clock = rig(is_fatal=lambda e: isinstance(e, PermissionError))
    table.fail = [PermissionError(1, "Operation not permitted")]
    exp.poll_loop()
    assert isinstance(exp.fatal, PermissionError) and exp.stop_event.is_set()


def test_a_fatal_producer_error_means_not_ready_then_flush_and_exit_1() -> None:
    exp, table, broker, clock = rig()
    ready = readiness(exp.lifecycle, lambda: broker.counters.connected, None, lambda: broker.counters.fatal)
    table.entries = [tcp(45000, packets=3)]
    step(exp, broker, clock)
    clock.tick(TIMEOUTS.active)
    exp.poll_once()  # its first record is due
    broker.counters.fatal = "Local: Fatal error: producer epoch fenced"  # as the sink's error_cb sets it
    assert exp.run() == 1
    assert ready() == (False, "kafka producer failed: Local: Fatal error: producer epoch fenced")
    assert "fatal" in str(exp.fatal) and broker.in_flight() == 0  # what was produced was flushed
    assert [(r["sourcePort"], r["sequence"]) for r in records(broker)] == [(45000, 0)]


class FlakyBroker(FakeBroker):
    """A sink whose ``poll`` raises ``fail_polls`` times first: an unexpected error in the expire loop."""

    fail_polls = 2

    def poll(self, timeout: float) -> int:
        if self.fail_polls:
            self.fail_polls -= 1
            raise RuntimeError("unexpected")
        return super().poll(timeout)


def test_the_expire_loop_survives_an_unexpected_error_and_goes_on() -> None:
    clock = Clock()
    table = FakeTable()
    broker = FlakyBroker(RecordEncoder("node-a").encode)
    exp = Exporter(
        table,
        broker,
        ExporterOptions(timeouts=TIMEOUTS, node_name="node-a", retry_initial=0.01, retry_max=0.02),
        clock=lambda: clock.now,
        wall_ns=clock.wall,
    )  # fmt: skip
    table.entries = [tcp(46000, packets=2)]
    exp.poll_once()
    clock.tick(TIMEOUTS.active)
    loop = threading.Thread(target=exp.expire_loop)
    loop.start()
    deadline = time.monotonic() + 10
    while not broker.accepted and time.monotonic() < deadline:
        time.sleep(0.01)
    exp.stop()
    loop.join(5)
    assert exp.stats.expire_errors == 2 and not loop.is_alive()
    assert [(r["sourcePort"], r["sequence"], r["packetDeltaCount"]) for r in records(broker)] == [(46000, 0, 2)]


def test_a_record_that_cannot_be_encoded_is_given_up_and_the_connection_goes_on() -> None:
    encode = RecordEncoder("node-a").encode
    calls = [0]

    def flaky_encode(e: Export, ms: int) -> bytes:
        calls[0] += 1
        if calls[0] == 1:
            raise ValueError("cannot encode this one")
        return encode(e, ms)

    clock = Clock()
    table = FakeTable()
    broker = FakeBroker(flaky_encode)
    exp = Exporter(
        table,
        broker,
        ExporterOptions(timeouts=TIMEOUTS, node_name="node-a"),
        clock=lambda: clock.now,
        wall_ns=clock.wall,
    )  # fmt: skip
    table.entries = [tcp(47000, packets=2)]
    for _ in range(TIMEOUTS.active.__ceil__() + 1):
        step(exp, broker, clock)
    table.entries = [tcp(47000, packets=5)]
    for _ in range(TIMEOUTS.active.__ceil__() + 1):
        step(exp, broker, clock)
    assert exp.stats.records_given_up == 1
    assert [(r["sequence"], r["packetTotalCount"], r["packetDeltaCount"]) for r in records(broker)] == [(1, 5, 3)]


def test_lifecycle_stopping_follows_the_stop_signal_then_the_deadline() -> None:
    now = [0.0]
    life = Lifecycle(clock=lambda: now[0])
    assert not life.stopping()
    life.stop_event.set()
    assert life.stopping()
    life.shutting_down(10.0)  # the final records may still wait for the producer
    assert not life.stopping()
    now[0] = 10.0
    assert life.stopping()
    life.beat("poll")
    now[0] = 15.0
    life.beat("expire")
    assert life.stalled(4.0) == ["poll"]


def test_every_reading_reaches_the_metrics_endpoint() -> None:
    exp, table, broker, clock = rig()
    table.entries = [tcp(44000, packets=2)]
    table.stats = {"early_drop": 4, "insert_failed": 0}
    for _ in range(6):
        step(exp, broker, clock)
    broker.counters.failures_by_error["TOPIC_AUTHORIZATION_FAILED"] = 2  # as the Kafka sink counts them
    metrics = Metrics()
    metrics.bind(lambda: exp.readings({"enrichment_lookups": 3}))
    text = generate_latest(metrics.registry).decode()
    exported = {attr for attr, *_ in _FAMILIES} | {"given_up", "checkpoint", "kafka_client", "extra"}
    exported |= {"zone_entries", "conntrack_kernel", "last_poll_seconds", "source"}  # the health families
    exported |= {"delivery_failures"}
    assert {f.name for f in dataclasses.fields(Readings)} == exported
    assert {attr for attr, *_ in _CHECKPOINT_FAMILIES} == {f.name for f in dataclasses.fields(CheckpointReadings)}
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values["flow_exporter_records_acknowledged_total"] == 1
    assert values["flow_exporter_produced_bytes_total"] == len(broker.accepted[0].value)
    assert values["flow_exporter_polls_total"] == 6
    assert values["flow_exporter_connections_tracked"] == 1
    assert values["flow_exporter_enrichment_lookups_total"] == 3
    assert values['flow_exporter_connections_given_up_total{reason="cap_refused"}'] == 0
    assert values['flow_exporter_conntrack_zone_entries{zone="0"}'] == 1
    assert values['flow_exporter_conntrack_kernel_total{stat="early_drop"}'] == 4
    assert values["flow_exporter_last_poll_seconds"] == exp.stats.last_poll_seconds
    assert values['flow_exporter_delivery_failures_total{error="TOPIC_AUTHORIZATION_FAILED"}'] == 2


def test_settings_and_readiness_reach_the_metrics_endpoint() -> None:
    """The limits the alerts compare readings with, from the config; flow_exporter_ready follows /readyz."""
    cfg = load(
        environ={},
        overrides={"conntrack.pollInterval": "7s", "limits.maxInFlight": 1234, "limits.maxConnections": 99},
    )
    metrics = Metrics(cfg)
    life = Lifecycle()
    connected = [True]
    metrics.bind_ready(lambda: readiness(life, lambda: connected[0])()[0])

    def values() -> dict[str, float]:
        text = generate_latest(metrics.registry).decode()
        return {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines() if not ln.startswith("#")}

    first = values()
    assert first["flow_exporter_poll_interval_seconds"] == 7.0
    assert first["flow_exporter_max_in_flight"] == 1234
    assert first["flow_exporter_max_connections"] == 99
    assert first["flow_exporter_ready"] == 0  # no poll yet
    life.first_poll_done.set()
    assert values()["flow_exporter_ready"] == 1
    connected[0] = False
    assert values()["flow_exporter_ready"] == 0
    defaults = Metrics()  # without a config: the settings' defaults, and no readiness until one is bound
    text = generate_latest(defaults.registry).decode()
    assert "flow_exporter_poll_interval_seconds 5.0" in text.splitlines()
    assert "flow_exporter_ready" not in text


@pytest.fixture(autouse=True)
def _no_threads_left() -> None:
    """The loops here run on the test's thread only: nothing may be left behind."""
    import threading

    before = threading.active_count()
    yield
    assert threading.active_count() == before


class BrokenProducer(FakeBroker):
    """A sink whose producer raises once, unexpectedly, on the second record of a batch."""

    broken = True

    def produce(self, export: Export) -> None:
        if self.broken and len(self.queued) == 1:
            self.broken = False
            raise RuntimeError("the producer broke")
        super().produce(export)


def test_records_a_batch_could_not_hand_over_go_again_as_the_same_records() -> None:
    clock = Clock()
    table = FakeTable()
    broker = BrokenProducer(RecordEncoder("node-a").encode)
    exp = Exporter(
        table, broker, ExporterOptions(timeouts=TIMEOUTS, node_name="node-a"), clock=lambda: clock.now,
        wall_ns=clock.wall,
    )  # fmt: skip
    table.entries = [tcp(47000 + i, packets=2) for i in range(3)]
    exp.poll_once()
    clock.tick(TIMEOUTS.active)
    with pytest.raises(RuntimeError, match="the producer broke"):
        exp.expire_once()
    assert len(broker.queued) == 1  # the first was handed over; the second raised; the third was not tried
    broker.poll(0)
    clock.tick(60)  # past the resend backoff
    table.entries = [tcp(47000 + i, packets=2) for i in range(3)]
    exp.poll_once()
    while exp.expire_once():
        broker.poll(0)
    broker.poll(0)
    exp.expire_once()
    got = records(broker)
    firsts = sorted((r["sourcePort"], r["packetDeltaCount"]) for r in got if r["sequence"] == 0)
    assert firsts == [(47000, 2), (47001, 2), (47002, 2)]  # each connection's first record, once
    assert len({(r["connectionId"], r["sequence"]) for r in got}) == len(got)
