"""Completeness markers' bookkeeping and rounds with plain values (flow_exporter.completeness).

A fake clock and a fake markers topic stand in for time and Kafka, so an outage is a few lines:
markers held in the producer, or failing (some of them written all the same, as a timed-out
request can be), for many intervals, then delivered. What a consumer reads is checked with the
README's marker rule: drop duplicate (exporterNode, topic, partition, since), then sum.
"""

from __future__ import annotations

import io
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import fastavro
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter.completeness import Completeness, Delivered, Losses, MarkerRounds, encode_marker, marker_schema

INTERVAL = 10_000  # ms
TIMED_OUT = "Local: Message timed out"


def plus(a: Losses, b: Losses) -> Losses:
    return Losses(
        a.event_losses + b.event_losses,
        a.connections_given_up + b.connections_given_up,
        a.records_given_up + b.records_given_up,
    )


def decode(value: bytes) -> dict[str, Any]:
    """A marker as a consumer reads it, timestamps back in epoch milliseconds."""
    m = fastavro.schemaless_reader(io.BytesIO(value), marker_schema(), marker_schema())
    for name in ("since", "until", "upTo"):  # timestamp-millis come back as datetimes
        m[name] = round(m[name].timestamp() * 1000)
    return m


@dataclass
class Clock:
    now: int = 0

    def __call__(self) -> int:
        return self.now


@dataclass
class FakeMarkersTopic:
    """A markers topic with its producer: what is produced waits in flight until the test settles it."""

    messages: list[bytes] = field(default_factory=list)  # what reached the topic, copies included
    in_flight: list[tuple[bytes, Delivered]] = field(default_factory=list)
    produced: list[bytes] = field(default_factory=list)  # every produce call's value, resends included
    refuse: bool = False  # produce raises (a full local queue)

    def produce(self, value: bytes, delivered: Delivered) -> None:
        if self.refuse:
            raise BufferError("Local: Queue full")
        self.produced.append(value)
        self.in_flight.append((value, delivered))

    def acknowledge(self, count: int | None = None) -> None:
        """Kafka took the oldest ``count`` (all) markers in flight and said so."""
        self._settle(count, written=True, error=None)

    def fail(self, *, written: bool, count: int | None = None) -> None:
        """The oldest ``count`` (all) deliveries failed; ``written``: the broker had stored them anyway."""
        self._settle(count, written=written, error=TIMED_OUT)

    def _settle(self, count: int | None, *, written: bool, error: str | None) -> None:
        n = len(self.in_flight) if count is None else count
        batch, self.in_flight = self.in_flight[:n], self.in_flight[n:]
        for value, delivered in batch:
            if written:
                self.messages.append(value)
            delivered(error)


@dataclass
class Node:
    """One exporter as the markers see it: flow records produced and acknowledged, losses, the wall clock."""

    clock: Clock = field(default_factory=Clock)
    losses: Losses = field(default_factory=Losses)
    topic: FakeMarkersTopic = field(default_factory=FakeMarkersTopic)
    acked: Counter[int] = field(default_factory=Counter)  # the truth: records acknowledged per partition
    waiting: list[tuple[int, int]] = field(default_factory=list)  # (key, partition) produced, not settled
    next_key: int = 0
    next_offset: Counter[int] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.done = Completeness("flows", started_ms=self.clock.now)
        self.rounds = MarkerRounds(
            self.done, "node-a", self.topic.produce, wall_ms=self.clock, losses=lambda: self.losses
        )

    def export(self, partition: int) -> None:
        self.next_key += 1
        self.done.produced(self.next_key, self.clock.now)
        self.waiting.append((self.next_key, partition))

    def flows_acknowledged(self) -> None:
        for key, partition in self.waiting:
            self.done.settled(key, partition, self.next_offset[partition])
            self.next_offset[partition] += 1
            self.acked[partition] += 1
        self.waiting = []

    def lose(self, events: int = 0, connections: int = 0, records: int = 0) -> None:
        self.losses = plus(self.losses, Losses(events, connections, records))

    def interval(self) -> None:
        """Traffic for one interval (a record to each partition, an event overrun), then the tick."""
        self.export(0)
        self.export(1)
        self.lose(events=3)
        self.clock.now += INTERVAL
        self.rounds.tick()

    def settle_everything(self) -> None:
        """Kafka is back for good: flows acknowledged, the pending round confirmed, then a final round.

        As a stopping exporter does (flush, then a round after the last flush): when this returns,
        every count the node made is in a confirmed round.
        """
        self.flows_acknowledged()
        self.topic.acknowledge()
        if self.rounds.pending is not None:  # markers that failed: the same bytes again
            self.rounds.tick()
            self.topic.acknowledge()
        assert self.rounds.pending is None
        self.clock.now += INTERVAL
        self.rounds.tick()
        self.topic.acknowledge()
        assert self.rounds.pending is None and not self.topic.in_flight


@dataclass
class Read:
    """What a consumer makes of the markers topic by the README's rule."""

    acked: dict[int, int]  # recordsAcknowledged summed per partition (-1 left out)
    losses: Losses  # loss fields summed once per round
    intervals: list[tuple[int, int]]  # the distinct rounds' [since, until), in order
    distinct: int  # markers left after dropping duplicates


def read_by_the_rule(messages: list[bytes]) -> Read:
    """Drop duplicate (exporterNode, topic, partition, since): the copies must be identical; then sum."""
    distinct: dict[tuple[str, str, int, int], dict[str, Any]] = {}
    for value in messages:
        m = decode(value)
        kept = distinct.setdefault((m["exporterNode"], m["topic"], m["partition"], m["since"]), m)
        assert kept == m, "two contents under one identity"
    acked: Counter[int] = Counter()
    rounds: dict[tuple[str, str, int], tuple[int, Losses]] = {}
    for m in distinct.values():
        if m["partition"] >= 0:
            acked[m["partition"]] += m["recordsAcknowledged"]
        node_wide = (m["until"], Losses(m["eventLosses"], m["connectionsGivenUp"], m["recordsGivenUp"]))
        # The node-wide fields are the same in every marker of a round.
        assert rounds.setdefault((m["exporterNode"], m["topic"], m["since"]), node_wide) == node_wide
    total = Losses()
    for _, lost in rounds.values():
        total = plus(total, lost)
    intervals = sorted((since, until) for (_, _, since), (until, _) in rounds.items())
    return Read(dict(acked), total, intervals, len(distinct))


def assert_tiled(intervals: list[tuple[int, int]], start: int, end: int) -> None:
    """The rounds' intervals follow one another from ``start`` to ``end``: no gap, no overlap."""
    assert intervals[0][0] == start and intervals[-1][1] == end
    for (_, until), (since, _) in pairwise(intervals):
        assert since == until
    assert all(since < until for since, until in intervals)


# ------------------------------------------------------------------ bookkeeping


def test_up_to_is_the_oldest_unacknowledged_export_time() -> None:
    c = Completeness("flows", started_ms=1_000)
    (m,) = c.build_round("n", 1_500, Losses()).markers
    assert (m["partition"], m["since"], m["until"], m["upTo"], m["lastOffset"]) == (-1, 1_000, 1_500, 1_500, -1)
    c.produced(1, 1_600)
    c.produced(2, 1_700)
    c.produced(1, 1_900)  # a resend keeps its first export time
    c.settled(2, partition=0, offset=41)
    (m,) = c.build_round("n", 2_000, Losses()).markers
    assert m["upTo"] == 1_600 and m["recordsAcknowledged"] == 1 and m["lastOffset"] == 41
    c.settled(1)  # given up for good: no longer holds upTo back, counted nowhere as acknowledged
    (m,) = c.build_round("n", 2_100, Losses()).markers
    assert m["upTo"] == 2_100 and m["partition"] == 0 and m["recordsAcknowledged"] == 1


def test_only_a_confirmed_round_moves_the_start_and_subtracts_its_counts() -> None:
    c = Completeness("flows", started_ms=0)
    for key, part in ((1, 0), (2, 0), (3, 1)):
        c.produced(key, 10)
        c.settled(key, partition=part, offset=key)
    first = c.build_round("n", 100, Losses(event_losses=5))
    assert [(m["partition"], m["recordsAcknowledged"], m["eventLosses"]) for m in first.markers] == [
        (0, 2, 5),
        (1, 1, 5),
    ]
    c.produced(4, 150)
    c.settled(4, partition=1, offset=9)  # after the round was built: it belongs to the next one
    c.confirmed(first)
    second = c.build_round("n", 200, Losses(event_losses=7, records_given_up=1))
    assert [(m["since"], m["recordsAcknowledged"], m["eventLosses"], m["recordsGivenUp"]) for m in second.markers] == [
        (100, 0, 2, 1),
        (100, 1, 2, 1),
    ]
    c.confirmed(first)  # the same round again (or any round not built from the current start): nothing
    assert c.build_round("n", 300, Losses(event_losses=7, records_given_up=1)).markers[1]["recordsAcknowledged"] == 1


def test_until_stays_after_since_when_the_wall_clock_steps_back() -> None:
    c = Completeness("flows", started_ms=50_000)
    rnd = c.build_round("n", 20_000, Losses())
    assert (rnd.since, rnd.until, rnd.markers[0]["upTo"]) == (50_000, 50_001, 20_000)
    c.confirmed(rnd)
    assert c.build_round("n", 20_010, Losses()).since == 50_001  # a since of its own: the identity holds


def test_markers_encode_with_their_schema() -> None:
    c = Completeness("flows", started_ms=0)
    rnd = c.build_round("node-a", 5, Losses(1, 2, 3))
    assert decode(rnd.values[0]) == rnd.markers[0] == decode(encode_marker(rnd.markers[0]))


# ------------------------------------------------------------------ rounds across an outage


def test_markers_held_by_the_producer_through_an_outage_count_every_interval_once() -> None:
    """librdkafka keeps a message through an outage shorter than message.timeout.ms: no report at all.

    Eight intervals pass with the broker down: the round built at the first of them stays the
    only one in flight, the counts of the outage wait, and the first round after it covers the
    whole outage. Nothing reaches the topic twice, and the sums are the truth.
    """
    node = Node()
    for _ in range(3):
        node.interval()
        node.flows_acknowledged()
        node.topic.acknowledge()
    assert node.rounds.rounds_built == node.rounds.rounds_confirmed == 3
    outage_starts = node.clock.now
    for _ in range(8):
        node.interval()  # records wait, events are lost, markers wait in the producer
    assert node.rounds.rounds_built == 4 and len(node.topic.in_flight) == 2  # one round, two partitions
    held = node.rounds.pending
    assert held is not None and (held.since, held.until) == (outage_starts, outage_starts + INTERVAL)
    assert held.markers[0]["upTo"] == outage_starts  # the outage's first records hold it back
    node.flows_acknowledged()
    node.topic.acknowledge()  # the broker is back: the held round arrives, once
    node.interval()  # the next round: from the held round's until, over the rest of the outage
    assert node.rounds.pending is not None and node.rounds.pending.since == outage_starts + INTERVAL
    node.settle_everything()
    read = read_by_the_rule(node.topic.messages)
    assert read.acked == {0: 12, 1: 12} == dict(node.acked)
    assert read.losses == node.losses == Losses(event_losses=36)
    assert_tiled(read.intervals, 0, node.clock.now)
    assert len(read.intervals) == node.rounds.rounds_built == 6
    # No copy reached the topic: the first round's one marker (partition -1), then two a round.
    assert len(node.topic.messages) == read.distinct == 1 + 2 * 5
    assert node.rounds.markers_resent == 0


def test_markers_failing_for_many_intervals_then_delivered_count_every_interval_once() -> None:
    """Every delivery fails for eight intervals, and half the failed markers were written all the same.

    Each failure is followed by the same bytes again, never by a new round over the same
    interval: the copies on the topic are identical and the rule drops them. Summing every
    message instead would count the round that failed five times.
    """
    node = Node()
    node.interval()
    node.flows_acknowledged()
    node.topic.acknowledge()
    outage_starts = node.clock.now
    for i in range(8):
        node.interval()  # the first builds a round; the rest send its failed markers again
        node.topic.fail(written=i % 2 == 1)
    failing = node.rounds.pending
    assert failing is not None and (failing.since, failing.until) == (outage_starts, outage_starts + INTERVAL)
    assert node.rounds.rounds_built == 2 and node.rounds.markers_resent == 2 * 7
    assert node.topic.produced[1:] == list(failing.values) * 8  # the same bytes, every time
    assert Counter(node.topic.messages[1:]) == dict.fromkeys(failing.values, 4)  # the ones written anyway
    node.settle_everything()  # its markers go once more, are acknowledged; the next round covers the rest
    read = read_by_the_rule(node.topic.messages)
    assert read.acked == {0: 9, 1: 9} == dict(node.acked)
    assert read.losses == node.losses == Losses(event_losses=27)
    assert_tiled(read.intervals, 0, node.clock.now)
    assert node.rounds.rounds_built == len(read.intervals) == 3
    assert read.distinct == 1 + 2 + 2
    # Summing every message instead counts the failing round's copies: five of each of its two
    # markers, one acknowledgement each, where one of each is right.
    naive = sum(decode(v)["recordsAcknowledged"] for v in node.topic.messages)
    assert naive == 9 + 9 + 4 * 2


def test_only_the_failed_marker_of_a_round_goes_again() -> None:
    node = Node()
    node.interval()
    rnd = node.rounds.pending
    assert rnd is not None and [m["partition"] for m in rnd.markers] == [-1]  # nothing acknowledged yet
    node.topic.acknowledge()
    node.flows_acknowledged()
    node.interval()
    rnd = node.rounds.pending
    assert rnd is not None and [m["partition"] for m in rnd.markers] == [0, 1]
    node.topic.acknowledge(1)  # partition 0's marker is in
    node.topic.fail(written=False)  # partition 1's is not
    node.clock.now += INTERVAL
    node.rounds.tick()
    assert node.topic.produced[-1:] == [rnd.values[1]] and node.rounds.pending is rnd
    node.topic.acknowledge()
    assert node.rounds.pending is None and node.rounds.rounds_confirmed == 2
    node.settle_everything()
    read = read_by_the_rule(node.topic.messages)
    assert read.acked == {0: 2, 1: 2} and read.losses == Losses(event_losses=6)
    assert_tiled(read.intervals, 0, node.clock.now)


def test_a_marker_the_producer_refuses_goes_again_and_no_round_is_built_meanwhile() -> None:
    node = Node()
    node.topic.refuse = True
    for _ in range(3):
        node.interval()
    assert node.rounds.rounds_built == 1 and node.topic.produced == []
    node.topic.refuse = False
    node.clock.now += INTERVAL
    node.rounds.tick()
    assert node.rounds.rounds_built == 1 and len(node.topic.produced) == 1
    node.settle_everything()
    read = read_by_the_rule(node.topic.messages)
    assert read.acked == {0: 3, 1: 3} and read.losses == Losses(event_losses=9)
    assert_tiled(read.intervals, 0, node.clock.now)


STEPS = st.sampled_from(
    ["tick", "acknowledge", "fail written", "fail lost", "export", "flows acknowledged", "losses", "clock back"]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(STEPS, max_size=60))
def test_any_order_of_outages_and_deliveries_counts_everything_once(steps: list[str]) -> None:
    """Whatever Kafka does with the markers, the distinct ones hold every count exactly once."""
    node = Node(clock=Clock(1_000_000))
    for step in steps:
        if step == "tick":
            node.clock.now += INTERVAL
            node.rounds.tick()
        elif step == "acknowledge":
            node.topic.acknowledge(1)
        elif step == "fail written":
            node.topic.fail(written=True, count=1)
        elif step == "fail lost":
            node.topic.fail(written=False, count=1)
        elif step == "export":
            node.export(node.next_key % 3)
        elif step == "flows acknowledged":
            node.flows_acknowledged()
        elif step == "losses":
            node.lose(events=1, connections=2, records=3)
        else:  # the wall clock steps back (NTP)
            node.clock.now -= 3 * INTERVAL
    node.clock.now += INTERVAL
    node.settle_everything()
    read = read_by_the_rule(node.topic.messages)
    assert read.acked == dict(node.acked)
    assert read.losses == node.losses
    for (_, until), (since, _) in pairwise(read.intervals):
        assert since == until  # back to back, however the clock moved
    assert read.intervals[0][0] == 1_000_000 and len(read.intervals) == node.rounds.rounds_built
