"""Adaptive shedding (flow_exporter/shedding.py, sampling.Schedule, sampling_state): the controller's steps, the
schedule's levels, and the store's rule that a connection keeps the level of its first-seen time.

The store scenarios pick connections by where their hash falls (computed here from the README's words with the
``siphash24`` package, test_sampling's ``reference_hash``), then change the level between polls and events in
both orders, and check what a consumer sees: which connections are reported, with which probability, and that a
kept connection's records go on (no gap, one connectionId) whatever the level does.
"""

from __future__ import annotations

import json
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flow_exporter import compiled, sampling_state
from flow_exporter.connection import Connection
from flow_exporter.sampling import Schedule
from flow_exporter.shedding import LOWER_BELOW, Budget, Shedder
from flow_exporter.sink.encoder import RecordEncoder
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support.reference import AvroSerializer
from tests.support.store_builders import Clock, udp
from tests.unit.test_native import OPS, Lockstep, walk_in_lockstep
from tests.unit.test_sampling import reference_hash

P, SEED = 0.5, "shed"
SER = AvroSerializer()
T = Timeouts(poll_interval=5, active=5, idle=30)
BUILDS = [compiled.load("sampling"), compiled.reference("sampling")]
IDS = ["chosen", "interpreted"]

# ----------------------------------------------------------------------------- the controller


def test_the_shedder_halves_over_budget_and_doubles_well_under() -> None:
    s = Shedder(Budget(connections=1000), interval=30, max_level=3)
    assert s.observe(0, 0, {0: 5000}, 0) is None  # the first call starts the first interval
    assert s.observe(29, 0, {0: 5000}, 0) is None  # one step per interval at most
    c = s.observe(30, 0, {0: 5000}, 0)
    assert c is not None and (c.level, c.load, c.rows) == (1, 5.0, 5000)
    # At level 1 the rows kept at level 0 project to half: 2,500 still over, so level 2; then 1,250: level 3.
    c = s.observe(60, 1, {0: 5000}, 0)
    assert c is not None and (c.level, c.rows) == (2, 2500)
    c = s.observe(90, 2, {0: 5000}, 0)
    assert c is not None and c.level == 3
    assert s.observe(120, 3, {0: 5000}, 0) is None  # max_level: the cap is the last resort
    # The table turned over: 300 rows at level 3 project to 300 (0.3 of the budget): doubled back.
    c = s.observe(150, 3, {3: 300}, 0)
    assert c is not None and c.level == 2 and c.load == pytest.approx(0.3)
    # 300 rows at level 3 seen from level 2 stand for 600: 0.6 is not under LOWER_BELOW, so it stays.
    assert s.observe(180, 2, {3: 300}, 0) is None
    assert LOWER_BELOW == 0.4


def test_the_record_budget_is_a_rate_projected_to_the_current_level() -> None:
    s = Shedder(Budget(records_per_second=100), interval=10, max_level=5)
    s.observe(0, 0, {0: 50}, 0)
    c = s.observe(10, 0, {0: 50}, 2000)  # 200 records/s over 10 s
    assert c is not None and c.level == 1 and c.records_per_second == 200 and c.load == 2.0
    c = s.observe(20, 1, {0: 50}, 4000)  # the rows are still level 0's: projected 100/s, not over
    assert c is None
    c = s.observe(30, 1, {0: 10, 1: 10}, 4300)  # 30/s measured, rows project to 15 of 20: 22.5/s
    assert c is not None and c.level == 0 and c.records_per_second == pytest.approx(22.5)


def test_both_budgets_the_tighter_one_counts() -> None:
    s = Shedder(Budget(connections=1000, records_per_second=100), interval=1, max_level=2)
    s.observe(0, 0, {0: 500}, 0)
    c = s.observe(1, 0, {0: 500}, 150)
    assert c is not None and c.level == 1 and c.load == 1.5  # records: 150/s of 100; rows 0.5


# ----------------------------------------------------------------------------- the schedule


def test_a_schedule_gives_each_time_its_level() -> None:
    s = Schedule(0.5)
    assert (s.level, s.deepest, s.level_at(123), s.probability_at(123)) == (0, 0, 0, 0.5)
    s.change(100, 2)
    s.change(200, 1)
    assert [s.level_at(t) for t in (99, 100, 150, 199, 200, 10**20)] == [0, 2, 2, 2, 1, 1]
    assert (s.level, s.deepest, s.probability_at(150)) == (1, 2, 0.125)
    assert s.count_levels([1, 100, 150, 250, 99]) == {0: 2, 2: 2, 1: 1}
    with pytest.raises(ValueError, match="not after"):
        s.change(200, 0)
    with pytest.raises(ValueError, match="out of range"):
        s.change(300, 40)


def test_the_state_directory_keeps_the_schedule_of_its_lineage(tmp_path: Path) -> None:
    s = Schedule(0.5, [(100, 1), (200, 3)])
    sampling_state.save(tmp_path, b"L" * 8, s)
    assert sampling_state.load(tmp_path, b"L" * 8, 0.5) == [(100, 1), (200, 3)]
    assert sampling_state.load(tmp_path, b"M" * 8, 0.5) == []  # another lineage's: not this state's
    assert sampling_state.load(tmp_path / "none", b"L" * 8, 0.5) == []  # never shed
    for damaged in (b"{", b"[]", json.dumps({"lineage": (b"L" * 8).hex(), "base": 0.5, "changes": [[2, 1], [1, 1]]}),
                    json.dumps({"lineage": (b"L" * 8).hex(), "base": 0.25, "changes": []}), b"\xff\xfe"):  # fmt: skip
        (tmp_path / "sampling").write_bytes(damaged if isinstance(damaged, bytes) else damaged.encode())
        with pytest.raises(sampling_state.ScheduleError, match="sampling"):
            sampling_state.load(tmp_path, b"L" * 8, 0.5)


# ----------------------------------------------------------------------------- the store's rule


def band(level: int, n: int = 1, *, start: bool = False) -> list[Connection]:
    """UDP connections whose hash is kept at level ``level - 1`` but not at ``level`` (p = P)."""
    out = []
    t0 = Fraction(P) * 2**64
    for port in range(20000, 60000):
        c = udp(port, ct_id=port, start_ns=10**18 if start else 0)
        h = reference_hash(SEED, 4, 17, "10.0.1.2", port, "10.0.2.2", 8080)
        if t0 / 2**level <= h < t0 / 2 ** (level - 1):
            out.append(c)
            if len(out) == n:
                return out
    raise AssertionError("no such tuple")


def always(n: int = 1) -> list[Connection]:
    """Connections kept at every level up to 4."""
    out = []
    for port in range(20000, 60000):
        if reference_hash(SEED, 4, 17, "10.0.1.2", port, "10.0.2.2", 8080) < Fraction(P) * 2**60:
            out.append(udp(port, ct_id=port, start_ns=0))  # first seen: when met
            if len(out) == n:
                return out
    raise AssertionError("no such tuple")


class Node:
    """A store with a sampler on a schedule, polled and expired as the exporter does, its records decoded."""

    def __init__(self, build: Any) -> None:
        self.clock = Clock()
        self.schedule = build.Schedule(P)
        self.sampler = build.Sampler(P, SEED, self.schedule)
        self.store = ConnectionStore(T, max_connections=1000, sampler=self.sampler)
        self.encoder = RecordEncoder("n", schedule=self.schedule)
        self.records: list[dict[str, Any]] = []

    def shed(self, level: int) -> None:
        self.clock.tick(0.001)
        self.schedule.change(max(self.clock.wall(), self.store.table._last_stamp + 1), level)
        self.sampler.rescheduled()

    def poll(self, *conns: Connection, seconds: float = 5) -> None:
        self.store.update(list(conns), self.clock.now, self.clock.wall())
        self.clock.tick(seconds)
        for e in self.store.expire(self.clock.now, self.clock.wall()):
            self.records.append(SER.decode(self.encoder.encode(e, 1)))
            self.store.acknowledge(e, True, self.clock.now)

    def events(self, new: list[Connection], gone: list[Connection]) -> None:
        self.store.apply_events(new, gone, self.clock.now, self.clock.wall())

    def reported(self) -> dict[int, list[tuple[float, int, int]]]:
        """sourcePort -> [(samplingProbability, connectionId, sequence)] of its records."""
        out: dict[int, list[tuple[float, int, int]]] = {}
        for r in self.records:
            out.setdefault(r["sourcePort"], []).append((r["samplingProbability"], r["connectionId"], r["sequence"]))
        return out


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
def test_a_kept_connection_stays_kept_when_the_probability_falls(build: Any) -> None:
    node = Node(build)
    (a,) = band(2)  # kept at level 0 and 1, dropped from level 2 on
    (b,) = band(3)  # kept at 0..2
    node.poll(replace(a, orig_packets=1), replace(b, orig_packets=1))
    node.shed(3)
    for k in range(2, 5):  # the same connections, moving, after the fall; no kernel start (timestamps off)
        node.poll(replace(a, orig_packets=k), replace(b, orig_packets=k))
    got = node.reported()
    for port in (a.orig_sport, b.orig_sport):
        ps, ids, seqs = zip(*got[port], strict=True)
        assert set(ps) == {P} and len(set(ids)) == 1 and list(seqs) == list(range(len(seqs))), got[port]
    # A new connection in the same band, first met after the fall, is dropped: the level of its first meeting.
    (c,) = band(2, 3)[2:]
    node.poll(c)
    node.poll(c)
    assert c.orig_sport not in node.reported()
    assert node.sampler.dropped == 1


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
@pytest.mark.parametrize("start", [False, True], ids=["no-kernel-start", "kernel-start"])
def test_a_dropped_connection_stays_dropped_when_the_probability_rises(build: Any, start: bool) -> None:
    node = Node(build)
    node.shed(2)
    (a,) = band(1, 1, start=start)  # kept at level 0 only
    node.poll(a)
    node.poll(replace(a, orig_packets=2))
    node.shed(0)
    node.poll(replace(a, orig_packets=3))  # met again after the rise: still the same connection, still dropped
    node.poll(replace(a, orig_packets=4))
    assert a.orig_sport not in node.reported()
    assert node.sampler.dropped == 1  # counted once
    (b,) = band(1, 2, start=start)[1:]  # a new one in the same band after the rise: kept at p
    node.poll(b)
    node.poll(b)
    assert {p for p, _, _ in node.reported()[b.orig_sport]} == {P}


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
@pytest.mark.parametrize("order", ["new-then-shed", "shed-then-new"])
def test_a_new_event_and_the_rows_after_it_agree_across_a_change(build: Any, order: str) -> None:
    """A connection first met in its NEW event (no start, no counters), the level changed before its first dump row
    (which has the kernel's start, from before the change): decided once, at the NEW's level, and its records say
    that level's probability; in the other order, at the new level."""
    node = Node(build)
    (a,) = band(1)  # kept at level 0, dropped at 1
    first = replace(a, start_ns=node.clock.wall() - 1000, orig_packets=5)
    if order == "new-then-shed":
        node.events([replace(a, start_ns=0)], [])
        node.shed(1)
    else:
        node.shed(1)
        node.events([replace(a, start_ns=0)], [])
    node.poll(first)
    node.poll(replace(first, orig_packets=7))
    node.events([], [replace(first, orig_packets=9, stop_ns=node.clock.wall())])
    node.poll()
    got = node.reported().get(a.orig_sport, [])
    if order == "new-then-shed":
        ps, ids, _ = zip(*got, strict=True)
        assert set(ps) == {P} and len(set(ids)) == 1
        assert node.records[-1]["packetTotalCount"] == 9  # the DESTROY's final counts: the same connection
    else:
        assert got == [] and node.sampler.dropped == 1


@pytest.mark.parametrize("build", BUILDS, ids=IDS)
def test_records_say_the_probability_of_their_connections_first_seen_time(build: Any) -> None:
    node = Node(build)
    a, b = always(2)
    node.poll(a)
    node.shed(2)
    node.poll(replace(a, orig_packets=2), b)
    node.shed(1)
    node.poll(replace(a, orig_packets=3), replace(b, orig_packets=2))
    got = node.reported()
    assert {p for p, _, _ in got[a.orig_sport]} == {P}
    assert {p for p, _, _ in got[b.orig_sport]} == {P / 4}
    assert node.store.table.rows_by_level() == {0: 1, 2: 1}


# The lockstep of test_native with a schedule that changes: the fused walk and the Connections' path agree.
SHED_OPS = st.one_of(OPS.map(lambda op: (op, None)), st.integers(0, 3).map(lambda level: ("shed", level)))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(SHED_OPS, st.integers(0, 5), st.integers(0, 15)), min_size=5, max_size=80),
    st.integers(2, 12),
    st.sampled_from(["a", "b", "c"]),
)
def test_the_fused_poll_sheds_as_the_connections_path(
    ops: list[tuple[tuple[str, int | None], int, int]], cap: int, seed: str
) -> None:
    w = Lockstep(cap, None, sampling=(0.5, seed), shedding=True)
    for (op, level), i, arg in ops:
        if op == "shed":
            w.shed(level or 0)
        else:
            walk_in_lockstep(w, [(op, i, arg)], finish=False)
    walk_in_lockstep(w, [])


@given(st.lists(st.integers(0, 10**6), max_size=200), st.lists(st.tuples(st.integers(1, 10**6), st.integers(0, 5)),
                                                             max_size=8))  # fmt: skip
def test_count_levels_is_level_at_for_each(firsts: list[int], raw: list[tuple[int, int]]) -> None:
    changes = sorted(dict(raw).items())
    s = Schedule(0.5, changes)
    want: dict[int, int] = {}
    for f in firsts:
        want[s.level_at(f)] = want.get(s.level_at(f), 0) + 1
    assert s.count_levels(firsts) == want


def test_a_budget_with_too_many_halvings_is_refused() -> None:
    from flow_exporter.config import ConfigError, load

    over = {"sampling.budget.connections": 1000, "sampling.probability": 2**-20, "sampling.maxHalvings": 13}
    with pytest.raises(ConfigError, match=r"sampling\.maxHalvings.*below 2\*\*-32"):
        load(None, environ={}, overrides=over)
    cfg = load(None, environ={}, overrides={**over, "sampling.maxHalvings": 12})
    assert cfg.sampling.max_halvings == 12
    assert load(None, environ={}, overrides={**over, "sampling.budget.connections": 0})  # no budget: no shedding


def test_a_restart_continues_the_schedule_of_its_state_and_drops_a_state_whose_schedule_is_damaged(
    tmp_path: Path,
) -> None:
    """The runner's open_state with a budget: the state directory's schedule comes back with the rows it stamps; a
    damaged one makes the whole state untrusted (a new lineage, live connections flagged adopted), never a crash."""
    import threading

    from flow_exporter.config import load
    from flow_exporter.runner import open_state, save_schedule

    cfg = load(None, environ={}, overrides={"state.dir": str(tmp_path), "sampling.budget.connections": 100,
                                            "sampling.probability": 0.5})  # fmt: skip
    cp, loaded = open_state(cfg, threading.Event())
    assert cp is not None and loaded is not None and not loaded.valid and loaded.sampling_changes == []
    save_schedule(cp, Schedule(0.5, [(10, 1), (20, 2)]))
    cp.close()
    cp, loaded = open_state(cfg, threading.Event())
    assert cp is not None and loaded is not None and loaded.valid and loaded.sampling_changes == [(10, 1), (20, 2)]
    lineage = loaded.lineage
    (tmp_path / sampling_state.FILE).write_text((tmp_path / sampling_state.FILE).read_text()[:-3])
    cp.close()
    cp, loaded = open_state(cfg, threading.Event())
    assert cp is not None and loaded is not None and not loaded.valid and loaded.lineage != lineage
    assert "sampling schedule" in loaded.why and cp.lineage == loaded.lineage
    cp.close()
