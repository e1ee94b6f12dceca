"""Following the kernel's table: which connection holds each tuple, and what was reported of each.

Behaviour follows Antrea's ConntrackConnectionStore (mark-and-sweep on presence, dying
detection, re-queue on renewed activity); what differs is there to keep the accounting
contract (README, "Counting: the contract"):

* a connection that left the table is reported at once and remembered for a while afterwards
  (a tombstone), so a DESTROY event read after the sweep, or a dump row of an entry the
  previous dump missed, continues its sequence instead of starting over;
* a 5-tuple reused by a new conntrack entry (new id or start time) and counters that went down
  (``conntrack -Z``) end the old connectionId and start a new one;
* past ``max_connections`` the store gives connections up, each once, with a lack-of-resources
  record, and does not take them back while they last;
* connectionIds are allocated (flow.IdAllocator), never derived again from a connection's
  fields: what the store forgot and meets again is a new connection, flagged adopted when the
  kernel's stamps show it was seen before.

What the store remembers of connections it no longer tracks (tombstones, given-up connections, a
checkpoint's rows) is its :class:`~flow_exporter.store.memory.Memory`'s, which says what a row or an
event the keyed table does not hold is; the table acts on the answer.

The table also holds what was reported of each connection (its columns say it) and answers for it in
batches: which records are due, their build, their delivery settled, the rows a checkpoint keeps. The
ledger (:mod:`flow_exporter.store.ledger`) decides when to ask, and keeps the failed records it resends.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Callable, Container, Iterable, Iterator, MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from flow_exporter import admission as _admission  # new rows admitted in bulk, written once (compiled where built)
from flow_exporter import compiled as compiled_build
from flow_exporter import fused_poll as _fused_poll  # the steady poll, fused, written once (compiled where built)
from flow_exporter import ledger_core as _ledger_core  # a record built and settled, written once (compiled where built)
from flow_exporter import poll_core as _poll_core  # the sweep's scan, written once (compiled where built)
from flow_exporter.column_views import ColumnViews
from flow_exporter.connection import Connection, ConnectionKey
from flow_exporter.dying import NO_TCP_STATE, is_dying
from flow_exporter.flow import (
    ADOPTED,
    COUNTERS_RESET,
    END_OF_FLOW,
    FORCED_END,
    GIVE_UP_IDLE,
    GIVE_UP_REFUSED,
    LACK_OF_RESOURCES,
    RECORD_FLAGS,
    ROW_GIVEN_UP,
    ROW_RESET,
    ZERO,
    Export,
    IdAllocator,
    NewConnection,
    ReportedRows,
    Restored,
    RowColumns,
    Totals,
)
from flow_exporter.ports import DecodeResult
from flow_exporter.sampling import Sampler
from flow_exporter.slot_state import ACTIVE, CLOSED, DESTROYED, FINAL_DUE, LAST_ACTIVE, ORPHAN, PRESENT, UNCOUNTED
from flow_exporter.store.columns import Columns
from flow_exporter.store.memory import TOMBSTONE_MIN_TTL, GivenUp, Memory, Tombstone, same_incarnation
from flow_exporter.store.stats import StoreStats
from flow_exporter.timeouts import Timeouts

log = logging.getLogger("flow_exporter.store")

# How soon a connection whose record is still in flight is looked at again.
RETRY_DELAY = 1.0

# The cap's log line comes at most this often (seconds), with the counts since the last one.
CAP_LOG_INTERVAL = 60.0


@dataclass(frozen=True, slots=True)
class TrackedState:
    """A copy of what the store holds for one connection (tests, tools); never written back."""

    flow_id: int
    flags: int
    active: bool
    present: bool
    next_seq: int
    totals: Totals
    base: Totals


def _with_totals(conn: Connection, totals: Totals) -> Connection:
    return replace(conn, orig_packets=totals[0], orig_bytes=totals[1], reply_packets=totals[2], reply_bytes=totals[3])


class _Newcomer:
    """The handle ``on_new`` gets: the connection's first row, and its enrichment slot."""

    __slots__ = ("_flow_id", "_slot", "_store", "conn")

    def __init__(self, store: Table, slot: int, flow_id: int, conn: Connection) -> None:
        self._store = store
        self._slot = slot
        self._flow_id = flow_id
        self.conn = conn

    def _owns(self) -> bool:
        st = self._store
        return st._keys[self._slot] is not None and st._fid[self._slot] == self._flow_id

    @property
    def meta(self) -> dict[str, Any] | None:
        return self._store._meta[self._slot] if self._owns() else None

    @meta.setter
    def meta(self, meta: dict[str, Any] | None) -> None:
        if self._owns():
            st = self._store
            st._meta[self._slot] = meta
            st._invalidate(self._slot)

    @property
    def settled(self) -> bool:
        return not self._owns() or self._store._settled(self._slot)


class Table(Columns):
    """The keyed table of tracked connections, the memory of what left it, and its records' batch API.

    It owns every column (:class:`~flow_exporter.store.columns.Columns`) and every index into them, and is
    the only object that writes them. The ledger and the shutdown use it through its batch API (apply a dump
    or events, ``due``, ``build``, ``settle``, ``finals``), never through its columns.
    """

    def __init__(
        self,
        timeouts: Timeouts,
        stats: StoreStats,
        *,
        on_new: Callable[[NewConnection], None] | None,
        max_connections: int,
        adopt: bool,
        id_seed: bytes | None,
        compiled: bool,
        cache_prefixes: bool,
        source_flags: int = 0,
        sampler: Sampler | None = None,
    ) -> None:
        super().__init__()
        # The sampling decision (flow_exporter/sampling.py): a connection it drops never becomes a row. Every row
        # and event is asked here, or in the fused poll's walk, before the store looks at it.
        self.sampler = sampler
        # Record flags that hold for every connection of the source (flow.BOTH_DIRECTIONS), set from the first record.
        self.source_flags = source_flags & RECORD_FLAGS
        self.timeouts = timeouts
        self.on_new = on_new
        self.max_connections = max_connections
        self.adopt = adopt
        # The poll's rules written once (compiled where built), or (compiled=False, a test seam) the interpreted build.
        self._poll_core = _poll_core if compiled else compiled_build.reference("poll_core")
        # The fused poll and the bulk admission: optimisations of the pair they stand for (decode, then
        # update_batch row by row), which is all a store with compiled=False (the lockstep tests' reference) runs.
        self._fused_poll = _fused_poll if compiled else None
        self._admission = _admission if compiled else None
        # The fused poll's memory of the dump's order: the slot each row position held last poll (-1: none).
        self._dump_order = array("q")
        self._dump_rows = 0  # rows of the current dump applied so far
        self._new_id = IdAllocator(id_seed)
        self.connections: dict[ConnectionKey, int] = {}  # key -> slot of the incarnation that holds the tuple
        self._orphans: dict[int, int] = {}  # flow_id -> slot: out of the table, final record pending
        # (tuple, ct_id) -> replaced incarnations still owing their end-of-flow record, for their DESTROY
        # (several when the kernel re-created a tuple with the same conntrack id more than once).
        self._orphan_index: dict[tuple[ConnectionKey, int], list[int]] = {}
        self._generation = 0
        self._last_stamp = 0
        self._polls_done = 0
        self._cap_logged_at = float("-inf")
        self._cap_unlogged: dict[str, int] = {}
        self.stats = stats
        # What it remembers of the connections it does not track (tombstones, given-up ones, a checkpoint's rows).
        self.memory = Memory(
            stats, max(4 * self.timeouts.poll_interval, TOMBSTONE_MIN_TTL), max(self.max_connections, 1024)
        )
        self._dump_begin = 0
        # The compiled build of the record rules, or (compiled=False, a test seam) the interpreted one beside it.
        self._core = _ledger_core if compiled else compiled_build.reference("ledger_core")
        # The bit that keeps a delivered record's prefix for the connection's next one: ACTIVE, or 0 when
        # prefixes are not cached (every record rebuilds its own; export.prefixCache).
        self._keep_prefix = ACTIVE if cache_prefixes else 0
        self._orphan_due: list[int] = []  # orphans owing their final record (they are not in the queue)
        self._loose: dict[tuple[int, int], Export] = {}  # restored records in flight: no connection holds them
        self._loose_last: dict[int, int] = {}  # flow id -> the sequence of its last loose record, until met again

    def __len__(self) -> int:
        return len(self.connections) + len(self._orphans)

    def lookup(self, key: ConnectionKey) -> TrackedState | None:
        """What the store holds for the incarnation that has ``key`` (a copy), or None."""
        s = self.connections.get(key)
        if s is None:
            return None
        b = self._bits[s]
        return TrackedState(
            self._fid[s], self._flags[s], bool(b & ACTIVE), bool(b & PRESENT), self._seq[s],
            self._totals_of(s), self._base_of(s),
        )  # fmt: skip

    def deadlines(self, key: ConnectionKey) -> tuple[float, float] | None:
        """(active, idle) expiry of the connection with ``key`` while it is queued, else None."""
        s = self.connections.get(key)
        if s is None or s not in self.queue:
            return None
        return (self.queue.active[s], self.queue.idle[s])

    def update(self, dumped: Iterable[Connection], now: float, wall_ns: int) -> None:
        """Apply one full conntrack dump: add or update what is in it, then sweep what is not."""
        self.begin_poll(wall_ns)
        self.update_batch(dumped, now, wall_ns)
        self.end_poll(now, wall_ns)

    def begin_poll(self, wall_ns: int = 0) -> None:
        """Start applying a dump that arrives in batches (``update_batch``, then ``end_poll``).

        ``wall_ns``: the real time before the dump was requested (0: unknown).
        """
        self._generation += 1
        self._dump_begin = wall_ns
        self._dump_rows = 0

    def end_poll(self, now: float, wall_ns: int = 0) -> None:
        """The dump is complete: whatever it did not contain has left the table.

        ``wall_ns``: the real time after the dump's last entry was read (0: unknown).
        """
        self._sweep(now, self._generation)
        if self.sampler is not None:
            self.sampler.dump_done()
        self._views = None  # not held between polls (and the dump order may grow)
        order = self._dump_order
        if self._dump_rows > len(order):  # room for every row position of a dump this large
            order.frombytes(b"\xff" * (8 * (self._dump_rows - len(order))))
        self._polls_done += 1
        self.memory.dumped(self._dump_begin, wall_ns)
        if self._polls_done == 1:
            self.adopt = False  # from now on, a connection the exporter has not seen is new
            self.memory.bury_restored(now)  # rows no dump showed

    @property
    def fused(self) -> bool:
        """Whether ``apply_dump_buffer`` is available (not in the lockstep tests' reference store)."""
        return self._fused_poll is not None

    def apply_dump_buffer(
        self,
        buf: memoryview,
        zones: Container[int] | None,
        now: float,
        wall_ns: int,
        zone_counts: MutableMapping[int, int],
    ) -> DecodeResult:
        """One receive buffer of the current dump, decoded and applied in one compiled pass.

        The same as decoding it into Connections and calling ``update_batch`` with them (the property
        tests hold both to the same state): a row of a known connection that did not move (most rows
        of a steady poll) is written into the columns in place, without a Python object; every other
        row becomes a Connection and goes through ``update_batch``, in dump order. ``zone_counts``
        gets the number of kept entries per zone added.
        """
        fused = self._fused_poll
        if fused is None:
            raise RuntimeError("the fused poll is not available (see .fused)")
        res = DecodeResult(*fused.apply_dump(self, buf, zones, now, wall_ns, zone_counts))
        self._dump_rows += res.kept
        return res

    def update_batch(self, dumped: Iterable[Connection], now: float, wall_ns: int) -> None:
        """Add or update the connections of one part of the current dump.

        The sampler's (if any) are kept, and applied by :meth:`apply_rows`.
        """
        if self.sampler is not None:
            self.sampler.now_ns = wall_ns
            dumped = self.sampler.select(dumped if isinstance(dumped, list) else list(dumped), self)
        self.apply_rows(dumped, now, wall_ns)

    def rows_by_level(self) -> dict[int, int]:
        """The keyed table's connections by the sampling level they were kept at (adaptive shedding's load)."""
        schedule = self.sampler.schedule if self.sampler is not None else None
        if schedule is None or not schedule.changes:
            return {0: len(self.connections)}
        return schedule.count_levels(map(self._first.__getitem__, self.connections.values()))

    def holds(self, key: ConnectionKey, ct_id: int) -> bool:
        """Whether the keyed table holds this incarnation of ``key`` (the sampler's question while shedding)."""
        s = self.connections.get(key)
        if s is None:
            return False
        held = self._ct[s]
        return held == ct_id or not held or not ct_id

    def _learn_start(self, s: int, start_ns: int) -> None:
        """As the columns learn it, unless shedding changed the probability between the kernel's start and the
        first-seen time the connection was decided at: its records keep saying the probability it was kept with."""
        schedule = self.sampler.schedule if self.sampler is not None else None
        if schedule is not None and schedule.level_at(start_ns) != schedule.level_at(self._first[s]):
            return
        super()._learn_start(s, start_ns)

    def apply_rows(self, dumped: Iterable[Connection], now: float, wall_ns: int) -> None:
        """:meth:`update_batch` of rows the sampler has kept (the fused poll's hand-over).

        Runs of new connections are admitted in one call each (:meth:`_admit_run`); every other row,
        and a new one the run stops at, goes through :meth:`_update_rows`, the Python path, which is
        all of it in the lockstep tests' reference store.
        """
        if self._admission is None:
            self._update_rows(dumped, 0, now, wall_ns, stop_at_new=False)
            return
        rows = dumped if isinstance(dumped, list) else list(dumped)
        i: int | None = 0
        while i is not None and i < len(rows):
            i = self._admit_run(rows, i, now, wall_ns)
            if i == len(rows):
                break
            i = self._update_rows(rows, i, now, wall_ns, stop_at_new=True)

    def _admit_run(self, rows: list[Connection], i: int, now: float, wall_ns: int) -> int:
        """Admit the new connections of ``rows`` from ``i`` in one call (flow_exporter/admission.py); where it stopped.

        What ``_admit`` does for each (ids, first-seen stamps, slots, columns, the keyed table, the
        queue), for rows nothing else applies to: it stops at a known key, a restored row, a
        given-up tuple, a tombstone of the same incarnation, the cap, a possible readmission or a
        slot the columns must grow for, leaving that row to :meth:`_update_rows`. The hook for new
        connections runs after the call, in row order.
        """
        assert self._admission is not None
        admitted: list[tuple[int, int, Connection]] | None = [] if self.on_new is not None else None
        i = self._admission.admit_rows(self, rows, i, now, wall_ns, admitted)
        if admitted:
            assert self.on_new is not None
            for s, flow_id, conn in admitted:
                self.on_new(_Newcomer(self, s, flow_id, conn))
        return i

    def _column_views(self) -> ColumnViews:
        """The columns' typed views for the fused poll and the admission, made once a poll (see Columns.__init__)."""
        views: ColumnViews | None = self._views
        if views is None:
            views = self._views = ColumnViews(self)
        return views

    def _admitted(self, next_slot: int, sequence: int, last_stamp: int, count: int) -> None:
        """The counters of the ``count`` connections an admission admitted since it last read them."""
        if count:  # nothing admitted: nothing moved (and Python may have moved them since)
            self._next_slot, self._last_stamp = next_slot, last_stamp
            self._new_id.advanced(sequence, count)
            self.stats.added += count
            self.queue.counted(count)

    def _update_rows(
        self, dumped: Iterable[Connection], i: int, now: float, wall_ns: int, *, stop_at_new: bool
    ) -> int | None:
        """Rows of the dump from ``i`` on, one by one; with ``stop_at_new``, stops at the first new
        connection after the first row and returns its index (None: all done).

        The hot loop of every pure poll (one pass per entry): columns are bound to locals and
        a row that did not move writes only its status (and a stop time).
        """
        gen = self._generation
        t = self.timeouts
        conns = self.connections
        queue = self.queue
        seen = self._seen
        ct = self._ct
        start = self._start
        first = self._first
        bits = self._bits
        op = self._op
        ob = self._ob
        rp = self._rp
        rb = self._rb
        tcp = self._tcp
        status = self._status
        mark = self._mark
        labels = self._labels
        last_active = self._last_active
        memory = self.memory
        restored = memory.restored
        given_up = memory.given_up
        cap = self.max_connections
        begin = i
        # From ``begin`` by index, not islice: islice would step over the rows before it again on every
        # call, and the compiled admission calls once per row it stops at (a restart's restored rows,
        # rows over the cap): 250k restored rows took minutes instead of seconds (bench_checkpoint).
        todo = dumped
        if begin:
            assert isinstance(dumped, list)  # update_batch's rows, from where the admission stopped
            todo = map(dumped.__getitem__, range(begin, len(dumped)))
        for i, conn in enumerate(todo, begin):
            key = conn.key
            s = conns.get(key)
            if s is None:
                if stop_at_new and i != begin and key not in restored and key not in given_up and len(conns) < cap:
                    return i  # the compiled admission's (update_batch); it would stop again at the others at once
                if given_up or memory.tombs:
                    self._admit_row(key, conn, now, wall_ns)
                else:  # nothing to match it against: a new connection (the first poll's path)
                    self._admit(key, conn, now, wall_ns, adopted=self.adopt)
                continue
            if seen[s] == gen:
                continue  # the same tuple twice in one dump (another zone filtered later): keep the first
            old_ct = ct[s]
            cid = conn.ct_id
            old_start = start[s]
            cstart = conn.start_ns
            if (
                (old_ct != cid and old_ct and cid)
                or (old_start != cstart and old_start and cstart)
                or (not old_start and cstart and (cstart > first[s] or self._seq[s]))
            ):  # a new incarnation of the 5-tuple (inlined _same_incarnation: hot loop)
                # A start-less entry (known from its NEW) with records, met by a row that started before
                # it was first seen, may be that entry or a later one its NEW was read after: never one id
                # for both. The row goes under a new id, flagged adopted (README, "met again").
                ambiguous = not old_start and cstart <= first[s]
                self._orphan(s, END_OF_FLOW, now)
                self._admit_row(key, conn, now, wall_ns, adopted=True if ambiguous else None)
                continue
            seen[s] = gen
            b = bits[s]
            if b & DESTROYED:
                continue  # a dump older than its DESTROY event: the event's counters are final
            if not conn.counted:
                if not b & UNCOUNTED:
                    bits[s] = b = b | UNCOUNTED
            elif b & UNCOUNTED:
                bits[s] = b = b & ~UNCOUNTED
            packets = conn.orig_packets
            rpackets = conn.reply_packets
            old_packets = op[s]
            old_rpackets = rp[s]
            obytes = conn.orig_bytes
            rbytes = conn.reply_bytes
            if obytes < ob[s] or rbytes < rb[s] or packets < old_packets or rpackets < old_rpackets:
                self._reset(s, conn, now, wall_ns)
                continue
            ts = conn.tcp_state
            if ts is None:
                ts = -1
            moved = packets > old_packets or rpackets > old_rpackets or ts != tcp[s]
            if moved:
                op[s] = packets
                ob[s] = obytes
                rp[s] = rpackets
                rb[s] = rbytes
                tcp[s] = ts
            status[s] = conn.status
            if conn.stop_ns:
                last_active[s] = conn.stop_ns
            if old_start != cstart:
                start[s] = cstart
                if not old_start:
                    self._learn_start(s, cstart)
            lab = conn.labels
            if old_ct != cid or mark[s] != conn.mark or ((lab is not None or labels) and labels.get(s) != lab):
                self._set_row(s, conn)  # an id, mark or labels change: the record prefix changes too
            if not b & PRESENT:  # a row the previous dump missed: it never left
                bits[s] = b = (b | PRESENT) & ~FINAL_DUE
                self._reason[s] = 0
                moved = True
            if moved:
                bits[s] = b | ACTIVE
                last_active[s] = conn.stop_ns or wall_ns
                ts = conn.tcp_state
                if is_dying(conn.proto, NO_TCP_STATE if ts is None else ts, conn.status):
                    # Just ended (TIME_WAIT, CLOSE, DYING): its record need not wait for a timeout.
                    if s in queue:
                        queue.update(s, active_expire=now)
                    else:
                        queue.push(s, now, now)
                elif s not in queue:
                    # Inactive (left the queue on idle timeout) and active again: back in.
                    self._idle.pop(s, None)
                    queue.push(s, now + t.active, now + t.idle)
                else:
                    queue.update(s, idle_expire=now + t.idle)
        return None

    def apply_events(
        self, new: Iterable[Connection], destroyed: Iterable[Connection], now: float, wall_ns: int
    ) -> None:
        """Conntrack NEW and DESTROY events: connections polling may never see.

        NEW adds a connection the next dump has not shown yet (so enrichment and the
        flow start happen early); DESTROY sets its final counters and schedules its
        end-of-flow record now, even if no dump ever contained it. Events of one
        receive come in kernel order, so a NEW after a DESTROY of the same tuple is
        always a new incarnation. The sampler's (if any) are kept.
        """
        if self.sampler is not None:
            self.sampler.now_ns = wall_ns
            new = self.sampler.select(list(new), self)
            destroyed = self.sampler.select(list(destroyed), self)
        conns = self.connections
        for conn in new:
            # A NEW after the DESTROY of its tuple (events come in kernel order) is a new
            # incarnation, even with a reused id. A NEW for a tuple whose entry is alive is
            # that entry (a dump showed it first), or an older incarnation the dump never
            # showed: that one's DESTROY will report it in full.
            key = conn.key
            ct_id = conn.ct_id
            s = conns.get(key)
            if s is not None:
                if not self._bits[s] & DESTROYED:
                    continue
                self._orphan(s, END_OF_FLOW, now)
            if self.memory.meet_new(key, ct_id):
                continue  # a tombstone's entry whose DESTROY is still to come, or a given-up tuple
            s = self._admit(key, conn, now, wall_ns, adopted=False, refuse=False)
            if s is not None:
                self.stats.added_from_events += 1
                self._bits[s] &= ~UNCOUNTED  # a NEW event never carries counters: the rows will tell
        for conn in destroyed:
            self._apply_destroy(conn, now, wall_ns)

    def _apply_destroy(self, conn: Connection, now: float, wall_ns: int) -> None:
        key = conn.key
        self.stats.destroyed_events += 1
        s = self.connections.get(key)
        if s is not None and same_incarnation(self._ct[s], self._start[s], conn, self._first[s]):
            self._destroy(s, conn, now, wall_ns)
            return
        for o in self._orphan_index.get((key, conn.ct_id), ()):
            if same_incarnation(self._ct[o], self._start[o], conn, self._first[o]):
                self._destroy(o, conn, now, wall_ns)  # a replaced incarnation, still awaiting its final record
                return
        settled, tomb = self.memory.meet_destroy(key, conn)
        if settled:
            return
        if tomb is not None:
            if s is not None:
                return self._late_end_of_replaced(tomb, conn, now, wall_ns)
            s = self._from_tomb(key, conn, tomb, now, wall_ns)
            self._destroy(s, conn, now, wall_ns)
            return
        # An incarnation the store never saw (it lived and died between dumps, and its NEW was
        # not taken): reported in full. If another incarnation holds the tuple, beside it.
        if s is not None:
            self._standalone(conn, now, wall_ns)
            return
        s = self._admit(key, conn, now, wall_ns, adopted=self.adopt, gone=True)
        if s is not None:
            self.stats.added_from_events += 1
            self._destroy(s, conn, now, wall_ns)

    def _standalone(self, conn: Connection, now: float, wall_ns: int) -> None:
        """Report a destroyed entry whose tuple another incarnation holds, outside the keyed table."""
        s = self._unkeyed(conn.key, conn, wall_ns, self.adopt)
        self.stats.added_from_events += 1
        self._bits[s] |= DESTROYED
        self._orphan(s, END_OF_FLOW, now, keyed=False)

    def _unkeyed(self, key: ConnectionKey, conn: Connection, wall_ns: int, adopted: bool) -> int:
        """A new connection that will not enter the keyed table (it only owes its one record)."""
        first_seen = conn.start_ns or self._stamp(wall_ns)
        flow_id = self._new_id()
        flags = ADOPTED if adopted or self.memory.readmitted(conn, wall_ns) else 0
        s = self._alloc(key, conn, flow_id, first_seen, wall_ns, flags)
        if self.on_new is not None:
            self.on_new(_Newcomer(self, s, flow_id, conn))
        return s

    def _late_end_of_replaced(self, tomb: Tombstone, conn: Connection, now: float, wall_ns: int) -> None:
        """A late DESTROY of an incarnation whose tuple a newer one holds: report it as an orphan."""
        s = self._alloc(
            conn.key, conn, tomb.flow_id, tomb.first_seen_ns, wall_ns, tomb.flags, tomb.next_seq, tomb.base
        )  # not _continue(): the keyed table holds a newer incarnation
        self.stats.resurrected += 1
        self._bits[s] |= DESTROYED
        self._orphan(s, END_OF_FLOW, now, keyed=False)

    def _destroy(self, s: int, conn: Connection, now: float, wall_ns: int) -> None:
        """The kernel deleted slot ``s``'s entry; ``conn`` is the DESTROY event's view of it."""
        totals = self._totals_of(s)
        if conn.orig_packets + conn.reply_packets == 0 and totals != ZERO:
            conn = _with_totals(conn, totals)  # no counters in the event: never lower the totals
        elif self._went_down(s, conn):
            if self._bits[s] & ORPHAN:
                conn = _with_totals(conn, totals)  # a reset we cannot place: keep what was seen
            else:
                s = self._reset(s, conn, now, wall_ns)
        self._set_row(s, conn)
        self._bits[s] = (self._bits[s] | DESTROYED) & ~PRESENT
        self._last_active[s] = conn.stop_ns or wall_ns
        self._end(s, self._reason[s] or END_OF_FLOW, now)

    def _admit_row(
        self, key: ConnectionKey, conn: Connection, now: float, wall_ns: int, adopted: bool | None = None
    ) -> None:
        """A dump row for a tuple the store does not hold (``adopted``: flag it so whatever else decides)."""
        met = self.memory.meet_row(key, conn, now, adopted)
        if met is None:
            return  # the given-up entry itself, or a dump older than its DESTROY
        tomb, adopted = met
        if tomb is not None:
            self._from_tomb(key, conn, tomb, now, wall_ns)
            return
        self._admit(key, conn, now, wall_ns, adopted=self.adopt if adopted is None else adopted)

    def _from_tomb(self, key: ConnectionKey, conn: Connection, tomb: Tombstone, now: float, wall_ns: int) -> int:
        self.stats.resurrected += 1
        return self._continue(key, conn, tomb, now, wall_ns)

    def _continue(
        self, key: ConnectionKey, conn: Connection, known: Tombstone | Restored, now: float, wall_ns: int
    ) -> int:
        """Track ``conn`` again as it was known (:meth:`_continued`), with its own record still in flight."""
        s = self._continued(key, conn, known, now, wall_ns)
        if self._loose_last:
            self._attach_in_flight(known.flow_id, s)
        return s

    def _continued(
        self, key: ConnectionKey, conn: Connection, known: Tombstone | Restored, now: float, wall_ns: int
    ) -> int:
        """Track ``conn`` again under the identity and reported state it had (a tombstone or a checkpoint row).

        A connectionId that ended with a counter reset is not continued: its entry goes on under a
        successor id from the reset on (flag 2), whose counts were never reported. Counters below
        what was reported mean a reset the store did not see (while no exporter ran): the old id
        ends with a forced-end record at its last totals, and a successor continues from zero.
        """
        flags = known.flags & RECORD_FLAGS
        reset = known.reset if isinstance(known, Tombstone) else bool(known.flags & ROW_RESET)
        if reset:
            flags = (flags & ~ADOPTED) | COUNTERS_RESET
            return self._track(key, conn, self._new_id(), known.first_seen_ns, now, wall_ns, flags)
        base = known.base
        if (
            conn.orig_packets < base[0]
            or conn.orig_bytes < base[1]
            or conn.reply_packets < base[2]
            or (conn.reply_bytes < base[3])
        ):
            s = self._track(
                key, _with_totals(conn, base), known.flow_id, known.first_seen_ns, now, wall_ns, flags,
                known.next_seq, base,
            )  # fmt: skip
            return self._reset(s, conn, now, wall_ns)
        return self._track(key, conn, known.flow_id, known.first_seen_ns, now, wall_ns, flags, known.next_seq, base)

    def _admit(
        self,
        key: ConnectionKey,
        conn: Connection,
        now: float,
        wall_ns: int,
        *,
        adopted: bool,
        gone: bool = False,
        refuse: bool = True,
    ) -> int | None:
        """Track a connection the store does not hold, unless the cap refuses it (``gone``: from its DESTROY).

        ``refuse`` False (a NEW event): at the cap, nothing happens; the next dump, or the entry's DESTROY,
        gives it up. A NEW has no start stamp, and a given-up entry named by none is one the next process
        cannot tell from a later incarnation of its tuple with the same conntrack id (memory.py, ``_unsure``).
        """
        if self.memory.restored:
            row, unsure = self.memory.match_restored(key, conn)
            if unsure:
                adopted = True  # only start-less rows with records match: a new id, flagged
            if row is not None:
                self.stats.restored += 1
                return self._continue(key, conn, row, now, wall_ns)
        if len(self.connections) + len(self._orphans) >= self.max_connections and not self._evict_idle(now):
            if refuse:
                self._refuse(key, conn, now, wall_ns, adopted, gone=gone)
            return None
        first_seen = conn.start_ns or self._stamp(wall_ns)
        flags = ADOPTED if adopted or self.memory.readmitted(conn, wall_ns) else 0
        return self._track(key, conn, self._new_id(), first_seen, now, wall_ns, flags)

    def _stamp(self, wall_ns: int) -> int:
        """First-seen time for an entry without a kernel start time: strictly increasing, so unique."""
        stamp = self._last_stamp = _admission.stamp_after(self._last_stamp, wall_ns)
        return stamp

    def _track(
        self,
        key: ConnectionKey,
        conn: Connection,
        flow_id: int,
        first_seen: int,
        now: float,
        wall_ns: int,
        flags: int = 0,
        next_seq: int = 0,
        base: Totals = ZERO,
    ) -> int:
        s = self._alloc(key, conn, flow_id, first_seen, wall_ns, flags, next_seq, base)
        interned = self._keys[s]
        assert interned is not None
        self.connections[interned] = s  # the interned key: one tuple per connection
        self.stats.added += 1
        if self.on_new is not None:
            self.on_new(_Newcomer(self, s, flow_id, conn))
        t = self.timeouts
        self.queue.push(s, now + t.active, now + t.idle)
        return s

    def _evict_idle(self, now: float) -> bool:
        """Give up the longest-idle connection with nothing unreported, to make room; False if none."""
        idle = self._idle
        conns = self.connections
        while idle:
            s = next(iter(idle))
            del idle[s]
            key = self._keys[s]
            if (
                key is None
                or conns.get(key) != s
                or self._bits[s] & ACTIVE
                or self._pending[s] is not None
                or self._reason[s]
                or s in self.queue
                or self._totals_of(s) != self._base_of(s)
            ):
                continue
            self._give_up(s, GIVE_UP_IDLE, now)
            return True
        return False

    def _refuse(
        self, key: ConnectionKey, conn: Connection, now: float, wall_ns: int, adopted: bool, *, gone: bool = False
    ) -> None:
        s = self._unkeyed(key, conn, wall_ns, adopted)
        self._give_up(s, GIVE_UP_REFUSED, now, keyed=False, remember=not gone)

    def _give_up(self, s: int, why: str, now: float, *, keyed: bool = True, remember: bool = True) -> None:
        """Stop tracking slot ``s``: one lack-of-resources record with its counts, then never again while it lasts.

        ``remember`` False: its entry is already gone (a DESTROY the store could not place), so there
        is nothing to refuse later, and the tuple's registry entry (another incarnation's) stays.
        """
        key = self._keys[s]
        assert key is not None
        if remember:
            self.memory.give_up(key, GivenUp(self._ct[s], self._start[s], self._first[s], self._fid[s], now))
        else:
            self._bits[s] |= DESTROYED  # its record leaves no given-up row: that tuple may hold a live one
        self.stats.given_up[why] = self.stats.given_up.get(why, 0) + 1
        self._cap_unlogged[why] = self._cap_unlogged.get(why, 0) + 1
        self._orphan(s, LACK_OF_RESOURCES, now, keyed=keyed)
        if now - self._cap_logged_at >= CAP_LOG_INTERVAL:
            self._cap_logged_at = now
            counts = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self._cap_unlogged.items()))
            log.warning(
                "connection cap %s reached: gave up %s (each got one lack-of-resources record; "
                "their later traffic is not exported while they last)",
                f"{self.max_connections:,}",
                counts,
            )
            self._cap_unlogged.clear()

    def _orphan(self, s: int, reason: int, now: float, *, keyed: bool = True) -> None:
        """Take slot ``s`` out of the keyed table (its tuple is taken, or it is given up); it ends with ``reason``."""
        key = self._keys[s]
        assert key is not None
        if keyed and self.connections.get(key) == s:
            del self.connections[key]
            self.queue.remove(s)
            self._idle.pop(s, None)
            if reason == END_OF_FLOW:
                self.stats.reused_tuples += 1
        self._bits[s] = (self._bits[s] | ORPHAN) & ~PRESENT
        self._orphans[self._fid[s]] = s
        if reason == END_OF_FLOW:
            self._orphan_index.setdefault((key, self._ct[s]), []).append(s)
        self._end(s, reason, now, force_record=reason in (FORCED_END, LACK_OF_RESOURCES))

    def _reset(self, s: int, conn: Connection, now: float, wall_ns: int) -> int:
        """Counters went down (zeroed): end this connectionId with what it had, continue under a new one."""
        self.stats.counter_resets += 1
        key = self._keys[s]
        assert key is not None
        meta = self._meta[s]
        first_seen = self._first[s]
        flags = self._flags[s]
        self._orphan(s, FORCED_END, now)
        new = self._alloc(key, conn, self._new_id(), first_seen, wall_ns, (flags & ~ADOPTED) | COUNTERS_RESET)
        self._meta[new] = meta
        interned = self._keys[new]
        assert interned is not None
        self.connections[interned] = new
        self.queue.push(new, now + self.timeouts.active, now + self.timeouts.idle)
        return new

    def _forget(self, s: int, now: float) -> None:
        """Drop a settled connection, leaving a tombstone for late events and rows."""
        key = self._keys[s]
        assert key is not None
        ct_id = self._ct[s]
        if self._bits[s] & ORPHAN:
            flow_id = self._fid[s]
            if self._orphans.get(flow_id) == s:
                del self._orphans[flow_id]
            ikey = (key, ct_id)
            slots = self._orphan_index.get(ikey)
            if slots is not None and s in slots:
                slots.remove(s)
                if not slots:
                    del self._orphan_index[ikey]
            if self._reason[s] != END_OF_FLOW:
                self._release(s)
                return  # given up (the registry remembers it) or reset (its successor holds the tuple)
        elif self.connections.get(key) == s:
            del self.connections[key]
            self.stats.deleted += 1
        self.memory.bury(
            key, ct_id,
            Tombstone(
                self._fid[s], ct_id, self._start[s], self._first[s], self._seq[s], self._base_of(s),
                self._flags[s], bool(self._bits[s] & DESTROYED), now + self.memory.tombstone_ttl,
            ),
            now,
        )  # fmt: skip
        self._release(s)

    def _sweep(self, now: float, gen: int) -> None:
        """Connections missing from this dump left the table: report them now, not at a deadline."""
        bits = self._bits
        for s in self._poll_core.swept(self.connections, self._seen, bits, gen):
            bits[s] &= ~PRESENT
            if not self._reason[s]:
                self._end(s, END_OF_FLOW, now)
        self.memory.expire(now)

    # ---------------------------------------------------------------- records: the ledger's batch API
    def restore(self, rows: Iterable[Restored], in_flight: Iterable[Export], *, adopting: bool) -> None:
        """A previous process's checkpoint (before the first poll): its rows, matched to the table by tuple and
        incarnation as the first dump (or an event) shows them, and its records in flight, each held by no
        connection until its own is met again (:meth:`_attach_in_flight`). ``adopting``: see Ledger.restore."""
        self.adopt = adopting
        self.memory.restore(rows)
        last = self._loose_last
        for e in in_flight:
            self._loose[(e.flow_id, e.sequence)] = e
            if e.sequence >= last.get(e.flow_id, -1):
                last[e.flow_id] = e.sequence

    def _attach_in_flight(self, flow_id: int, s: int) -> None:
        """A restored connection's own record still in flight becomes its connection's again (its pending record).

        A connection has at most one record in flight; a restored one held by no connection let the next
        record be built and delivered while it was still failing, and a process dying then (its state deleted
        for a full disk) left a sequence gap where a tail is all it may lose (found by the model soak).
        """
        seq = self._loose_last.pop(flow_id, None)
        if seq is None:
            return
        e = self._loose.get((flow_id, seq))
        if self._fid[s] != flow_id:
            s = self._orphans.get(flow_id, -1)  # ended by a reset found at the restart: its last record waits
        if e is None or s < 0 or self._pending[s] is not None:
            return
        del self._loose[(flow_id, seq)]
        e.slot = s
        self._pending[s] = e

    def _end(self, s: int, reason: int, now: float, *, force_record: bool = False) -> None:
        """Slot ``s`` ended for the exporter: schedule the record that reports it, or forget it if there is none."""
        self._reason[s] = reason
        b = self._bits[s]
        if force_record or self._seq[s] == 0 or b & LAST_ACTIVE or self._totals_of(s) != self._base_of(s):
            self._bits[s] = b | FINAL_DUE
            if b & ORPHAN:
                self._orphan_due.append(s)
            elif s in self.queue:
                self.queue.update(s, active_expire=now)
            else:
                self.queue.push(s, now, now)
        else:
            self._bits[s] = b & ~FINAL_DUE
            if self._pending[s] is None:
                self._forget(s, now)

    def next_due(self) -> float | None:
        """When the next record is due (-inf: an orphan owes one now; None: nothing is queued)."""
        if any(self._pending[s] is None for s in self._orphan_due):
            return float("-inf")
        return self.queue.next_deadline()

    def due(self, now: float, limit: int | None, out: list[Export]) -> None:
        """The records due at ``now`` (at most ``limit``), built and appended to ``out``.

        What the limit holds back stays due and is built later with its latest counters. Which slots
        get a record, and why, is decided first; the records are built after, in that order
        (:meth:`build`): a build touches only its own slot. An orphan may be queued too: once taken
        here, it waits in the queue as one whose record is in flight would (the build makes it so).
        """
        todo: list[int] = []
        why = bytearray()
        pending = self._pending
        bits = self._bits
        reason = self._reason
        taken: set[int] = set()
        if self._orphan_due:
            waiting = []
            for s in self._orphan_due:
                if pending[s] is not None or s in taken or (limit is not None and len(todo) >= limit):
                    waiting.append(s)  # goes when its record in flight settles
                elif bits[s] & FINAL_DUE and bits[s] & ORPHAN and self._keys[s] is not None:
                    todo.append(s)
                    why.append(reason[s])
                    taken.add(s)
            self._orphan_due = waiting
        retry: list[int] = []
        self._core.due(self, now, -1 if limit is None else limit, todo, why, retry, taken)
        queue = self.queue
        for s in retry:
            queue.push(s, now + RETRY_DELAY, now + RETRY_DELAY)
        if todo:
            self.build(todo, bytes(why), out)

    def build(self, slots: list[int], reasons: bytes, out: list[Export]) -> None:
        """The records of ``slots`` (for ``reasons``), appended to ``out`` in order (ledger_core.build_records)."""
        before = len(out)
        try:
            self._core.build_records(self, slots, reasons, out, self._view)
        finally:
            self.stats.records_built += len(out) - before

    def settle(self, exports: list[Export], now: float) -> None:
        """Records delivered, or failed for good, in order: a live connection may have its next record; one
        that ended may be forgotten (ledger_core.settle_delivered, the rest in :meth:`_settle_other`)."""
        self._core.settle_delivered(self, exports, self._keep_prefix, lambda e: self._settle_other(e, now))

    def _settle_other(self, export: Export, now: float) -> None:
        """A settled record that is not a live connection's one in flight: restored from a checkpoint (no slot),
        stale (its slot holds another record), or of a connection that ended (it may be forgotten now)."""
        s = export.slot
        if s < 0:
            self._loose.pop((export.flow_id, export.sequence), None)
            return
        if self._pending[s] is not export:
            return
        self._pending[s] = None
        b = self._bits[s]
        if b & FINAL_DUE or self._totals_of(s) != self._base_of(s):
            self._bits[s] = b | FINAL_DUE  # more counts arrived (a late DESTROY) after its record was built
            if b & ORPHAN:
                self._orphan_due.append(s)
            elif s not in self.queue:
                self.queue.push(s, now, now)
        elif self._settled(s):
            self._forget(s, now)

    def slots(self) -> list[int]:
        """Every slot that holds a connection: the orphans first, then the keyed table (a shutdown's pass)."""
        return [*self._orphans.values(), *self.connections.values()]

    def finals(self, todo: list[int], i: int, room: int | None, reason: int, out: list[Export]) -> int:
        """Shutdown: the last records of ``todo``'s slots from ``i`` on (at most ``room``), appended to ``out``;
        where the next call goes on.

        Live connections get ``reason`` (forced end); ones that already ended get their own end reason. A
        connection with a record in flight is skipped (the next pass meets it once that settles), so no
        counts are sent twice; a slot freed since ``todo`` was taken is skipped too.
        """
        self._orphan_due = []  # the orphans owing a record are met here, in this call or a later one
        bits = self._bits
        keys = self._keys
        slots: list[int] = []
        why = bytearray()
        while i < len(todo) and (room is None or len(slots) < room):
            s = todo[i]
            i += 1
            if keys[s] is None or self._pending[s] is not None or bits[s] & CLOSED:
                continue  # forgotten since the pass began (its slot is free), in flight, or done
            r = self._reason[s]
            if r:
                if bits[s] & FINAL_DUE:
                    slots.append(s)
                    why.append(r)
                continue
            bits[s] |= CLOSED
            if self._dying(s) and self._seq[s] and self._totals_of(s) == self._base_of(s):
                continue  # its end-of-flow record told it all (TIME_WAIT)
            self.queue.remove(s)
            slots.append(s)
            why.append(reason)
        self.build(slots, bytes(why), out)
        return i

    def unfinished(self) -> int:
        """Records built and not delivered, plus connections still owing one (shutdown)."""
        n = len(self._loose)
        bits = self._bits
        for s in self.slots():
            if self._pending[s] is not None or (bits[s] & FINAL_DUE if self._reason[s] else not bits[s] & CLOSED):
                n += 1
        return n

    def in_flight(self) -> Iterator[Export]:
        """Every record built and not known to be delivered (in flight or waiting to be resent)."""
        yield from self._loose.values()  # restored from a checkpoint: no connection holds them
        for s in [*self.connections.values(), *self._orphans.values()]:
            e = self._pending[s]
            if e is not None:
                yield e

    def reported(self) -> ReportedRows:
        """What a checkpoint keeps: every connection a restarted exporter may meet again with a record built.

        Tracked connections, connections given up at the cap, and rows restored from the
        last checkpoint that no dump has matched yet; not the orphans that ended. The tracked
        ones as slots into the columns, read when packed (under the caller's lock).
        """
        seq = self._seq
        fl = self._flags
        # Reset successors before their first record too: their ended predecessor no longer says so; and adopted
        # connections: a restart that met them as new would report counts an earlier lineage may have, unflagged.
        keep = COUNTERS_RESET | ADOPTED
        slots = [s for s in self.connections.values() if seq[s] or fl[s] & keep]
        columns = RowColumns(
            ct=self._ct, start=self._start, first=self._first, fid=self._fid, seq=seq,
            bp=self._bp, bb=self._bb, brp=self._brp, brb=self._brb, flags=fl,
        )  # fmt: skip
        return ReportedRows(slots, self._keys, columns, self._untracked_rows(), self.adopt)

    def _untracked_rows(self) -> Iterator[Restored]:
        yield from self.memory.restored_rows()
        orphans = self._orphans
        for key, g in self.memory.given_up.items():
            s = orphans.get(g.flow_id)
            if s is not None and self._owes_give_up(s):
                # Never "given up" without the record it owes: a restart would take the row's word for it and
                # never report the connection. Until that record is built it is kept as what it was before.
                if self._seq[s] or self._flags[s] & (ADOPTED | COUNTERS_RESET):
                    yield Restored(
                        key, self._ct[s], self._start[s], self._first[s], g.flow_id, self._seq[s], self._base_of(s),
                        self._flags[s] & RECORD_FLAGS,
                    )  # fmt: skip
                continue  # nothing reported yet: a restart meets it as new, as this process first did
            yield Restored(key, g.ct_id, g.start_ns, g.first_seen_ns, g.flow_id, 1, ZERO, ROW_GIVEN_UP)
        yield from self.memory.tomb_rows()

    def _owes_give_up(self, s: int) -> bool:
        """Whether orphan ``s`` was given up at the cap and its lack-of-resources record is not built yet."""
        return self._reason[s] == LACK_OF_RESOURCES and self._pending[s] is None and bool(self._bits[s] & FINAL_DUE)
