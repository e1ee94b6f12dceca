"""The delivery callbacks (flow_exporter/deliveries.py): the compiled and the interpreted build of the one source.

Two sinks, one with each build, get the same delivery reports in the same order: records of two topics
delivered, failed (resendable and permanent), with settling (what the sink does after every poll and flush)
at drawn points. After each settle they hold the same reports (record, outcome, error, partition, offset),
the same counters and the same health of every topic; at the end, a report per event in event order and
the counts the events make. No broker: the callbacks are what librdkafka would call.
"""

from __future__ import annotations

from dataclasses import astuple
from typing import Any
from unittest import mock

import pytest
from confluent_kafka import KafkaError
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter import compiled
from flow_exporter.flow import Export
from flow_exporter.ports import Reports
from flow_exporter.sink import kafka
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.sink.kafka import KafkaSink

BUILDS = {
    True: compiled.load("deliveries"),
    False: compiled.interpreted("deliveries", as_name="tests_interpreted_deliveries"),
}

TOPICS = ("flows", "flows-ended")
ERRORS = [KafkaError._MSG_TIMED_OUT, KafkaError.MSG_SIZE_TOO_LARGE, KafkaError._TRANSPORT, KafkaError.INVALID_RECORD]


class Message:
    """What the callbacks read of librdkafka's message: where the record went."""

    def __init__(self, partition: Any, offset: Any) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> Any:
        return self._partition

    def offset(self) -> Any:
        if isinstance(self._offset, Exception):
            raise self._offset
        return self._offset


def sink(built: bool) -> KafkaSink:
    """A sink with the built module (compiled where built) or the interpreted source."""
    with mock.patch.object(kafka, "_deliveries", BUILDS[built]):
        s = KafkaSink({"bootstrap.servers": "127.0.0.1:9"}, TOPICS[0], RecordEncoder("n"), [], clock=lambda: 100.0)
    s.routes = ()  # both topics are the sink's: health has them
    for t in TOPICS:
        s.health.topic(t)
    return s


def state(s: KafkaSink, records: list[Export]) -> tuple[Any, ...]:
    index = {id(e): i for i, e in enumerate(records)}
    d = s._deliveries  # what take_reports would hand over, not taken
    collected = Reports(list(d.delivered), list(d.partitions), list(d.offsets), list(d.failed))
    reports = [(index[id(r.export)], r.delivered, r.error, r.permanent, r.partition, r.offset) for r in collected]
    c = s.counters
    health = {t: astuple(s.health.topic(t)) for t in TOPICS}
    return reports, (c.acked, c.failed, c.connected, dict(c.failures_by_error)), health


# One event: (record's topic, None for delivered or an error code, partition, offset, settle after it).
events = st.lists(
    st.tuples(
        st.sampled_from(TOPICS),
        st.none() | st.sampled_from(ERRORS),
        st.integers(0, 11),
        st.integers(0, 2**62),
        st.booleans(),
    ),
    max_size=40,
)


def test_the_built_module_is_compiled() -> None:
    """make test builds it (tools/setup.sh); the interpreted run (FLOW_EXPORTER_INTERPRETED) loads the source."""
    assert compiled.is_compiled(BUILDS[True]) != compiled.forced_interpreted()
    assert not compiled.is_compiled(BUILDS[False])
    assert isinstance(sink(True)._deliveries, BUILDS[True].Deliveries)


@settings(max_examples=300, deadline=None)
@given(events)
def test_reports_counters_and_health_alike_and_as_reported(evs: list[tuple[str, int | None, int, int, bool]]) -> None:
    records = [Export(1, i, (0,) * 4, (0,) * 4, False, 1, i, 1) for i in range(len(evs))]
    interp, built = sink(False), sink(True)
    for s in (interp, built):
        for t in TOPICS:
            s.health.produced(s.health.topic(t), sum(1 for e in evs if e[0] == t))
    for e, (topic, code, partition, offset, settle) in zip(records, evs, strict=True):
        err = None if code is None else KafkaError(code)
        for s in (interp, built):
            s._callback(e, topic, s.health.topic(topic))(err, Message(partition, offset))
        if settle:
            built._settle()
            interp._settle()
            assert state(built, records) == state(interp, records)
    built._settle()
    interp._settle()
    assert state(built, records) == state(interp, records)
    # ... and what the events say, counted here: a report per record, the delivered ones in event order, then
    # the others in event order; the counts by outcome.
    reports, (acked, failed, _, _), _ = state(built, records)
    want = [(i, code is None, (partition, offset) if code is None else ()) for i, (_, code, partition, offset, _)
            in enumerate(evs)]  # fmt: skip
    assert [(r[0], r[1], r[4:] if r[1] else ()) for r in reports] == [w for w in want if w[1]] + [
        w for w in want if not w[1]
    ]
    assert (acked, failed) == (sum(e[1] is None for e in evs), sum(e[1] is not None for e in evs))


def test_a_failure_settles_the_deliveries_before_it() -> None:
    """Delivered, then failed, on one topic: the topic is failing after both, as in report order."""
    records = [Export(1, i, (0,) * 4, (0,) * 4, False, 1, i, 1) for i in range(3)]
    interp, built = sink(False), sink(True)
    for s in (interp, built):
        st_ = s.health.topic("flows")
        s.health.produced(st_, 3)
        s._callback(records[0], "flows", st_)(None, Message(0, 1))
        s._callback(records[1], "flows", st_)(None, Message(0, 2))
        s._callback(records[2], "flows", st_)(KafkaError(KafkaError._MSG_TIMED_OUT), Message(0, -1))
    assert built.counters.acked == 2  # settled by the failure, before any poll
    assert state(built, records) == state(interp, records)
    assert built.health.topic("flows").last_error == "_MSG_TIMED_OUT"


@pytest.mark.parametrize("hostile", ["offset raises", "odd partition"])
def test_a_message_that_misbehaves_leaves_both_alike(hostile: str) -> None:
    """An offset() that raises: neither sink counts or reports the record; an odd value is reported as it is."""
    records = [Export(1, 0, (0,) * 4, (0,) * 4, False, 1, 0, 1)]
    msg = Message(0, RuntimeError("offset")) if hostile == "offset raises" else Message("p", None)
    outcomes = []
    for s in (sink(False), sink(True)):
        try:
            s._callback(records[0], "flows", s.health.topic("flows"))(None, msg)
            outcomes.append(None)
        except RuntimeError as exc:
            outcomes.append(str(exc))
        s._settle()
        outcomes.append(state(s, records))
    assert outcomes[:2] == outcomes[2:]
    raised, (reports, counts, _) = outcomes[:2]
    if hostile == "offset raises":
        assert (raised, reports, counts[0]) == ("offset", [], 0)  # neither reported nor counted
    else:
        assert (raised, reports, counts[0]) == (None, [(0, True, None, False, "p", None)], 1)
