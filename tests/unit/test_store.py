"""Store and expiry-queue rules (README: How it works) and the accounting contract, driven by a fake clock.

Each race is driven in both orders by hand; a model-based test then runs random
interleavings of kernel activity, polls, events, deliveries and failures, and checks
the contract on everything "Kafka" received against the kernel model's own counters.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flow_exporter.connection import IPS_DYING, Connection
from flow_exporter.expiry import ExpiryQueue
from flow_exporter.flow import (
    ACTIVE_TIMEOUT,
    ADOPTED,
    COUNTERS_RESET,
    END_OF_FLOW,
    FORCED_END,
    IDLE_TIMEOUT,
    LACK_OF_RESOURCES,
    ROW_ENDED,
    ROW_GIVEN_UP,
    Export,
    IdAllocator,
    Restored,
)
from flow_exporter.store import RETRY_DELAY, ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support import contract
from tests.support.kernel_model import Kernel
from tests.support.store_builders import (
    CLOSE,
    CLOSE_WAIT,
    FIN_WAIT,
    LAST_ACK,
    NS,
    TIME_WAIT,
    Clock,
    poll,
    tcp,
    udp,
)


def make(clock: Clock, **kw: float) -> ConnectionStore:
    return ConnectionStore(Timeouts(**kw) if kw else Timeouts())


def expire(store: ConnectionStore, clock: Clock, ack: bool = True) -> list[Export]:
    out = store.expire(clock.now, clock.wall())
    if ack:
        for e in out:
            store.acknowledge(e, True, clock.now)
    return out


def record(e: Export) -> dict[str, Any]:
    """What a consumer decodes from an export (the fields the contract is about)."""
    return {
        "_incarnation": (e.conn_key[3], e.conn.mark) if e.conn is not None and e.conn_key else None,  # test-only
        "connectionId": e.flow_id,
        "sequence": e.sequence,
        "flowEndReason": e.reason,
        **dict(zip(contract.TOTALS, e.totals, strict=True)),
        **dict(zip(contract.DELTAS, e.deltas, strict=True)),
    }


class Kafka:
    """Delivers a store's records like a broker would, including 'failed' ones that were written anyway."""

    def __init__(self, store: ConnectionStore, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self.log: list[dict[str, Any]] = []

    def run(self, outcome: str = "ok") -> list[Export]:
        """One expire pass; ``outcome``: ok, fail (never written) or timeout (written, reported failed)."""
        out = self.store.expire(self.clock.now, self.clock.wall())
        for e in out:
            if outcome in ("ok", "timeout"):
                self.log.append(record(e))
            self.store.acknowledge(e, outcome == "ok", self.clock.now)
        return out

    def drain(self, polls: tuple[Connection, ...] | None = None) -> None:
        """Deliver everything due until nothing is left in flight (ticks the clock)."""
        for _ in range(100):
            self.run()
            if self.store.next_deadline() is None or self.store.next_deadline() > self.clock.now + 60:
                break
            self.clock.tick(RETRY_DELAY * 2)
            if polls is not None:
                poll(self.store, self.clock, *polls)

    def groups(self) -> dict[int, list[dict[str, Any]]]:
        return contract.check(self.log)


# --------------------------------------------------------------------------- Antrea's rules


def test_key_uses_reply_source_as_destination_and_keeps_original() -> None:
    c = tcp()
    assert c.key[4] == bytes([10, 0, 2, 2]) and c.key[5] == 8080
    assert c.orig_dst == bytes([10, 96, 0, 10]) and c.orig_dport == 80


def test_new_connection_exported_at_active_timeout_then_requeued() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=1))
    assert expire(store, clock) == []
    clock.tick(5)
    poll(store, clock, tcp(packets=3))
    (e,) = expire(store, clock)
    assert e.reason == ACTIVE_TIMEOUT and e.sequence == 0
    assert e.totals == (3, 300, 3, 600) and e.deltas == (3, 300, 3, 600)
    clock.tick(5)
    poll(store, clock, tcp(packets=4))
    (e,) = expire(store, clock)
    assert e.reason == ACTIVE_TIMEOUT and e.sequence == 1 and e.deltas == (1, 100, 1, 200)


def test_everything_due_is_exported_without_a_cap() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, *(tcp(sport) for sport in range(1000, 6000)))
    clock.tick(5)
    assert len(expire(store, clock)) == 5000


def test_idle_connection_leaves_queue_and_returns_when_active() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2))
    for _ in range(3):  # 15 s without counters moving
        clock.tick(5)
        poll(store, clock, tcp(packets=2))
        out = expire(store, clock)
    assert [e.reason for e in out] == [IDLE_TIMEOUT]
    key = tcp().key
    assert store.deadlines(key) is None and store.lookup(key).active is False  # type: ignore[union-attr]
    clock.tick(5)
    poll(store, clock, tcp(packets=2))
    assert expire(store, clock) == []
    poll(store, clock, tcp(packets=5))  # active again: back in the queue
    assert store.deadlines(key) is not None and store.lookup(key).active  # type: ignore[union-attr]
    clock.tick(5)
    (e,) = expire(store, clock)
    assert e.reason == ACTIVE_TIMEOUT and e.deltas[0] == 3


def test_tcp_state_change_counts_as_activity() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2))
    clock.tick(5)
    poll(store, clock, tcp(packets=2))
    expire(store, clock)
    clock.tick(5)
    poll(store, clock, tcp(packets=2))
    expire(store, clock)
    deadlines = store.deadlines(tcp().key)
    assert deadlines is not None
    idle_before = deadlines[1]
    poll(store, clock, tcp(packets=2, state=CLOSE_WAIT))
    assert store.deadlines(tcp().key)[1] > idle_before  # type: ignore[index]


@pytest.mark.parametrize("state", [TIME_WAIT, CLOSE])
def test_dying_tcp_gets_end_of_flow_and_later_counts_too(state: int) -> None:
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, tcp(packets=2))
    clock.tick(2)
    poll(store, clock, tcp(packets=6, state=state))
    (e,) = kafka.run()
    assert e.reason == END_OF_FLOW and e.totals[0] == 6 and not e.final  # still in the table
    assert store.deadlines(tcp().key) is None
    poll(store, clock, tcp(packets=6, state=state))  # nothing new: no record
    assert kafka.run() == []
    poll(store, clock, tcp(packets=7, state=state))  # a last ACK in TIME_WAIT still counts
    (e,) = kafka.run()
    assert e.reason == END_OF_FLOW and e.sequence == 1 and e.deltas[0] == 1
    poll(store, clock)  # gone, nothing unreported: forgotten at once
    assert kafka.run() == [] and tcp().key not in store.connections
    (rs,) = kafka.groups().values()
    assert contract.consumer_sum(rs) == (7, 700, 7, 1400)


@pytest.mark.parametrize("state", [FIN_WAIT, CLOSE_WAIT, LAST_ACK])
def test_half_closed_states_are_not_dying(state: int) -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2, state=state))
    clock.tick(5)
    poll(store, clock, tcp(packets=3, state=state))
    (e,) = expire(store, clock)
    assert e.reason == ACTIVE_TIMEOUT


def test_dying_status_bit_for_udp() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, udp(packets=1))
    clock.tick(5)
    poll(store, clock, udp(packets=2, status=IPS_DYING))
    (e,) = expire(store, clock)
    assert e.reason == END_OF_FLOW


def test_connection_gone_from_table_gets_end_of_flow_then_deleted() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, udp(packets=4))
    clock.tick(1)
    poll(store, clock)  # vanished (e.g. conntrack -D)
    clock.tick(4)
    (e,) = expire(store, clock)
    assert e.reason == END_OF_FLOW and e.totals[0] == 4 and e.final
    assert len(store) == 0


def test_vanished_idle_connection_with_nothing_unreported_is_deleted_at_once() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, udp(packets=1))
    for _ in range(3):
        clock.tick(5)
        poll(store, clock, udp(packets=1))
        expire(store, clock)
    assert store.deadlines(udp().key) is None
    poll(store, clock)
    assert len(store) == 0 and expire(store, clock) == []


def test_timeouts_raised_like_antrea() -> None:
    t = Timeouts.normalized(poll_interval=10, active=5, idle=8)
    assert (t.active, t.idle) == (10, 10)
    assert Timeouts.normalized(5, 5, 15) == Timeouts(5, 5, 15)


def test_queue_orders_by_min_deadline_and_updates_lazily() -> None:
    q = ExpiryQueue()
    q.grow(4)
    q.push(0, 10, 30)
    q.push(1, 20, 5)
    q.push(2, 7, 8)
    q.update(0, active_expire=1)
    assert q.next_deadline() == 1
    assert list(q.pop_due(9)) == [0, 1, 2]
    assert len(q) == 0 and q.next_deadline() is None
    q.push(3, 5.0004, 9)  # the heap orders by millisecond; a slot is due only at its exact deadline
    assert list(q.pop_due(5.0003)) == [] and q.next_deadline() == 5.0004
    assert list(q.pop_due(5.0004)) == [3]
    for i in range(1000):
        q.push(3, i, i)  # repeated updates of one slot stay bounded
    assert len(q._heap) < 200


def test_end_of_flow_reported_at_the_poll_that_sees_it() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(1, packets=2), udp(2, packets=1))
    clock.tick(1)
    poll(store, clock, tcp(1, packets=5, state=TIME_WAIT))  # closed; the UDP entry vanished
    out = expire(store, clock)
    assert sorted((e.reason, e.totals[0]) for e in out) == [(END_OF_FLOW, 1), (END_OF_FLOW, 5)]


def test_expire_limit_leaves_the_rest_due() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, *(tcp(3000 + i) for i in range(50)))
    clock.tick(5)
    first = store.expire(clock.now, clock.wall(), limit=20)
    rest = store.expire(clock.now, clock.wall())
    assert len(first) == 20 and len(rest) == 30


def test_shutdown_in_rounds_gives_each_connection_one_final_record() -> None:
    """export_all under a limit: later calls continue the pass; a slot freed meanwhile is skipped (its connection's
    end record settled); a connection whose record was in flight gets its final one, with what came after, once
    that record settles."""
    clock = Clock()
    store = make(clock)
    conns = [tcp(4000 + i, packets=2) for i in range(6)]
    poll(store, clock, *conns)
    clock.tick(1)
    store.apply_events([], [replace(conns[-1], stop_ns=clock.wall())], clock.now, clock.wall())
    (ended,) = store.expire(clock.now, clock.wall())  # its end record, in flight when the shutdown begins
    clock.tick(5)
    (busy,) = store.expire(clock.now, clock.wall(), limit=1)  # in flight too
    assert busy.conn_key is not None and ended.reason == END_OF_FLOW
    moved = [replace(c, orig_packets=9, orig_bytes=900) if c.orig_sport == busy.conn_key[3] else c for c in conns[:-1]]
    poll(store, clock, *moved)  # it moves after its record was built: its final record carries that
    finals: list[Export] = []
    rounds = 0
    while store.unfinished():
        rounds += 1
        out = store.export_all(clock.now, limit=2)
        assert len(out) <= 2
        finals += out
        for e in out:
            store.acknowledge(e, True, clock.now)  # settled: ended and reported, the slot is freed
        if rounds == 1:  # the pass has not reached the last slot yet: it is freed before it does
            store.acknowledge(ended, True, clock.now)
            store.acknowledge(busy, True, clock.now)
        assert rounds < 10
    assert sorted(e.conn_key[3] for e in finals) == [4000 + i for i in range(5)]  # type: ignore[index]
    assert {e.reason for e in finals} == {FORCED_END}
    (last,) = [e for e in finals if e.flow_id == busy.flow_id]
    assert (last.sequence, last.totals[0], last.deltas[0]) == (busy.sequence + 1, 9, 7)
    assert store.export_all(clock.now) == []


def test_shutdown_exports_every_connection_with_forced_end() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(1), tcp(2), udp(3))
    out = store.export_all(clock.now)
    assert sorted(e.reason for e in out) == [FORCED_END] * 3
    assert store.export_all(clock.now) == []  # not twice
    for e in out:
        store.acknowledge(e, True, clock.now)
    assert store.unfinished() == 0


# --------------------------------------------------------------------------- identity


def test_connection_ids_are_allocated_distinct_and_never_derived() -> None:
    """A Weyl sequence through a bijection: no repeat within an allocator, and seeds that differ give other ids."""
    ids = IdAllocator(b"\x00" * 8)
    drawn = [ids() for _ in range(200_000)]
    assert len(set(drawn)) == len(drawn) and ids.allocated == len(drawn)
    assert all(-(2**63) <= i < 2**63 for i in drawn)
    assert drawn[:3] == [IdAllocator(b"\x00" * 8)() for _ in range(1)] + drawn[1:3]  # the seed alone decides
    other = IdAllocator(b"\x00" * 7 + b"\x01")
    assert not set(drawn[:1000]) & {other() for _ in range(1000)}
    # the same incarnation, forgotten and met again, is never given its old id
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2))
    first = store.lookup(tcp().key).flow_id  # type: ignore[union-attr]
    clock.tick(5)
    poll(store, clock)  # a dump that misses it: swept and reported
    expire(store, clock)
    clock.tick(store.tombstone_ttl + 5)
    poll(store, clock)  # the tombstone is gone
    poll(store, clock, tcp(packets=2))
    again = store.lookup(tcp().key)
    assert again is not None and again.flow_id != first and again.next_seq == 0


def test_reused_tuple_ends_old_connection() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=3))
    clock.tick(2)
    poll(store, clock, tcp(packets=1, ct_id=99, start_ns=1001 * NS))
    out = expire(store, clock)
    assert [(e.reason, e.totals[0]) for e in out] == [(END_OF_FLOW, 3)]
    assert out[0].flow_id != store.lookup(tcp().key).flow_id  # type: ignore[union-attr]


def test_reused_conntrack_id_is_a_new_connection() -> None:
    """Fixed-port UDP (DNS, VXLAN): the kernel can give the re-created tuple the same id; the start differs."""
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    first = udp(53, packets=2, start_ns=998 * NS)
    poll(store, clock, first)
    store.apply_events([], [first], clock.now, clock.wall())
    store.apply_events([replace(first, orig_packets=0, reply_packets=0, start_ns=0)], [], clock.now, clock.wall())
    second = udp(53, packets=5, start_ns=999 * NS)  # before its NEW was read
    clock.tick(5)
    poll(store, clock, second)
    kafka.drain()
    store.apply_events([], [second], clock.now, clock.wall())
    kafka.drain()
    groups = kafka.groups()
    assert sorted(contract.consumer_sum(rs)[0] for rs in groups.values()) == [2, 5]


def test_reused_conntrack_id_without_timestamps_told_apart_by_events() -> None:
    """Timestamps off: same tuple, same id, no start time. DESTROY then NEW still say it is new."""
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    first = udp(53, packets=2, start_ns=0)
    poll(store, clock, first)
    store.apply_events([], [first], clock.now, clock.wall())
    store.apply_events([udp(53, packets=0, start_ns=0)], [], clock.now, clock.wall())
    clock.tick(5)
    poll(store, clock, udp(53, packets=3, start_ns=0))
    store.apply_events([], [udp(53, packets=4, start_ns=0)], clock.now, clock.wall())
    kafka.drain()
    groups = kafka.groups()
    assert sorted(contract.consumer_sum(rs)[0] for rs in groups.values()) == [2, 4]


# --------------------------------------------------------------------------- failed deliveries


def test_failed_record_is_resent_as_the_same_record_and_new_counts_wait() -> None:
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, tcp(packets=2))
    clock.tick(5)
    poll(store, clock, tcp(packets=2))
    (first,) = kafka.run("timeout")  # librdkafka timed out, but the broker wrote it
    clock.tick(5)
    poll(store, clock, tcp(packets=5))
    (again,) = kafka.run("fail")
    assert again is first  # the same record, not one with the new counts
    clock.tick(RETRY_DELAY * 2)
    (again,) = kafka.run("ok")
    assert again is first and first.deltas == (2, 200, 2, 400)
    clock.tick(5)
    (second,) = kafka.run("ok")
    assert second.sequence == 1 and second.deltas == (3, 300, 3, 600)
    (rs,) = kafka.groups().values()
    assert contract.consumer_sum(rs) == (5, 500, 5, 1000)
    assert len(kafka.log) == 3  # the duplicate pair is identical: contract.check accepted it


def test_one_record_in_flight_per_connection() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2))
    clock.tick(5)
    poll(store, clock, tcp(packets=3))
    (first,) = expire(store, clock, ack=False)
    clock.tick(5)
    poll(store, clock, tcp(packets=4))
    assert expire(store, clock, ack=False) == []  # previous one not settled yet
    store.acknowledge(first, True, clock.now)
    clock.tick(1)
    (second,) = expire(store, clock)
    assert second.sequence == 1 and second.deltas[0] == 1


def test_record_refused_for_good_is_not_resent_and_the_next_continues() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2))
    clock.tick(5)
    poll(store, clock, tcp(packets=2))
    (first,) = store.expire(clock.now, clock.wall())
    store.acknowledge(first, False, clock.now, permanent=True)
    clock.tick(5)
    poll(store, clock, tcp(packets=3))
    (second,) = expire(store, clock)
    assert second is not first and second.sequence == 1 and second.deltas[0] == 1


def test_shutdown_waits_for_records_in_flight_and_resends_failed_ones() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(1, packets=2), tcp(2, packets=2))
    clock.tick(5)
    a, b = store.expire(clock.now, clock.wall())
    store.acknowledge(a, False, clock.now)  # failed: waits for its resend
    poll(store, clock, tcp(1, packets=4), tcp(2, packets=4))
    out = store.export_all(clock.now)
    assert a in out and all(e.slot != b.slot for e in out)  # b is in flight: its turn comes later
    for e in out:
        store.acknowledge(e, True, clock.now)
    assert store.unfinished() == 2
    store.acknowledge(b, True, clock.now)
    last = store.export_all(clock.now)  # both settled: their forced ends carry what came after
    assert sorted((e.reason, e.sequence, e.deltas[0]) for e in last) == [(FORCED_END, 1, 2)] * 2
    for e in last:
        store.acknowledge(e, True, clock.now)
    assert store.unfinished() == 0 and store.export_all(clock.now) == []


# --------------------------------------------------------------------------- sweep and DESTROY races


def test_destroy_event_between_polls_gets_end_of_flow_with_final_counters() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(1, packets=2))
    short = replace(udp(9, packets=4), stop_ns=clock.wall())  # born and gone between polls
    store.apply_events(
        [], [short, replace(tcp(1, packets=7, state=TIME_WAIT), stop_ns=clock.wall())], clock.now, clock.wall()
    )
    poll(store, clock, tcp(1, packets=5))  # a dump taken before the event: must not undo it
    out = expire(store, clock)
    assert sorted((e.reason, e.totals[0], e.final) for e in out) == [(END_OF_FLOW, 4, True), (END_OF_FLOW, 7, True)]
    poll(store, clock)
    assert len(store) == 0


@pytest.mark.parametrize("order", ["destroy-then-sweep", "sweep-then-destroy"])
def test_sweep_and_destroy_race_counts_once_in_both_orders(order: str) -> None:
    """A flow ends between two polls; its DESTROY is read before or after the sweep that misses it."""
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, udp(9, packets=1))
    clock.tick(5)
    poll(store, clock, udp(9, packets=2))
    kafka.run()  # sequence 0: 2 packets
    final = replace(udp(9, packets=6), stop_ns=clock.wall())  # 4 more packets, then deleted
    clock.tick(1)
    if order == "destroy-then-sweep":
        store.apply_events([], [final], clock.now, clock.wall())
        poll(store, clock)
        kafka.run()
    else:
        poll(store, clock)  # sweep first: ends it with the last polled counters
        kafka.run()
        assert len(store) == 0  # reported and forgotten, but remembered in a tombstone
        store.apply_events([], [final], clock.now, clock.wall())
        kafka.run()
    (rs,) = kafka.groups().values()
    assert contract.consumer_sum(rs) == (6, 600, 6, 1200)
    assert rs[-1]["flowEndReason"] == END_OF_FLOW


def test_late_destroy_with_nothing_new_adds_no_record() -> None:
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, udp(9, packets=3))
    poll(store, clock)
    kafka.run()
    store.apply_events([], [udp(9, packets=3)], clock.now, clock.wall())
    assert kafka.run() == [] and store.stats.late_destroys_dropped == 1
    assert len(kafka.log) == 1


def test_new_event_only_connection_swept_with_zero_counters_then_destroy_gives_the_counts() -> None:
    """Under event bursts the sweep can run before the DESTROY is read: the DESTROY continues the sequence."""
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    store.apply_events([udp(9, packets=0)], [], clock.now, clock.wall())
    poll(store, clock)  # gone before the dump
    (first,) = kafka.run()
    assert first.totals == (0, 0, 0, 0) and first.final
    store.apply_events([], [udp(9, packets=3)], clock.now, clock.wall())
    (second,) = kafka.run()
    assert second.sequence == 1 and second.deltas[0] == 3 and second.final
    (rs,) = kafka.groups().values()
    assert contract.consumer_sum(rs) == (3, 300, 3, 600)


def test_time_wait_end_then_destroy_does_not_start_over() -> None:
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, tcp(packets=4))
    poll(store, clock, tcp(packets=5, state=TIME_WAIT))
    kafka.run()
    poll(store, clock)  # TIME_WAIT over: left the table
    store.apply_events([], [tcp(packets=5, state=TIME_WAIT)], clock.now, clock.wall())
    kafka.run()
    (rs,) = kafka.groups().values()
    assert [r["sequence"] for r in rs] == [0] and contract.consumer_sum(rs)[0] == 5


def test_dump_row_missed_once_continues_the_same_connection() -> None:
    """A dump can miss an entry (table resize): the next dump's row continues its sequence."""
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, tcp(packets=2))
    poll(store, clock)  # missed
    kafka.run()
    clock.tick(1)
    poll(store, clock, tcp(packets=3))
    clock.tick(5)
    poll(store, clock, tcp(packets=4))
    kafka.run()
    (rs,) = kafka.groups().values()
    assert [r["sequence"] for r in rs] == [0, 1] and contract.consumer_sum(rs)[0] == 4


def test_late_new_event_after_sweep_is_not_a_new_connection() -> None:
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, udp(9, packets=2))
    poll(store, clock)
    kafka.run()
    store.apply_events([udp(9, packets=0)], [udp(9, packets=2)], clock.now, clock.wall())  # NEW read late
    assert kafka.run() == [] and len(store) == 0


def test_destroy_without_counters_never_lowers_totals() -> None:
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, udp(9, packets=5))
    store.apply_events([], [udp(9, packets=0)], clock.now, clock.wall())  # accounting off in the event
    (e,) = kafka.run()
    assert e.totals == (5, 500, 5, 1000) and e.final


# --------------------------------------------------------------------------- counter resets


def test_counters_going_down_start_a_new_connection_id() -> None:
    clock = Clock()
    store = make(clock)
    kafka = Kafka(store, clock)
    poll(store, clock, tcp(packets=5))
    clock.tick(5)
    poll(store, clock, tcp(packets=6))
    kafka.run()
    poll(store, clock, tcp(packets=8))
    clock.tick(1)
    poll(store, clock, tcp(packets=1))  # conntrack -Z, one packet since
    kafka.run()
    clock.tick(5)
    poll(store, clock, tcp(packets=3))
    kafka.run()
    groups = kafka.groups()
    assert len(groups) == 2
    old, new = sorted(groups.values(), key=len, reverse=True)
    assert contract.consumer_sum(old) == (8, 800, 8, 1600) and old[-1]["flowEndReason"] == FORCED_END
    assert contract.consumer_sum(new) == (3, 300, 3, 600)
    assert store.lookup(tcp().key).flags & COUNTERS_RESET  # type: ignore[union-attr] and store.stats.counter_resets == 1


# --------------------------------------------------------------------------- the cap


def test_table_larger_than_cap_gives_each_extra_connection_up_once() -> None:
    clock = Clock()
    store = ConnectionStore(Timeouts(), max_connections=40)
    kafka = Kafka(store, clock)
    table = [tcp(2000 + i, packets=1) for i in range(60)]
    for step in range(12):  # a minute of polls, all connections active
        table = [replace(c, orig_packets=c.orig_packets + 1, reply_packets=c.reply_packets + 1) for c in table]
        poll(store, clock, *table)
        kafka.run()
        clock.tick(5)
        assert len(store.connections) == 40, step
    given = [r for r in kafka.log if r["flowEndReason"] == LACK_OF_RESOURCES]
    assert len(given) == 20 and sum(store.stats.given_up.values()) == 20  # once each, no thrash
    assert all(r["sequence"] == 0 for r in given)
    tracked = {r["connectionId"] for r in kafka.log} - {r["connectionId"] for r in given}
    assert len(tracked) == 40  # the tracked ones keep being exported
    groups = kafka.groups()
    assert all(len(groups[c]) >= 10 for c in tracked)


def test_cap_makes_room_from_an_idle_connection_with_nothing_unreported() -> None:
    clock = Clock()
    store = ConnectionStore(Timeouts(), max_connections=2)
    kafka = Kafka(store, clock)
    poll(store, clock, udp(1, packets=1), udp(2, packets=1))
    for _ in range(3):  # both idle and fully reported
        clock.tick(5)
        poll(store, clock, udp(1, packets=1), udp(2, packets=1))
        kafka.run()
    poll(store, clock, udp(1, packets=1), udp(2, packets=1), udp(3, packets=1))
    kafka.run()
    assert udp(3).key in store.connections and store.stats.given_up == {"cap_idle": 1}
    (gone,) = [r for r in kafka.log if r["flowEndReason"] == LACK_OF_RESOURCES]
    assert gone["sequence"] > 0 and contract.consumer_sum([gone]) == (0, 0, 0, 0)  # nothing was unreported
    poll(store, clock, udp(1, packets=2), udp(2, packets=2), udp(3, packets=1))
    assert len(store.connections) == 2 and sum(store.stats.given_up.values()) == 1  # not taken back


def test_a_new_event_at_the_cap_gives_nothing_up_the_dump_does_with_the_kernels_start() -> None:
    """A NEW carries no start stamp: a given-up entry named by none could not be told, after a restart, from a
    later incarnation of its tuple with the same conntrack id. The next dump gives it up, start and all."""
    clock = Clock()
    store = ConnectionStore(Timeouts(), max_connections=1)
    kafka = Kafka(store, clock)
    poll(store, clock, udp(1, packets=1))
    late = udp(2, packets=3, ct_id=7, start_ns=clock.wall() - 1)
    store.apply_events([replace(late, start_ns=0, orig_packets=0, orig_bytes=0)], [], clock.now, clock.wall())
    kafka.run()
    assert store.stats.given_up == {} and not [r for r in kafka.log if r["flowEndReason"] == LACK_OF_RESOURCES]
    poll(store, clock, udp(1, packets=1), late)
    assert store.stats.given_up == {"cap_refused": 1}
    kafka.run()
    (given,) = [r for r in kafka.log if r["flowEndReason"] == LACK_OF_RESOURCES]
    assert contract.consumer_sum([given])[0] == 3  # the row's counts, which the NEW did not have
    (row,) = [r for r in store.reported().rest if r.flags & ROW_GIVEN_UP]  # written once its record is built
    assert (row.ct_id, row.start_ns) == (7, late.start_ns)


def test_a_start_less_given_up_row_of_an_earlier_release_is_ambiguous_to_a_row_that_started_before_it() -> None:
    """Earlier releases gave connections up at their NEW and wrote them without a start. The first dump's row of
    that tuple and id, started before the entry was first seen, may be a later incarnation whose predecessor's
    DESTROY died unread: tracked under a new id, flagged adopted, never taken for the given-up one (which would
    never report it); a row started after it is plainly new, and the given-up entry stays."""
    clock = Clock()
    first_seen = clock.wall()
    key = udp(2).key
    rows = [Restored(key, 7, 0, first_seen, 99, 1, (0, 0, 0, 0), ROW_GIVEN_UP)]
    store = ConnectionStore(Timeouts())
    store.restore(rows, [])
    clock.tick(1)
    poll(store, clock, udp(2, packets=4, ct_id=7, start_ns=first_seen - 10**6))
    conn = store.lookup(key)
    assert conn is not None and conn.flags & ADOPTED and conn.flow_id != 99
    store3 = ConnectionStore(Timeouts())
    store3.restore([Restored(key, 7, first_seen - 10**6, first_seen, 99, 1, (0, 0, 0, 0), ROW_GIVEN_UP)], [])
    poll(store3, clock, udp(2, packets=4, ct_id=7, start_ns=first_seen - 10**6))
    assert store3.lookup(key) is None  # a row named by its start is that entry: still given up


# --------------------------------------------------------------------------- restarts


def test_restart_continues_from_the_checkpoint_rows_and_resends() -> None:
    clock = Clock()
    old = ConnectionStore(Timeouts(), adopt=False)
    kafka = Kafka(old, clock)
    poll(old, clock, tcp(1, packets=2), tcp(2, packets=2))
    clock.tick(5)
    poll(old, clock, tcp(1, packets=3), tcp(2, packets=3))
    out = old.expire(clock.now, clock.wall())
    old.acknowledge(out[0], True, clock.now)  # the other one's delivery is unknown when the process dies
    kafka.log.append(record(out[0]))
    kafka.log.append(record(out[1]))  # ... and it did reach Kafka
    rows = [Restored(*r) for r in old.reported()]
    resends = [replace(e, slot=-1) for e in old.in_flight()]  # as the checkpoint gives them back
    assert [e.flow_id for e in resends] == [out[1].flow_id]

    new = ConnectionStore(Timeouts())
    new.restore(rows, resends)
    kafka.store = new
    poll(new, clock, tcp(1, packets=9), tcp(2, packets=9), tcp(3, packets=1))
    (again,) = kafka.run()
    assert again is resends[0]  # the same record first
    clock.tick(5)
    kafka.run()
    groups = kafka.groups()
    assert {contract.consumer_sum(rs)[0] for rs in groups.values()} == {9, 1}
    assert all(r["sequence"] in (0, 1) for r in kafka.log)
    assert not any(new.lookup(k).flags & ADOPTED for k in new.connections)  # type: ignore[union-attr]
    assert new.stats.restored == 2 and new.unfinished() == 3  # nothing in flight; three live connections


def test_without_state_connections_found_live_are_flagged_adopted() -> None:
    clock = Clock()
    store = make(clock)
    store.apply_events([udp(7, packets=0)], [], clock.now, clock.wall())  # new while we watch
    poll(store, clock, tcp(1, packets=4), udp(7, packets=1))
    clock.tick(1)
    poll(store, clock, tcp(1, packets=4), tcp(2, packets=1, start_ns=clock.wall() - 1), udp(7, packets=1))
    flags = {k[3]: store.lookup(k).flags for k in store.connections}  # type: ignore[union-attr]
    assert flags == {1: ADOPTED, 2: 0, 7: 0}


def test_restored_rows_gone_from_the_table_become_tombstones_a_late_destroy_continues() -> None:
    """A row no first dump shows ended while no exporter ran, or just before the dump: its DESTROY may still come."""
    clock = Clock()
    old = ConnectionStore(Timeouts())
    poll(old, clock, tcp(1, packets=2))
    clock.tick(5)
    (first,) = expire(old, clock)
    new = ConnectionStore(Timeouts())
    new.restore([Restored(*r) for r in old.reported()], [])
    assert len(list(new.reported())) == 1  # kept until a dump decides
    poll(new, clock)
    (row,) = new.reported()
    assert row.flags & ROW_ENDED and row.flow_id == first.flow_id and new.stats.restored_gone == 1
    new.apply_events([], [tcp(1, packets=5)], clock.now, clock.wall())  # the listener reads its DESTROY late
    (last,) = expire(new, clock)
    assert (last.flow_id, last.sequence, last.reason) == (first.flow_id, 1, END_OF_FLOW)
    assert last.deltas == (3, 300, 3, 600)


# --------------------------------------------------------------------------- the model


RACE = [  # the sweep misses a flow whose DESTROY is read only after its final record went out
    ("create", 1, 1), ("traffic", 1, 2), ("poll", 0, 0), ("traffic", 1, 3), ("destroy", 1, 0),
    ("poll", 0, 0), ("export", "ok", 0), ("events", 3, 0),
]


# MODEL_EXAMPLES=200000 for a long, random search; the suite runs the same 300 every time
# (derandomized), so a run passes or fails for the code, not the draw.
@settings(
    max_examples=int(os.environ.get("MODEL_EXAMPLES", "300")),
    derandomize="MODEL_EXAMPLES" not in os.environ,
    database=None if "MODEL_EXAMPLES" not in os.environ else settings.default.database,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@example(RACE)
@example([("create", 1, 1), ("traffic", 1, 2), ("poll", 0, 0), ("destroy", 1, 0), ("create", 1, 1), ("poll", 0, 0)])
@example(  # found by a 20,000-example search: NEW read, DESTROY read late, the id reused by a new entry
    [("create", 2, 1), ("destroy", 2, 0), ("events", 1, 0), ("poll", 0, 0), ("create", 2, 1), ("export", "ok", 0)]
)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.just("create"), st.integers(1, 3), st.integers(1, 2)),
            st.tuples(st.just("traffic"), st.integers(1, 3), st.integers(1, 5)),
            st.tuples(st.just("destroy"), st.integers(1, 3), st.just(0)),
            st.tuples(st.just("zero"), st.integers(1, 3), st.just(0)),
            st.tuples(st.just("poll"), st.just(0), st.just(0)),
            st.tuples(st.just("events"), st.integers(0, 3), st.just(0)),
            st.tuples(st.just("export"), st.sampled_from(["ok", "fail", "timeout"]), st.just(0)),
            st.tuples(st.just("tick"), st.sampled_from([1, 5]), st.just(0)),
        ),
        max_size=60,
    )
)
def test_model_every_packet_counted_exactly_once(ops: list[tuple[str, Any, int]]) -> None:
    """Random interleavings: the consumer rule gives each incarnation's kernel counters, exactly."""
    clock = Clock()
    store = ConnectionStore(Timeouts(poll_interval=1, active=5, idle=15))
    kafka = Kafka(store, clock)
    kern = Kernel(clock)
    ended: list[Connection] = []

    def read(n: int | None = None) -> None:
        take = kern.events[: len(kern.events) if n is None else n]
        del kern.events[: len(take)]
        for kind, c in take:
            if kind == "destroy":
                ended.append(c)
            store.apply_events([c] if kind == "new" else [], [c] if kind == "destroy" else [], clock.now, clock.wall())

    for op, a, b in ops:
        clock.tick(0.001)  # a real clock moves on between any two things the kernel or the exporter does
        if op == "create":
            kern.create(a, b)
        elif op == "traffic":
            kern.traffic(a, b)
        elif op == "destroy":
            kern.destroy(a)
        elif op == "zero":  # polls around it: a reset hidden by newer counts, or counts between
            poll(store, clock, *kern.live.values())  # the last poll and a reset, cannot be seen
            kern.zero(a)
            poll(store, clock, *kern.live.values())
        elif op == "poll":
            poll(store, clock, *kern.live.values())
        elif op == "events":
            read(a)
        elif op == "export":
            kafka.run(a)
        else:
            read()  # the listener keeps up within a tombstone's lifetime
            clock.tick(a)
    read()
    poll(store, clock, *kern.live.values())
    kafka.drain(tuple(kern.live.values()))
    for _ in range(20):  # shutdown, delivering everything
        out = store.export_all(clock.now)
        for e in out:
            kafka.log.append(record(e))
            store.acknowledge(e, True, clock.now)
        clock.tick(RETRY_DELAY * 2)
        if store.unfinished() == 0:
            break
    assert store.unfinished() == 0
    groups = kafka.groups()  # the contract: one content per pair, no gaps, deltas add up
    counted: dict[tuple[int, int], int] = {}
    for rs in groups.values():
        inc = rs[0]["_incarnation"]
        assert all(r["_incarnation"] == inc for r in rs)  # a connectionId never spans two incarnations
        counted[inc] = counted.get(inc, 0) + contract.consumer_sum(rs)[0]
    truth = {(c.orig_sport, c.mark): c.orig_packets + kern.zeroed.get(c.mark, 0) for c in [*ended, *kern.live.values()]}
    assert {k: v for k, v in counted.items() if v} == {k: v for k, v in truth.items() if v}


# --------------------------------------------------------------------------- counter fidelity


def test_fidelity_flags_reach_the_encoded_records() -> None:
    """No counters (accounting off) from the first record; offload from the record after it began.

    Decoded from the encoder's real bytes, so a cached prefix holding old flags would show.
    """
    from flow_exporter.connection import IPS_OFFLOAD
    from flow_exporter.flow import NO_COUNTERS, OFFLOADED
    from flow_exporter.sink.encoder import RecordEncoder
    from tests.support.reference import AvroSerializer

    clock = Clock()
    store = make(clock)
    encoder, avro = RecordEncoder("n"), AvroSerializer()
    decoded: list[dict[str, Any]] = []

    def deliver() -> None:
        for e in store.expire(clock.now, clock.wall()):
            decoded.append(avro.decode(encoder.encode(e, 0)))
            store.acknowledge(e, True, clock.now)  # keeps the prefix for the next record

    counted = tcp(41000, packets=3)
    uncounted = tcp(41001, packets=0, counted=False)  # acct off: no counter attributes at all
    for step in range(4):
        offload = IPS_OFFLOAD if step >= 2 else 0
        counted = replace(counted, orig_packets=counted.orig_packets + 1, status=offload)
        poll(store, clock, counted, uncounted)
        clock.tick(61)  # past the active timeout: one record each per step
        deliver()
    by_port: dict[int, list[int]] = {}
    for r in decoded:
        by_port.setdefault(r["sourcePort"], []).append(r["flags"] & ~ADOPTED)  # this store adopts what it finds
    assert by_port[41001] and by_port[41001] == [NO_COUNTERS] * len(by_port[41001])
    flags = by_port[41000]
    first_offloaded = flags.index(OFFLOADED)
    assert flags[:first_offloaded] == [0] * first_offloaded and first_offloaded >= 1
    assert flags[first_offloaded:] == [OFFLOADED] * (len(flags) - first_offloaded) and len(flags) > first_offloaded


def test_flow_start_of_an_entry_first_met_in_a_new_event_is_the_kernels_start() -> None:
    """A NEW event has no start stamp; the first row that has one sets flowStart, if no record went out yet."""
    clock = Clock()
    store = make(clock)
    poll(store, clock)
    kernel_start = clock.wall() + 5
    clock.tick(0.2)
    store.apply_events([udp(9, packets=0, start_ns=0)], [], clock.now, clock.wall())  # read 200 ms late
    poll(store, clock, udp(9, packets=2, start_ns=kernel_start))
    clock.tick(5)
    poll(store, clock, udp(9, packets=3, start_ns=kernel_start))
    (first,) = expire(store, clock)
    assert first.first_seen_ns == kernel_start
    clock.tick(5)
    poll(store, clock, udp(9, packets=4, start_ns=kernel_start))
    (second,) = expire(store, clock)
    assert second.first_seen_ns == kernel_start and second.sequence == 1


def test_a_new_read_after_its_tuple_was_recreated_never_joins_two_incarnations() -> None:
    """A start-less entry with a record, met by a row that started before it was first seen: a new id, flagged."""
    clock = Clock()
    store = make(clock)
    poll(store, clock)
    first_start = clock.wall() + 1
    clock.tick(0.1)
    second_start = clock.wall()  # the first incarnation was destroyed and its tuple re-created, same ct id
    clock.tick(0.1)
    store.apply_events([udp(9, packets=0, start_ns=0)], [], clock.now, clock.wall())  # the first's NEW, read late
    clock.tick(5)
    (early,) = expire(store, clock)  # its active-timeout record, before any dump showed the tuple
    poll(store, clock, udp(9, packets=4, start_ns=second_start))
    now = store.lookup(udp(9).key)
    assert now is not None and now.flow_id != early.flow_id and now.flags & ADOPTED and now.next_seq == 0
    store.apply_events([], [udp(9, packets=2, start_ns=first_start, stop_ns=second_start - 1)], clock.now, clock.wall())
    (last,) = [e for e in expire(store, clock) if e.flow_id == early.flow_id]
    assert (last.sequence, last.reason, last.totals[0]) == (1, END_OF_FLOW, 2)
