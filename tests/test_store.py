"""Store and expiry-queue rules (REFERENCE.md section 1), driven by a fake clock."""

from __future__ import annotations

import socket
from dataclasses import replace

import pytest

from pipeline.connection import IPS_DYING, PROTO_TCP, PROTO_UDP, Connection
from pipeline.expiry import ExpiryQueue
from pipeline.store import (
    ACTIVE_TIMEOUT,
    END_OF_FLOW,
    FORCED_END,
    IDLE_TIMEOUT,
    ConnectionStore,
    Export,
    connection_id,
)
from pipeline.timeouts import Timeouts

ESTABLISHED, FIN_WAIT, CLOSE_WAIT, LAST_ACK, TIME_WAIT, CLOSE = 3, 4, 5, 6, 7, 8
NS = 1_000_000_000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def wall(self) -> int:
        return int(self.now * NS)

    def tick(self, seconds: float) -> None:
        self.now += seconds


def tcp(sport: int = 40000, *, packets: int = 1, state: int = ESTABLISHED, **kw: object) -> Connection:
    base = Connection(
        family=socket.AF_INET,
        proto=PROTO_TCP,
        orig_src=bytes([10, 0, 1, 2]),
        orig_dst=bytes([10, 96, 0, 10]),
        orig_sport=sport,
        orig_dport=80,
        reply_src=bytes([10, 0, 2, 2]),
        reply_dst=bytes([10, 0, 1, 2]),
        reply_sport=8080,
        reply_dport=sport,
        ct_id=7,
        tcp_state=state,
        orig_packets=packets,
        orig_bytes=packets * 100,
        reply_packets=packets,
        reply_bytes=packets * 200,
        start_ns=999 * NS,
    )
    return replace(base, **kw)


def udp(sport: int = 5353, *, packets: int = 1, status: int = 0) -> Connection:
    return replace(tcp(sport, packets=packets), proto=PROTO_UDP, tcp_state=None, status=status)


def make(clock: Clock, **kw: float) -> ConnectionStore:
    return ConnectionStore(Timeouts(**kw) if kw else Timeouts())


def poll(store: ConnectionStore, clock: Clock, *conns: Connection) -> None:
    store.update(list(conns), clock.now, clock.wall())


def expire(store: ConnectionStore, clock: Clock, ack: bool = True) -> list[Export]:
    out = store.expire(clock.now, clock.wall())
    if ack:
        for e in out:
            store.acknowledge(e, True, clock.now)
    return out


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
    assert key not in store.queue and store.connections[key].active is False
    clock.tick(5)
    poll(store, clock, tcp(packets=2))
    assert expire(store, clock) == []
    poll(store, clock, tcp(packets=5))  # active again: back in the queue
    assert key in store.queue and store.connections[key].active
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
    item = store.queue.get(tcp().key)
    assert item is not None
    idle_before = item.idle_expire
    poll(store, clock, tcp(packets=2, state=CLOSE_WAIT))
    assert store.queue.get(tcp().key).idle_expire > idle_before  # type: ignore[union-attr]


@pytest.mark.parametrize("state", [TIME_WAIT, CLOSE])
def test_dying_tcp_gets_end_of_flow_and_frozen_counters(state: int) -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2))
    clock.tick(2)
    poll(store, clock, tcp(packets=6, state=state))
    poll(store, clock, tcp(packets=9, state=state))  # frozen: ignored
    clock.tick(3)
    (e,) = expire(store, clock)
    assert e.reason == END_OF_FLOW and e.final and e.totals[0] == 6
    assert tcp().key not in store.queue
    poll(store, clock, tcp(packets=9, state=state))  # still in the table: kept
    assert tcp().key in store.connections
    poll(store, clock)  # gone: marked absent
    poll(store, clock)  # swept
    assert tcp().key not in store.connections


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
    assert e.reason == END_OF_FLOW and e.totals[0] == 4
    poll(store, clock)
    assert len(store) == 0


def test_vanished_idle_connection_with_nothing_unreported_is_deleted_at_once() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, udp(packets=1))
    for _ in range(3):
        clock.tick(5)
        poll(store, clock, udp(packets=1))
        expire(store, clock)
    assert udp().key not in store.queue
    poll(store, clock)
    poll(store, clock)
    assert len(store) == 0


def test_stale_timeout_deletes_unacknowledged_only_when_nothing_is_pending() -> None:
    clock = Clock()
    store = make(clock, stale=300.0)
    poll(store, clock, udp(packets=1))
    clock.tick(5)
    poll(store, clock, udp(packets=1))
    out = expire(store, clock, ack=False)
    store.acknowledge(out[0], False, clock.now)  # failed: counts still unreported
    poll(store, clock)
    clock.tick(400)
    poll(store, clock)
    assert udp().key in store.connections  # not silently forgotten
    (e,) = expire(store, clock)
    assert e.deltas[0] == 1 and e.sequence == 0


def test_failed_record_counts_ride_in_next_record_with_same_sequence() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=2))
    clock.tick(5)
    poll(store, clock, tcp(packets=2))
    (first,) = expire(store, clock, ack=False)
    store.acknowledge(first, False, clock.now)
    clock.tick(5)
    poll(store, clock, tcp(packets=5))
    (second,) = expire(store, clock)
    assert second.sequence == first.sequence == 0
    assert second.deltas == (5, 500, 5, 1000)
    clock.tick(5)
    poll(store, clock, tcp(packets=6))
    (third,) = expire(store, clock)
    assert third.sequence == 1 and third.deltas == (1, 100, 1, 200)


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


def test_deltas_never_negative() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=5))
    clock.tick(5)
    poll(store, clock, tcp(packets=5))
    expire(store, clock)
    clock.tick(5)
    poll(store, clock, replace(tcp(packets=6), orig_bytes=10))  # bytes went down: kernel quirk
    (e,) = expire(store, clock)
    assert min(e.deltas) >= 0


def test_reused_tuple_ends_old_connection() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(packets=3))
    clock.tick(2)
    poll(store, clock, tcp(packets=1, ct_id=99, start_ns=1001 * NS))
    out = expire(store, clock)
    assert [(e.reason, e.totals[0]) for e in out] == [(END_OF_FLOW, 3)]
    assert out[0].tracked.flow_id != store.connections[tcp().key].flow_id


def test_shutdown_exports_every_connection_with_forced_end() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(1), tcp(2), udp(3))
    out = store.export_all(clock.now)
    assert sorted(e.reason for e in out) == [FORCED_END] * 3
    for e in out:
        store.acknowledge(e, True, clock.now)
    assert store.unfinished() == 0


def test_timeouts_raised_like_antrea() -> None:
    t = Timeouts.normalized(poll_interval=10, active=5, idle=8, stale=8)
    assert (t.active, t.idle, t.stale) == (10, 10, 20)
    assert Timeouts.normalized(5, 5, 15, 300) == Timeouts(5, 5, 15, 300)


def test_connection_id_stable_and_distinct() -> None:
    k = tcp().key
    assert connection_id(k, 2) == connection_id(k, 2)
    assert connection_id(k, 2) != connection_id(k, 3)
    assert -(2**63) <= connection_id(k, 2) < 2**63


def test_queue_orders_by_min_deadline_and_updates_lazily() -> None:
    q = ExpiryQueue()
    q.push("a", 10, 30)
    q.push("b", 20, 5)
    q.push("c", 7, 8)
    q.update("a", active_expire=1)
    assert q.next_deadline() == 1
    assert [k for k, _ in q.pop_due(9)] == ["a", "b", "c"]
    assert len(q) == 0 and q.next_deadline() is None
    for i in range(1000):
        q.push("x", i, i)  # repeated updates of one key stay bounded
    assert len(q._heap) < 200


def test_end_of_flow_reported_at_the_poll_that_sees_it() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, tcp(1, packets=2), udp(2, packets=1))
    clock.tick(1)
    poll(store, clock, tcp(1, packets=5, state=TIME_WAIT))  # closed; the UDP entry vanished
    out = expire(store, clock)
    assert sorted((e.reason, e.totals[0]) for e in out) == [(END_OF_FLOW, 1), (END_OF_FLOW, 5)]


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


def test_new_event_adds_connection_and_late_destroy_adds_the_rest() -> None:
    clock = Clock()
    store = make(clock)
    store.apply_events([udp(9, packets=1)], [], clock.now, clock.wall())
    assert udp(9).key in store.connections
    poll(store, clock)  # gone before the dump, its DESTROY not read yet
    (first,) = expire(store, clock)
    assert first.reason == END_OF_FLOW and first.totals[0] == 1
    store.apply_events([], [udp(9, packets=3)], clock.now, clock.wall())
    (second,) = expire(store, clock)
    assert second.sequence == 1 and second.deltas[0] == 2 and second.final


def test_connection_cap_evicts_idle_reported_first_and_counts() -> None:
    clock = Clock()
    store = ConnectionStore(Timeouts(), max_connections=100)
    poll(store, clock, *(udp(1000 + i, packets=1) for i in range(100)))
    for _ in range(3):  # all become idle, fully reported
        clock.tick(5)
        poll(store, clock, *(udp(1000 + i, packets=1) for i in range(100)))
        expire(store, clock)
    poll(store, clock, *(udp(1000 + i, packets=1) for i in range(100)), tcp(5))
    assert tcp(5).key in store.connections and len(store) <= 100
    assert store.stats.evicted >= 1 and store.stats.evicted_by_reason
    assert next(iter(store.stats.evicted_by_reason)).startswith("idle")


def test_connection_cap_with_nothing_evictable_drops_new_and_counts() -> None:
    clock = Clock()
    store = ConnectionStore(Timeouts(), max_connections=10)
    poll(store, clock, *(tcp(2000 + i) for i in range(10)))
    clock.tick(5)
    out = expire(store, clock, ack=False)  # all in flight: none can go
    poll(store, clock, *(tcp(2000 + i) for i in range(10)), tcp(9))
    assert tcp(9).key not in store.connections and store.stats.dropped_new == 1
    assert len(out) == 10


def test_expire_limit_leaves_the_rest_due() -> None:
    clock = Clock()
    store = make(clock)
    poll(store, clock, *(tcp(3000 + i) for i in range(50)))
    clock.tick(5)
    first = store.expire(clock.now, clock.wall(), limit=20)
    rest = store.expire(clock.now, clock.wall())
    assert len(first) == 20 and len(rest) == 30
