"""Delivery failures that are not permanent: counted by error code, warned about at most once a minute
per code, and /readyz not ready once a topic's records waited kafka.readyTimeout with no delivery.

The rate limit and the readiness rule run on a fake clock; the sink's wiring runs on a real
librdkafka producer with no broker (its own timeout and purge give real error codes).
"""

from __future__ import annotations

import logging
import time
from typing import Any
from unittest import mock

import pytest

from flow_exporter import compiled
from flow_exporter.delivery import DeliveryHealth, duration_text
from flow_exporter.flow import Export
from flow_exporter.lifecycle import Lifecycle
from flow_exporter.ports import Unsent
from flow_exporter.probes import readiness
from flow_exporter.settings import DEFAULT_SETTINGS, ConfigError
from flow_exporter.sink import KafkaSink, kafka
from flow_exporter.sink.kafka import Route
from flow_exporter.store import ConnectionStore
from tests.support.store_builders import TIME_WAIT, Clock, poll, tcp

# The delivery callbacks and produce loop (flow_exporter/deliveries.py): the built module and its interpreted source.
DELIVERIES = [
    pytest.param(compiled.load("deliveries"), id="built"),
    pytest.param(compiled.interpreted("deliveries", as_name="tests_interpreted_deliveries"), id="interpreted"),
]

AUTH = "TOPIC_AUTHORIZATION_FAILED"
AUTH_TEXT = "Broker: Topic authorization failed"


def health(*topics: str) -> tuple[DeliveryHealth, Clock]:
    clock = Clock()
    return DeliveryHealth(topics or ("flows",), clock=lambda: clock.now), clock


def fail(h: DeliveryHealth, topic: str = "flows", code: str = AUTH, *, produced: bool = True) -> None:
    """One record of ``topic`` refused with ``code``: handed to the producer first unless ``produced`` is False."""
    st = h.topic(topic)
    if produced:
        h.produced(st)
    h.failed(topic, st, code, AUTH_TEXT if code == AUTH else code, pending=produced, permanent=False)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    ours = (r for r in caplog.records if r.name == "flow_exporter.delivery")
    return [r.getMessage() for r in ours if r.levelno == logging.WARNING]


# ------------------------------------------------------------------------------ warnings


def test_a_warning_names_the_code_the_topic_and_the_count_at_most_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h, clock = health("flows", "flows-ended")
    with caplog.at_level(logging.INFO, logger="flow_exporter.delivery"):
        fail(h)  # the first failure of a code is logged at once
        for _ in range(5):
            clock.tick(10)
            fail(h)
        fail(h, "flows-ended")
        assert len(warnings(caplog)) == 1
        first = warnings(caplog)[0]
        assert AUTH in first and AUTH_TEXT in first and "topic flows:" in first
        assert "1 record(s) failed with it since start" in first
        clock.tick(10)  # 60 s after the first warning
        fail(h)
        assert len(warnings(caplog)) == 2
        second = warnings(caplog)[1]
        assert "topic flows, flows-ended:" in second and "7 record(s) failed with it since the last" in second
        clock.tick(59)
        fail(h)
        assert len(warnings(caplog)) == 2  # still within the minute
    assert h.failures == {AUTH: 9}


def test_each_error_code_has_its_own_minute(caplog: pytest.LogCaptureFixture) -> None:
    h, clock = health()
    with caplog.at_level(logging.WARNING, logger="flow_exporter.delivery"):
        fail(h)
        clock.tick(1)
        fail(h, code="_MSG_TIMED_OUT")
        fail(h, code="_MSG_TIMED_OUT")
        fail(h)
    assert [m.split(" ")[4] for m in warnings(caplog)] == [AUTH, "_MSG_TIMED_OUT"]
    assert h.failures == {AUTH: 2, "_MSG_TIMED_OUT": 2}


def test_shutdown_purges_are_counted_but_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    h, _clock = health()
    with caplog.at_level(logging.WARNING, logger="flow_exporter.delivery"):
        for code in ("_PURGE_QUEUE", "_PURGE_INFLIGHT", "_QUEUE_FULL"):
            fail(h, code=code)
    assert warnings(caplog) == [] and h.failures == {"_PURGE_QUEUE": 1, "_PURGE_INFLIGHT": 1, "_QUEUE_FULL": 1}


def test_recovery_is_logged_once_after_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    h, clock = health()
    st = h.topic("flows")
    with caplog.at_level(logging.INFO, logger="flow_exporter.delivery"):
        fail(h)
        clock.tick(42)
        h.produced(st)
        h.delivered("flows", st)
        h.produced(st)
        h.delivered("flows", st)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [f"kafka delivery to topic flows succeeds again (after {AUTH}, 42s without a successful delivery)"]


# ----------------------------------------------------------------------------- readiness

TIMEOUT = DEFAULT_SETTINGS.kafka.ready_timeout


def test_the_default_ready_timeout_is_two_minutes_and_zero_turns_the_rule_off() -> None:
    from flow_exporter.config import load

    assert TIMEOUT == 120.0
    assert load(environ={"FLOW_EXPORTER_KAFKA_READY_TIMEOUT": "0"}).kafka.ready_timeout == 0.0
    assert load(environ={}, overrides={"kafka.readyTimeout": "90s"}).kafka.ready_timeout == 90.0
    with pytest.raises(ConfigError, match=r"kafka\.readyTimeout"):
        load(environ={}, overrides={"kafka.readyTimeout": "-1s"})
    h, clock = health()
    fail(h)
    clock.tick(10 * TIMEOUT)
    assert h.stalled(0) is None


def test_an_idle_exporter_stays_ready_however_long_since_its_last_delivery() -> None:
    h, clock = health()
    st = h.topic("flows")
    h.produced(st)
    h.delivered("flows", st)
    clock.tick(100 * TIMEOUT)
    assert h.stalled(TIMEOUT) is None


def test_failing_records_make_it_not_ready_after_the_timeout_naming_the_last_error() -> None:
    h, clock = health("flows", "flows-ended")
    fail(h)  # the clock starts at the first record that waits
    for _ in range(11):
        clock.tick(TIMEOUT / 12)
        fail(h, produced=False)  # resent, refused by librdkafka before it is queued
        assert h.stalled(TIMEOUT) is None
    clock.tick(TIMEOUT / 12)
    assert h.stalled(TIMEOUT) == (
        f"kafka: no record delivered to topic flows for 2m00s (kafka.readyTimeout 2m00s; last error: {AUTH})"
    )
    st = h.topic("flows")  # the ACL is back: the resend is delivered
    h.produced(st)
    h.delivered("flows", st)
    assert h.stalled(TIMEOUT) is None


def test_records_without_any_report_count_as_waiting_too() -> None:
    h, clock = health()
    st = h.topic("flows")
    h.produced(st)
    clock.tick(TIMEOUT)
    assert h.stalled(TIMEOUT) is not None and "no delivery report yet" in str(h.stalled(TIMEOUT))


def test_a_delivery_restarts_the_clock_for_what_is_still_waiting() -> None:
    h, clock = health()
    st = h.topic("flows")
    h.produced(st)
    h.produced(st)
    clock.tick(TIMEOUT - 1)
    h.delivered("flows", st)  # one of two: the topic works, the other one waits from now
    clock.tick(TIMEOUT - 1)
    assert h.stalled(TIMEOUT) is None
    clock.tick(1)
    assert h.stalled(TIMEOUT) is not None


def test_one_failing_topic_is_not_hidden_by_another_that_delivers() -> None:
    h, clock = health("flows", "flows-ended")
    ok = h.topic("flows")
    fail(h, "flows-ended")
    for _ in range(4):
        clock.tick(TIMEOUT / 3)
        h.produced(ok)
        h.delivered("flows", ok)
    assert "topic flows-ended" in str(h.stalled(TIMEOUT))


def test_a_record_given_up_for_good_does_not_leave_the_exporter_not_ready(caplog: pytest.LogCaptureFixture) -> None:
    h, clock = health()
    st = h.topic("flows")
    with caplog.at_level(logging.WARNING, logger="flow_exporter.delivery"):
        h.produced(st)
        h.failed("flows", st, "MSG_SIZE_TOO_LARGE", "Broker: Message size too large", pending=True, permanent=True)
    clock.tick(10 * TIMEOUT)
    assert h.stalled(TIMEOUT) is None
    assert h.failures == {"MSG_SIZE_TOO_LARGE": 1}
    assert warnings(caplog) == []  # the loops log a given-up record as an error already


def test_readyz_gives_the_stall_reason_after_what_it_still_waits_for() -> None:
    life = Lifecycle()
    reason = "kafka: no record delivered to topic flows for 2m00s (...)"
    check = readiness(life, lambda: True, None, lambda: None, lambda: reason)
    assert check() == (False, "waiting for: first poll")
    life.first_poll_done.set()
    assert check() == (False, reason)
    assert readiness(life, lambda: True, None, lambda: None, lambda: None)() == (True, "ok")
    assert readiness(life, lambda: True)() == (True, "ok")


def test_duration_text() -> None:
    assert [duration_text(s) for s in (0, 42.9, 60, 125, 3600, 3725)] == ["0s", "42s", "1m00s", "2m05s", "1h00m",
                                                                          "1h02m"]  # fmt: skip


# ------------------------------------------------------------------ the sink, on librdkafka


def record() -> Export:
    clock = Clock()
    store = ConnectionStore()
    poll(store, clock, tcp(40000, state=TIME_WAIT))
    (export,) = store.expire(clock.now + 100, clock.wall())
    return export


def serve_until(sink: KafkaSink, done: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():  # type: ignore[operator]
        assert time.monotonic() < deadline, sink.counters
        sink.poll(0.1)


def test_the_sink_counts_failures_by_error_code_and_tells_readiness(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    sink = KafkaSink(
        # No broker listens there: librdkafka times the record out by itself.
        {"bootstrap.servers": "127.0.0.1:9", "message.timeout.ms": 300, "log_level": 0},
        "flows",
        lambda e, ms: b"\x00" * 40,
        clock=lambda: clock.now,
    )
    try:
        with caplog.at_level(logging.WARNING, logger="flow_exporter.delivery"):
            sink.send(record(), 0)
            assert sink.health.stalled(TIMEOUT) is None
            serve_until(sink, lambda: sink.counters.failed == 1)
        (report,) = sink.take_reports()
        assert not report.delivered and not report.permanent
        assert sink.counters.failures_by_error == {"_MSG_TIMED_OUT": 1}
        (warning,) = warnings(caplog)
        assert "_MSG_TIMED_OUT" in warning and "topic flows:" in warning and "1 record(s)" in warning
        clock.tick(TIMEOUT)
        assert "topic flows" in str(sink.health.stalled(TIMEOUT))
        assert "last error: _MSG_TIMED_OUT" in str(sink.health.stalled(TIMEOUT))
    finally:
        sink.purge()
        del sink._producer  # the producer and the sink reference each other (error_cb)


def test_the_sink_counts_a_record_too_large_as_permanent_and_stays_ready() -> None:
    clock = Clock()
    sink = KafkaSink(
        {"bootstrap.servers": "127.0.0.1:9", "message.max.bytes": 1000, "log_level": 0},
        "flows",
        lambda e, ms: b"\x00" * 4000,  # refused by produce() itself
        clock=lambda: clock.now,
    )
    try:
        sink.send(record(), 0)
        (report,) = sink.take_reports()
        assert report.permanent and sink.counters.failures_by_error == {"MSG_SIZE_TOO_LARGE": 1}
        clock.tick(10 * TIMEOUT)
        assert sink.health.stalled(TIMEOUT) is None
    finally:
        del sink._producer


@pytest.mark.parametrize("ready_timeout", ["2m", "0"])
def test_flow_exporter_run_wires_the_rule_into_readyz(ready_timeout: str) -> None:
    """As ``flow-exporter run`` builds it: the sink's delivery health behind /readyz, unless the timeout is 0."""
    from flow_exporter.app import Exporter, ExporterOptions
    from flow_exporter.config import load
    from flow_exporter.metrics import Metrics
    from flow_exporter.runner import build_sink, start_listener, timeouts_from
    from tests.support.exporter_process import scrape
    from tests.support.fakes import FakeTable

    cfg = load(environ={}, overrides={"kafka.bootstrapServers": "127.0.0.1:9", "kafka.readyTimeout": ready_timeout,
                                      "metrics.port": 0, "kafka.producer": {"log_level": 0}})  # fmt: skip
    sink = build_sink(cfg)
    exporter = Exporter(FakeTable(), sink, ExporterOptions(timeouts=timeouts_from(cfg), node_name="node-a"))
    http = start_listener(cfg, Metrics(), exporter)
    assert http is not None
    try:
        clock = Clock()
        sink.health.clock = lambda: clock.now
        exporter.lifecycle.first_poll_done.set()
        sink.counters.connected = True
        fail(sink.health)
        assert scrape(http.port, "/readyz") == (200, "ok\n")
        clock.tick(120)
        status, body = scrape(http.port, "/readyz")
        if ready_timeout == "0":
            assert (status, body) == (200, "ok\n")
        else:
            assert status == 503 and f"topic flows for 2m00s (kafka.readyTimeout 2m00s; last error: {AUTH})" in body
    finally:
        http.stop()
        del sink._producer


@pytest.mark.parametrize("build", DELIVERIES)
def test_a_batch_stops_at_the_first_record_produce_cannot_hand_over(build: Any) -> None:
    """produce_all hands over the records before it, counted once per run; the rest are Unsent from its index."""
    with mock.patch.object(kafka, "_deliveries", build):
        sink = KafkaSink({"bootstrap.servers": "127.0.0.1:9", "log_level": 0}, "flows", lambda e, ms: b"\x00" * 40)
    try:
        batch = [record(), record(), record(), record()]
        for e in batch:
            for _, exc in sink.prepare_all([e], 0):
                raise exc
        batch[2].value = None  # never prepared: produce() refuses it
        with pytest.raises(Unsent) as stopped:
            sink.produce_all(batch)
        assert stopped.value.index == 2 and isinstance(stopped.value.__cause__, AssertionError)
        assert (sink.counters.produced, sink.counters.bytes_produced) == (2, 80)
        assert sink.health.topics["flows"].pending == 2
        sink.purge()  # what librdkafka held comes back as failed reports: exactly the two handed over
        assert [r.export for r in sink.take_reports()] == batch[:2]
    finally:
        sink.purge()
        del sink._producer  # the producer and the sink reference each other (error_cb)


@pytest.mark.parametrize("build", DELIVERIES)
def test_a_batch_to_two_topics_is_counted_per_topic(build: Any) -> None:
    """Runs of records to one topic, then the other, then back; one record for the full path (a full queue)."""
    with mock.patch.object(kafka, "_deliveries", build):
        sink = KafkaSink(
            {"bootstrap.servers": "127.0.0.1:9", "log_level": 0, "queue.buffering.max.messages": 6}, "flows",
            lambda e, ms: b"\x00" * (30 + e.sequence), [Route("ended", end_reason=3)], retry_initial=0.001,
            retry_max=0.002, stopping=lambda: True,
        )  # fmt: skip
    try:
        batch = [record() for _ in range(8)]
        for i, e in enumerate(batch):
            e.sequence = i
            for _, exc in sink.prepare_all([e], 0):
                raise exc
            e.topic = ("flows", "flows", "ended", "ended", "ended", "flows", "ended", "flows")[i]
        sink.produce_all(batch)  # the queue holds 6: the last two are refused at shutdown, reported failed
        assert (sink.counters.produced, sink.counters.bytes_produced) == (6, 6 * 30 + sum(range(6)))
        assert (sink.health.topics["flows"].pending, sink.health.topics["ended"].pending) == (3, 3)
        reports = sink.take_reports()
        assert [(r.export, r.delivered) for r in reports] == [(batch[6], False), (batch[7], False)]
        assert sink.counters.failed == 2
    finally:
        sink.purge()
        del sink._producer
