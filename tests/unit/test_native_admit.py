"""The bulk admission of new connections (flow_exporter/admission.py) against the reference store, in lockstep.

A compiled store admits runs of new dump rows in one call and stops at any row that needs more (a
known key, a restored row, the cap, a possible readmission, a slot the columns must grow for, a
value a column cannot hold); the pure store admits every row through Table._admit. Both are fed
the same batches (update_batch, as a dump without the fused decoder does) and must end in the same
state, call their new-connection hook with the same connections in the same order, and raise the
same error on a value a column cannot hold.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, PROTO_TCP, PROTO_UDP, Connection
from flow_exporter.conntrack.decode import Decoder
from flow_exporter.flow import ADOPTED, NewConnection, Restored
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support.netlink_messages import encode_connection
from tests.unit.test_native import state

NS = 1_000_000_000
TIMEOUTS = Timeouts(poll_interval=1, active=5, idle=15)
ADDRS = [bytes([10, 0, 0, k]) for k in range(1, 5)]
ADDRS6 = [b"\xfd" + b"\0" * 14 + bytes([k]) for k in range(1, 3)]


@st.composite
def rows(draw: Any) -> Connection:
    """A conntrack row of any kind the store keeps: TCP, UDP, ICMP, v4/v6, zones, labels, no start, uncounted."""
    v6 = draw(st.booleans())
    pool = ADDRS6 if v6 else ADDRS
    src, dst = draw(st.sampled_from(pool)), draw(st.sampled_from(pool))
    kind = draw(st.sampled_from(["tcp", "udp", "icmp"]))
    sport = draw(st.integers(1, 4))
    fam = socket.AF_INET6 if v6 else socket.AF_INET
    counters = draw(st.tuples(*[st.integers(0, 2**40)] * 4))
    common: dict[str, Any] = {
        "zone": draw(st.sampled_from([0, 0, 7])),
        "ct_id": draw(st.integers(0, 2**32 - 1)),
        "mark": draw(st.sampled_from([0, 5])),
        "labels": draw(st.sampled_from([None, None, b"\x01" + b"\0" * 15])),
        "status": draw(st.integers(0, 2**14)),
        "orig_packets": counters[0],
        "orig_bytes": counters[1],
        "reply_packets": counters[2],
        "reply_bytes": counters[3],
        "start_ns": draw(st.sampled_from([0, 1, 2])),  # 0: timestamps off; else a slot in time, set by the test
        "stop_ns": draw(st.sampled_from([0, 0, 1])),
        "counted": draw(st.booleans()),
    }
    if kind == "icmp":
        proto = PROTO_ICMPV6 if v6 else PROTO_ICMP
        return Connection(fam, proto, src, dst, sport, 8 << 8, dst, src, sport, 0, icmp_type=8, icmp_code=0,
                          icmp_id=sport, **common)  # fmt: skip
    proto = PROTO_TCP if kind == "tcp" else PROTO_UDP
    tcp = draw(st.sampled_from([None, 3, 7])) if kind == "tcp" else None
    return Connection(fam, proto, src, dst, 40000 + sport, 80, dst, src, 80, 40000 + sport, tcp_state=tcp, **common)


START_WALL = 5_000 * NS


def timed(conn: Connection, wall: int) -> Connection:
    """The row with its start/stop slots turned into wall times around a dump at ``wall``."""
    slots = {0: 0, 1: wall - 3 * NS, 2: wall + NS}  # none; before the last dump (readmitted?); new
    stop = wall if conn.stop_ns == 1 else conn.stop_ns
    return replace(conn, start_ns=slots.get(conn.start_ns, conn.start_ns), stop_ns=stop)


class Pair:
    """A pure store and a compiled one fed the same dumps. ``fused``: the compiled store reads each batch as a
    netlink dump buffer (apply_dump_buffer: new rows admitted in place, without a Connection, unless the hook
    wants one), the pure store the rows decoded from it."""

    def __init__(self, cap: int, restored: list[Restored], hook: bool, fused: bool = False) -> None:
        self.fused = fused
        self.now = 1000.0
        self.wall = START_WALL
        self.calls: dict[str, list[tuple[Any, ...]]] = {"pure": [], "compiled": []}
        self.stores = {}
        for name, compiled in (("pure", False), ("compiled", True)):
            calls = self.calls[name]

            def on_new(n: NewConnection, calls: list[tuple[Any, ...]] = calls) -> None:
                calls.append((n.conn, n.meta, n.settled))
                n.meta = {"pod": len(calls)}  # what the enricher does: the store keeps it

            self.stores[name] = ConnectionStore(TIMEOUTS, max_connections=cap, id_seed=b"A" * 8, compiled=compiled,
                                                on_new=on_new if hook else None)  # fmt: skip
            if restored:
                self.stores[name].restore(restored, [])
        assert self.stores["compiled"].fused and not self.stores["pure"].fused

    def times(self, conn: Connection) -> Connection:
        return timed(conn, self.wall)

    def dump(self, batches: list[list[Connection]]) -> None:
        self.wall += 2 * NS
        self.now += 2
        outcome = {}
        for name, store in self.stores.items():
            store.begin_poll(self.wall)
            try:
                for batch in batches:
                    if not self.fused:
                        store.update_batch(list(batch), self.now, self.wall)
                        continue
                    buf = b"".join(encode_connection(c) for c in batch)
                    if store.fused:
                        store.apply_dump_buffer(memoryview(buf), None, self.now, self.wall, {})
                    else:
                        decoded: list[Connection] = []
                        Decoder().decode_batch(buf, decoded, None)
                        store.update_batch(decoded, self.now, self.wall)
                outcome[name] = None
            except Exception as exc:  # the two must fail alike
                outcome[name] = type(exc)
            store.end_poll(self.now, self.wall + NS // 10)
        assert outcome["compiled"] == outcome["pure"]
        assert self.calls["compiled"] == self.calls["pure"]
        assert state(self.stores["compiled"]) == state(self.stores["pure"])

    def expire(self) -> None:
        """Every record due goes out and is delivered: ended connections free their slots for the next dump."""
        self.now += 6
        self.wall += 6 * NS
        for store in self.stores.values():
            store.acknowledge_delivered(store.expire(self.now, self.wall), self.now)
        assert state(self.stores["compiled"]) == state(self.stores["pure"])


def restored_rows(conns: list[Connection], picks: list[int]) -> list[Restored]:
    out = []
    for k in picks:
        c = conns[k % len(conns)]
        out.append(Restored(c.key, c.ct_id, c.start_ns, c.start_ns or 1, 1000 + k, 2, (0, 0, 0, 0), k % 2 * ADOPTED))
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    st.lists(rows(), min_size=1, max_size=40),
    st.lists(st.lists(st.lists(st.integers(0, 39), max_size=30), min_size=0, max_size=3), min_size=1, max_size=5),
    st.integers(1, 50),
    st.lists(st.integers(0, 39), max_size=4),
    st.booleans(),
    st.booleans(),
)
@example(  # the same tuple twice in one batch, and a row the cap refuses
    [Connection(2, PROTO_TCP, ADDRS[0], ADDRS[1], 1, 80, ADDRS[1], ADDRS[0], 80, 1, ct_id=1)] * 2
    + [Connection(2, PROTO_UDP, ADDRS[0], ADDRS[1], 2, 53, ADDRS[1], ADDRS[0], 53, 2, ct_id=2)],
    [[[0, 1, 2]]],
    1,
    [],
    True,
    False,
)
@example(  # a tuple given up at the cap, shown again once there is room: still given up, not admitted
    [
        Connection(2, PROTO_TCP, ADDRS[0], ADDRS[1], 1, 80, ADDRS[1], ADDRS[0], 80, 1, ct_id=1),
        Connection(2, PROTO_UDP, ADDRS[0], ADDRS[1], 2, 53, ADDRS[1], ADDRS[0], 53, 2, ct_id=2),
    ],
    [[[0, 1]], [[1]], [], [[1]]],
    1,
    [],
    False,
    False,
)
@example(  # read from dump buffers: restored rows, a duplicate, the cap, among rows admitted in place
    [
        Connection(2, PROTO_TCP, ADDRS[0], ADDRS[1], 1, 80, ADDRS[1], ADDRS[0], 80, 1, ct_id=1, start_ns=1),
        Connection(2, PROTO_UDP, ADDRS[0], ADDRS[1], 2, 53, ADDRS[1], ADDRS[0], 53, 2, ct_id=2, start_ns=2),
        Connection(2, PROTO_UDP, ADDRS[1], ADDRS[0], 3, 53, ADDRS[0], ADDRS[1], 53, 3, ct_id=3),
    ],
    [[[1, 0, 1, 2]], [[2, 1, 0]], [], [[0, 2]]],
    2,
    [0],
    False,
    True,
)
def test_compiled_admission_keeps_the_same_store(
    pool: list[Connection], dumps: list[list[list[int]]], cap: int, restore: list[int], hook: bool, fused: bool
) -> None:
    first_dump = START_WALL  # the rows' times as the first dump sees them, for the checkpoint's rows
    restored = restored_rows([timed(c, first_dump) for c in pool], restore) if restore else []
    pair = Pair(cap, restored, hook, fused)
    for batches in dumps:
        # every dump: the rows it shows, in batches; rows a dump no longer shows end, and once their records
        # are delivered their slots are free for the next dump's new rows (an empty dump: all records go out)
        if not batches:
            pair.expire()
            continue
        pair.dump([[pair.times(pool[k % len(pool)]) for k in batch] for batch in batches])


@pytest.mark.parametrize("fused", [False, True], ids=["rows", "dump buffers"])
def test_new_rows_in_freed_slots_order_the_heap_as_pure(fused: bool) -> None:
    """Slots freed in one order and taken back in another: heap entries that must move up past their parents."""
    pair = Pair(100, [], False, fused)
    conns = [
        Connection(2, PROTO_UDP, ADDRS[0], ADDRS[1], 10 + k, 53, ADDRS[1], ADDRS[0], 53, 10 + k, ct_id=k + 1)
        for k in range(60)
    ]
    pair.dump([conns[:40]])
    pair.dump([conns[0:40:4]])  # 30 of them end
    pair.expire()
    assert len(pair.stores["compiled"].table._free) == 30  # the slots the next dump's new rows take, highest first
    pair.dump([conns[0:40:4] + conns[40:]])


@pytest.mark.parametrize("fused", [False, True], ids=["rows", "dump buffers"])
def test_more_rows_than_the_columns_hold_grow_them_as_pure(fused: bool) -> None:
    """Past the columns' first chunk the compiled run stops, the pure path grows them, the run goes on (read
    from dump buffers: the admission in place pauses for Python and reads the store's counters again)."""
    pair = Pair(10_000, [], not fused, fused)
    conns = [
        Connection(2, PROTO_TCP, ADDRS[k % 4], ADDRS[(k + 1) % 4], 1024 + k, 80, ADDRS[(k + 1) % 4], ADDRS[k % 4], 80,
                   1024 + k, ct_id=k + 1, start_ns=pair.wall - NS, tcp_state=3)
        for k in range(3000)
    ]  # fmt: skip
    pair.dump([conns[:1500], conns[1500:]])
    assert len(pair.stores["compiled"].connections) == 3000


def test_rows_admitted_in_place_after_python_ran_mid_buffer_as_pure() -> None:
    """In one dump buffer: new rows past the columns' first chunk (the admission in place stops; they wait),
    a known row (the waiting rows go to Python first, which grows the columns and admits them), then more new
    rows, admitted in place again with the counters Python left: the next free slot, the id sequence."""
    pair = Pair(10_000, [], False, True)
    conns = [
        Connection(2, PROTO_UDP, ADDRS[k % 4], ADDRS[(k + 1) % 4], 1024 + k, 53, ADDRS[(k + 1) % 4], ADDRS[k % 4], 53,
                   1024 + k, ct_id=k + 1)
        for k in range(1200)
    ]  # fmt: skip
    pair.dump([conns[:10]])
    compiled = pair.stores["compiled"]
    handed: list[int] = []  # rows the fused poll handed to Python
    apply_rows = compiled.table.apply_rows

    def counted(rows: list[Connection], now: float, wall_ns: int) -> None:
        handed.append(len(rows))
        apply_rows(rows, now, wall_ns)

    compiled.table.apply_rows = counted  # type: ignore[method-assign]
    pair.dump([[*conns[10:1100], conns[3], *conns[1100:]]])
    assert len(compiled.connections) == 1200
    # 1,014 rows fill the first chunk's 1,024 slots in place; the next 76 wait for the known row and go to
    # Python; the last 100 are admitted in place again
    assert handed == [1100 - 1024]


@pytest.mark.parametrize(
    "change",
    [
        {"ct_id": 2**32},
        {"mark": -1},
        {"tcp_state": 200},
        {"orig_dport": 70000},
        {"orig_packets": 2**64},
        {"orig_dst": "10.0.0.2"},
        {"labels": bytearray(16)},
        {"start_ns": 2**63},
        {"counted": 1},
    ],
    ids=lambda c: next(iter(c)),
)
def test_a_value_a_column_cannot_hold_fails_as_pure(change: dict[str, Any]) -> None:
    """The compiled run leaves such a row to the pure path: the same error, or the same state."""
    pair = Pair(100, [], True)
    ok = [
        Connection(2, PROTO_UDP, ADDRS[0], ADDRS[1], 10 + k, 53, ADDRS[1], ADDRS[0], 53, 10 + k, ct_id=k + 1)
        for k in range(3)
    ]
    pair.dump([[ok[0], replace(ok[1], **change), ok[2]]])


def test_a_subclass_of_connection_goes_the_pure_way() -> None:
    class Odd(Connection):
        __slots__ = ()

    pair = Pair(100, [], False)
    a = Connection(2, PROTO_UDP, ADDRS[0], ADDRS[1], 10, 53, ADDRS[1], ADDRS[0], 53, 10, ct_id=1)
    b = Odd(2, PROTO_UDP, ADDRS[0], ADDRS[1], 11, 53, ADDRS[1], ADDRS[0], 53, 11, ct_id=2)
    pair.dump([[a, b, replace(a, orig_sport=12, reply_dport=12)]])
    assert len(pair.stores["compiled"].connections) == 3


class CountingRows(list[Connection]):
    """A dump's rows that count how many times Python code reads one (the compiled admission reads them in C)."""

    reads = 0

    def __iter__(self) -> Iterator[Connection]:
        for conn in super().__iter__():
            self.reads += 1
            yield conn

    def __getitem__(self, i: Any) -> Any:
        self.reads += 1
        return super().__getitem__(i)


@pytest.mark.parametrize("cap", [10_000, 100], ids=["restored", "over the cap"])
def test_rows_the_admission_stops_at_are_each_read_a_few_times(cap: int) -> None:
    """Every row a restart restored (or the cap refuses) stops the compiled run: the pure path takes it and
    hands back. Resuming must start at that row, not step over the ones before it again: that was one pass
    over the dump per stop, 210 s for a restart at 250k connections instead of 2 (bench_checkpoint)."""
    n = 2000
    conns = [
        Connection(2, PROTO_UDP, ADDRS[k % 4], ADDRS[1], 1024 + k, 53, ADDRS[1], ADDRS[k % 4], 53, 1024 + k,
                   ct_id=k + 1, start_ns=START_WALL - NS)
        for k in range(n)
    ]  # fmt: skip
    store = ConnectionStore(TIMEOUTS, max_connections=cap, compiled=True)
    if cap > n:
        store.restore(restored_rows(conns, list(range(n))), [])
    rows = CountingRows(conns)
    store.update_batch(rows, 1.0, START_WALL)
    if cap > n:
        assert store.stats.restored == n
    else:
        assert len(store.connections) == cap
    # Each stop reads the row it stopped at and the next one (where the pure path stops again); a pass over
    # the rows before it on every stop would be ~n * n / 2 reads.
    assert rows.reads <= 2 * n
