"""Connection store: the latest state of every tracked connection and what has been reported of it.

Pure logic, no I/O and no clock of its own: the caller passes ``now`` (monotonic
seconds, for deadlines) and ``wall_ns`` (real time, for record timestamps), so
tests drive it with a fake clock.

Behaviour follows Antrea's ConntrackConnectionStore (mark-and-sweep on presence,
dying detection, active/idle timeouts, re-queue on renewed activity); what differs
is there to keep the accounting contract (README, "Counting: the contract"):

* everything due is exported, with no per-tick cap;
* a record is frozen when built and its totals become the base of the next delta at
  once; a failed delivery is resent as the same record (the sink keeps its bytes), so
  (connectionId, sequence) never carries two contents and the deltas always add up;
* a connection has at most one record in flight: while Kafka is slow its counts
  coalesce into the next record instead of queueing;
* a connection that left the table is reported at once and remembered for a while
  afterwards (a tombstone), so a DESTROY event read after the sweep, or a dump row of
  an entry the previous dump missed, continues its sequence instead of starting over;
* a 5-tuple reused by a new conntrack entry (new id or start time) and counters that
  went down (``conntrack -Z``) end the old connectionId and start a new one;
* past ``max_connections`` the store gives connections up, each once, with a
  lack-of-resources record, and does not take them back while they last.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from flow_exporter.connection import Connection, ConnectionKey
from flow_exporter.expiry import ExpiryQueue
from flow_exporter.flow import (
    ACTIVE_TIMEOUT,
    ADOPTED,
    COUNTERS_RESET,
    END_OF_FLOW,
    FORCED_END,
    IDLE_TIMEOUT,
    LACK_OF_RESOURCES,
    Export,
    Restored,
    Tracked,
    connection_id,
    next_segment_id,
)
from flow_exporter.settings import DEFAULTS
from flow_exporter.timeouts import Timeouts

log = logging.getLogger(__name__)

# How soon a connection whose record is still in flight is looked at again.
RETRY_DELAY = 1.0
# A failed record is resent after RETRY_DELAY, doubling per attempt up to this.
RESEND_MAX_DELAY = 30.0
# The cap's log line comes at most this often (seconds), with the counts since the last one.
CAP_LOG_INTERVAL = 60.0

# Labels of the give-up counter (metrics: flow_exporter_connections_given_up_total{reason}).
GIVE_UP_REFUSED = "cap_refused"  # a new connection found the store full
GIVE_UP_IDLE = "cap_idle"  # an idle, fully reported connection made room for a new one


@dataclass(slots=True)
class Tombstone:
    """What is left of a connection after it was forgotten, for late events and rows."""

    flow_id: int
    ct_id: int
    start_ns: int
    first_seen_ns: int
    next_seq: int
    base: tuple[int, int, int, int]
    flags: int
    destroyed: bool
    deadline: float


@dataclass
class StoreStats:
    added: int = 0
    deleted: int = 0
    reused_tuples: int = 0
    records_built: int = 0
    added_from_events: int = 0
    destroyed_events: int = 0
    resurrected: int = 0  # continued from a tombstone by a late event or row
    late_destroys_dropped: int = 0  # late DESTROY events with nothing new to report
    counter_resets: int = 0
    restored: int = 0  # continued from the checkpoint
    restored_gone: int = 0  # in the checkpoint, no longer in the table: ended while no exporter ran
    resends: int = 0  # records scheduled again after a failed delivery
    given_up: dict[str, int] = field(default_factory=dict)  # by reason
    unreported_ends: int = 0  # final counters the store could not report (given up, or no known connection)


def _same_incarnation(ct_id: int, start_ns: int, conn: Connection, first_seen_ns: int = 0) -> bool:
    """Whether ``conn`` is the entry known by (ct_id, start_ns); unknown values (0) match anything.

    An entry first learned from a NEW event has no start time, but it started before the
    exporter saw it: a start later than ``first_seen_ns`` is a later incarnation (a tuple
    re-created with the same conntrack id).
    """
    if ct_id and conn.ct_id and ct_id != conn.ct_id:
        return False
    if start_ns:
        return not (conn.start_ns and start_ns != conn.start_ns)
    return not (first_seen_ns and conn.start_ns > first_seen_ns)


def _totals(c: Connection) -> tuple[int, int, int, int]:
    return (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes)


def _went_down(old: Connection, new: Connection) -> bool:
    return (
        new.orig_bytes < old.orig_bytes
        or new.reply_bytes < old.reply_bytes
        or new.orig_packets < old.orig_packets
        or new.reply_packets < old.reply_packets
    )


@dataclass
class ConnectionStore:
    """Tracked connections keyed by :class:`ConnectionKey`, and their expiry queue."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    on_new: Callable[[Tracked], None] | None = None  # enrichment hook, called once per new connection
    max_connections: int = DEFAULTS["limits.maxConnections"]  # bounded memory: beyond this, connections are given up
    lineage: bytes = b""  # part of every connectionId; random unless the checkpoint gives one
    adopt: bool = True  # no state to continue from: connections found live are flagged ADOPTED

    def __post_init__(self) -> None:
        if not self.lineage:
            self.lineage = os.urandom(8)
        self.connections: dict[ConnectionKey, Tracked] = {}
        self.queue = ExpiryQueue()
        self._orphans: dict[int, Tracked] = {}  # by flow_id: out of the table, final record pending
        self._orphan_index: dict[tuple[ConnectionKey, int], Tracked] = {}  # by (tuple, ct_id), for DESTROY
        self._orphan_due: list[Tracked] = []
        self._tombs: dict[tuple[ConnectionKey, int], Tombstone] = {}
        self._tomb_order: deque[tuple[float, tuple[ConnectionKey, int]]] = deque()
        self._given_up: dict[ConnectionKey, list[int]] = {}  # key -> [ct_id, start_ns, generation seen]
        self._idle: dict[ConnectionKey, None] = {}  # idle connections, oldest first: eviction candidates
        self._restored: dict[ConnectionKey, list[Restored]] = {}
        self._loose: dict[tuple[int, int], Export] = {}  # restored records in flight: no connection holds them
        self._resend: list[tuple[float, int, Export]] = []  # heap of failed records waiting to go again
        self._resend_seq = itertools.count()
        self._generation = 0
        self._last_stamp = 0
        self._polls_done = 0
        self._cap_logged_at = float("-inf")
        self._cap_unlogged: dict[str, int] = {}
        self.stats = StoreStats()
        self.tombstone_ttl = max(2 * self.timeouts.poll_interval, 10.0)

    def __len__(self) -> int:
        return len(self.connections) + len(self._orphans)

    # ----------------------------------------------------------------- restore
    def restore(self, rows: Iterable[Restored], resends: Iterable[Export]) -> None:
        """Continue from a previous process's checkpoint (before the first poll).

        Rows are matched to the table by tuple and incarnation as the first dump (or an
        event) shows them; the ones no dump shows ended while no exporter ran. Resends are
        records the previous process built but could not see delivered: they go out
        again as they were, and their totals are already in the rows' bases.
        """
        self.adopt = False
        for row in rows:
            self._restored.setdefault(row.key, []).append(row)
        for e in resends:
            self._loose[(e.flow_id, e.sequence)] = e
            heapq.heappush(self._resend, (float("-inf"), next(self._resend_seq), e))

    # ----------------------------------------------------------------- polling
    def update(self, dumped: Iterable[Connection], now: float, wall_ns: int) -> None:
        """Apply one full conntrack dump: add or update what is in it, then sweep what is not."""
        self.begin_poll()
        self.update_batch(dumped, now, wall_ns)
        self.end_poll(now)

    def begin_poll(self) -> None:
        """Start applying a dump that arrives in batches (``update_batch``, then ``end_poll``)."""
        self._generation += 1

    def end_poll(self, now: float) -> None:
        """The dump is complete: whatever it did not contain has left the table."""
        self._sweep(now, self._generation)
        self._polls_done += 1
        if self._polls_done == 1:
            self.adopt = False  # from now on, a connection the exporter has not seen is new
            if self._restored:
                gone = sum(len(rows) for rows in self._restored.values())
                self.stats.restored_gone += gone
                log.info(
                    "%d connections of the checkpoint ended while no exporter ran; "
                    "counts after their last record are unknown",
                    gone,
                )
                self._restored.clear()

    def update_batch(self, dumped: Iterable[Connection], now: float, wall_ns: int) -> None:
        """Add or update the connections of one part of the current dump."""
        gen = self._generation
        t = self.timeouts
        conns = self.connections
        queue = self.queue
        for conn in dumped:
            key = conn.key
            tr = conns.get(key)
            if tr is None:
                self._admit_row(key, conn, now, wall_ns)
                continue
            if tr.seen == gen:
                continue  # the same tuple twice in one dump (another zone filtered later): keep the first
            old = tr.conn
            if (
                (old.ct_id != conn.ct_id and old.ct_id and conn.ct_id)
                or (old.start_ns != conn.start_ns and old.start_ns and conn.start_ns)
                or (not old.start_ns and conn.start_ns > tr.first_seen_ns)
            ):  # a new incarnation of the 5-tuple (inlined _same_incarnation: hot loop)
                self._orphan(tr, END_OF_FLOW, now)
                self._admit_row(key, conn, now, wall_ns)
                continue
            tr.seen = gen
            if tr.destroyed:
                continue  # a dump older than its DESTROY event: the event's counters are final
            if _went_down(old, conn):
                self._reset(tr, conn, now, wall_ns)
                continue
            moved = (
                conn.orig_packets > old.orig_packets
                or conn.reply_packets > old.reply_packets
                or conn.tcp_state != old.tcp_state
            )
            tr.conn = conn
            if not tr.present:  # a row the previous dump missed: it never left
                tr.present = True
                tr.end_reason = 0
                tr.final_due = False
                moved = True
            if moved:
                tr.active = True
                tr.last_active_ns = conn.stop_ns or wall_ns
                item = queue.get(key)
                if conn.dying:
                    # Just ended (TIME_WAIT, CLOSE, DYING): its record need not wait for a timeout.
                    if item is None:
                        queue.push(key, now, now)
                    else:
                        queue.update(key, active_expire=now)
                elif item is None:
                    # Inactive (left the queue on idle timeout) and active again: back in.
                    self._idle.pop(key, None)
                    queue.push(key, now + t.active, now + t.idle)
                else:
                    queue.update(key, idle_expire=now + t.idle)

    def apply_events(
        self, new: Iterable[Connection], destroyed: Iterable[Connection], now: float, wall_ns: int
    ) -> None:
        """Conntrack NEW and DESTROY events: connections polling may never see.

        NEW adds a connection the next dump has not shown yet (so enrichment and the
        flow start happen early); DESTROY sets its final counters and schedules its
        end-of-flow record now, even if no dump ever contained it. Events of one
        receive come in kernel order, so a NEW after a DESTROY of the same tuple is
        always a new incarnation.
        """
        conns = self.connections
        for conn in new:
            # A NEW after the DESTROY of its tuple (events come in kernel order) is a new
            # incarnation, even with a reused id. A NEW for a tuple whose entry is alive is
            # that entry (a dump showed it first), or an older incarnation the dump never
            # showed: that one's DESTROY will report it in full.
            key = conn.key
            ct_id = conn.ct_id
            tr = conns.get(key)
            if tr is not None:
                if not tr.destroyed:
                    continue
                self._orphan(tr, END_OF_FLOW, now)
            if self._tombs:
                tomb = self._tombs.get((key, ct_id))
                if tomb is not None:
                    if not tomb.destroyed:
                        continue  # seen by a dump, swept, its DESTROY still to come
                    del self._tombs[(key, ct_id)]
            g = self._given_up.get(key)
            if g is not None:
                if not g[0] or not ct_id or g[0] == ct_id:
                    continue  # the given-up entry itself
                del self._given_up[key]
            if self._admit(key, conn, now, wall_ns, adopted=False) is not None:
                self.stats.added_from_events += 1
        for conn in destroyed:
            self._apply_destroy(conn, now, wall_ns)

    def _apply_destroy(self, conn: Connection, now: float, wall_ns: int) -> None:
        key = conn.key
        self.stats.destroyed_events += 1
        tr = self.connections.get(key)
        if tr is not None and _same_incarnation(tr.conn.ct_id, tr.conn.start_ns, conn, tr.first_seen_ns):
            self._destroy(tr, conn, now, wall_ns)
            return
        o = self._orphan_index.get((key, conn.ct_id))
        if (
            o is not None
            and o.end_reason == END_OF_FLOW
            and _same_incarnation(o.conn.ct_id, o.conn.start_ns, conn, o.first_seen_ns)
        ):
            self._destroy(o, conn, now, wall_ns)  # a replaced incarnation, still awaiting its final record
            return
        tomb = self._tombs.get((key, conn.ct_id))
        if tomb is not None and _same_incarnation(tomb.ct_id, tomb.start_ns, conn, tomb.first_seen_ns):
            if tomb.destroyed or conn.orig_packets + conn.reply_packets == 0 or _totals(conn) == tomb.base:
                self.stats.late_destroys_dropped += 1
                return
            del self._tombs[(key, conn.ct_id)]
            if tr is not None:
                return self._late_end_of_replaced(tomb, conn, now, wall_ns)
            tr = self._from_tomb(key, conn, tomb, now, wall_ns)
            self._destroy(tr, conn, now, wall_ns)
            return
        g = self._given_up.get(key)
        if g is not None and _same_incarnation(g[0], g[1], conn):
            del self._given_up[key]
            self.stats.unreported_ends += 1  # given up at the cap: its last counts are not reported
            return
        # An incarnation the store never saw (it lived and died between dumps, and its NEW was
        # not taken): reported in full. If another incarnation holds the tuple, beside it.
        if tr is not None:
            self._standalone(conn, now, wall_ns)
            return
        tr = self._admit(key, conn, now, wall_ns, adopted=self.adopt)
        if tr is not None:
            self.stats.added_from_events += 1
            self._destroy(tr, conn, now, wall_ns)

    def _standalone(self, conn: Connection, now: float, wall_ns: int) -> None:
        """Report a destroyed entry whose tuple another incarnation holds, outside the keyed table."""
        tr = self._unkeyed(conn.key, conn, now, wall_ns, self.adopt)
        self.stats.added_from_events += 1
        tr.destroyed = True
        self._orphan(tr, END_OF_FLOW, now, keyed=False)

    def _unkeyed(self, key: ConnectionKey, conn: Connection, now: float, wall_ns: int, adopted: bool) -> Tracked:
        """A new connection that will not enter the keyed table (it only owes its one record)."""
        first_seen = conn.start_ns or self._stamp(wall_ns)
        tr = Tracked(
            key=key,
            conn=conn,
            flow_id=connection_id(self.lineage, key, conn.ct_id, conn.start_ns, first_seen),
            first_seen_ns=first_seen,
            last_active_ns=conn.stop_ns or wall_ns,
            last_export=now,
            flags=ADOPTED if adopted else 0,
        )
        if self.on_new is not None:
            self.on_new(tr)
        return tr

    def _late_end_of_replaced(self, tomb: Tombstone, conn: Connection, now: float, wall_ns: int) -> None:
        """A late DESTROY of an incarnation whose tuple a newer one holds: report it as an orphan."""
        tr = Tracked(
            key=conn.key,
            conn=conn,
            flow_id=tomb.flow_id,
            first_seen_ns=tomb.first_seen_ns,
            last_active_ns=conn.stop_ns or wall_ns,
            last_export=now,
            next_seq=tomb.next_seq,
            base=tomb.base,
            flags=tomb.flags,
        )  # not _continue(): the keyed table holds a newer incarnation
        self.stats.resurrected += 1
        self._orphan(tr, END_OF_FLOW, now, keyed=False)
        tr.destroyed = True

    def _destroy(self, tr: Tracked, conn: Connection, now: float, wall_ns: int) -> None:
        """The kernel deleted ``tr``'s entry; ``conn`` is the DESTROY event's view of it."""
        if conn.orig_packets + conn.reply_packets == 0 and tr.totals != (0, 0, 0, 0):
            conn = _with_totals(conn, tr.totals)  # no counters in the event: never lower the totals
        elif _went_down(tr.conn, conn):
            if tr.orphan:
                conn = _with_totals(conn, tr.totals)  # a reset we cannot place: keep what was seen
            else:
                tr = self._reset(tr, conn, now, wall_ns)
        tr.conn = conn
        tr.destroyed = True
        tr.present = False
        tr.last_active_ns = conn.stop_ns or wall_ns
        self._end(tr, tr.end_reason or END_OF_FLOW, now)

    def _admit_row(self, key: ConnectionKey, conn: Connection, now: float, wall_ns: int) -> None:
        """A dump row for a tuple the store does not hold."""
        g = self._given_up.get(key)
        if g is not None:
            if _same_incarnation(g[0], g[1], conn):
                g[2] = self._generation
                return
            del self._given_up[key]
        if self._tombs:
            tomb = self._tombs.get((key, conn.ct_id))
            if tomb is not None and _same_incarnation(tomb.ct_id, tomb.start_ns, conn, tomb.first_seen_ns):
                if tomb.destroyed:
                    return  # a dump older than its DESTROY event
                del self._tombs[(key, conn.ct_id)]
                self._from_tomb(key, conn, tomb, now, wall_ns)
                return
        self._admit(key, conn, now, wall_ns, adopted=self.adopt)

    def _from_tomb(self, key: ConnectionKey, conn: Connection, tomb: Tombstone, now: float, wall_ns: int) -> Tracked:
        self.stats.resurrected += 1
        return self._continue(key, conn, tomb, now, wall_ns)

    def _continue(
        self, key: ConnectionKey, conn: Connection, known: Tombstone | Restored, now: float, wall_ns: int
    ) -> Tracked:
        """Track ``conn`` again under the identity and reported state it had (a tombstone or a checkpoint row)."""
        tr = self._track(key, conn, known.flow_id, known.first_seen_ns, now, wall_ns)
        tr.next_seq = known.next_seq
        tr.base = known.base
        tr.flags = known.flags
        return tr

    def _admit(
        self, key: ConnectionKey, conn: Connection, now: float, wall_ns: int, *, adopted: bool
    ) -> Tracked | None:
        """Track a connection the store does not hold, unless the cap refuses it."""
        if self._restored:
            rows = self._restored.get(key)
            if rows is not None:
                for i, row in enumerate(rows):
                    if _same_incarnation(row.ct_id, row.start_ns, conn, row.first_seen_ns):
                        del rows[i]
                        if not rows:
                            del self._restored[key]
                        self.stats.restored += 1
                        return self._continue(key, conn, row, now, wall_ns)
        if len(self.connections) + len(self._orphans) >= self.max_connections and not self._evict_idle(now):
            self._refuse(key, conn, now, wall_ns, adopted)
            return None
        first_seen = conn.start_ns or self._stamp(wall_ns)
        flow_id = connection_id(self.lineage, key, conn.ct_id, conn.start_ns, first_seen)
        tr = self._track(key, conn, flow_id, first_seen, now, wall_ns)
        if adopted:
            tr.flags = ADOPTED
        return tr

    def _stamp(self, wall_ns: int) -> int:
        """First-seen time for an entry without a kernel start time: strictly increasing, so unique."""
        stamp = max(wall_ns, self._last_stamp + 1)
        self._last_stamp = stamp
        return stamp

    def _track(
        self, key: ConnectionKey, conn: Connection, flow_id: int, first_seen: int, now: float, wall_ns: int
    ) -> Tracked:
        # Positional: key, conn, flow_id, first_seen_ns, last_active_ns, last_export, seen.
        tr = Tracked(key, conn, flow_id, first_seen, conn.stop_ns or wall_ns, now, self._generation)
        self.connections[key] = tr
        self.stats.added += 1
        if self.on_new is not None:
            self.on_new(tr)
        t = self.timeouts
        self.queue.push(key, now + t.active, now + t.idle)
        return tr

    # --------------------------------------------------------------------- cap
    def _evict_idle(self, now: float) -> bool:
        """Give up the longest-idle connection with nothing unreported, to make room; False if none."""
        idle = self._idle
        conns = self.connections
        while idle:
            key = next(iter(idle))
            del idle[key]
            tr = conns.get(key)
            if (
                tr is None
                or tr.active
                or tr.pending is not None
                or tr.end_reason
                or key in self.queue
                or tr.totals != tr.base
            ):
                continue
            self._give_up(tr, GIVE_UP_IDLE, now)
            return True
        return False

    def _refuse(self, key: ConnectionKey, conn: Connection, now: float, wall_ns: int, adopted: bool) -> None:
        self._give_up(self._unkeyed(key, conn, now, wall_ns, adopted), GIVE_UP_REFUSED, now, keyed=False)

    def _give_up(self, tr: Tracked, why: str, now: float, *, keyed: bool = True) -> None:
        """Stop tracking ``tr``: one lack-of-resources record with its counts, then never again while it lasts."""
        c = tr.conn
        self._given_up[tr.key] = [c.ct_id, c.start_ns, self._generation]
        self.stats.given_up[why] = self.stats.given_up.get(why, 0) + 1
        self._cap_unlogged[why] = self._cap_unlogged.get(why, 0) + 1
        self._orphan(tr, LACK_OF_RESOURCES, now, keyed=keyed)
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

    # ----------------------------------------------------------- ending things
    def _orphan(self, tr: Tracked, reason: int, now: float, *, keyed: bool = True) -> None:
        """Take ``tr`` out of the keyed table (its tuple is taken, or it is given up); it ends with ``reason``."""
        if keyed and self.connections.get(tr.key) is tr:
            del self.connections[tr.key]
            self.queue.remove(tr.key)
            self._idle.pop(tr.key, None)
            if reason == END_OF_FLOW:
                self.stats.reused_tuples += 1
        tr.orphan = True
        tr.present = False
        self._orphans[tr.flow_id] = tr
        self._orphan_index[(tr.key, tr.conn.ct_id)] = tr
        self._end(tr, reason, now, force_record=reason in (FORCED_END, LACK_OF_RESOURCES))

    def _end(self, tr: Tracked, reason: int, now: float, *, force_record: bool = False) -> None:
        """``tr`` ended for the exporter: schedule the record that reports it, or forget it if there is none."""
        tr.end_reason = reason
        tr.final_due = force_record or tr.totals != tr.base or tr.next_seq == 0
        if tr.final_due:
            if tr.orphan:
                self._orphan_due.append(tr)
            elif tr.key in self.queue:
                self.queue.update(tr.key, active_expire=now)
            else:
                self.queue.push(tr.key, now, now)
        elif tr.pending is None:
            self._forget(tr, now)

    def _reset(self, tr: Tracked, conn: Connection, now: float, wall_ns: int) -> Tracked:
        """Counters went down (zeroed): end this connectionId with what it had, continue under a new one."""
        self.stats.counter_resets += 1
        key = tr.key
        meta = tr.meta
        self._orphan(tr, FORCED_END, now)
        new = Tracked(
            key=key,
            conn=conn,
            flow_id=next_segment_id(tr.flow_id),
            first_seen_ns=tr.first_seen_ns,
            last_active_ns=conn.stop_ns or wall_ns,
            last_export=now,
            seen=self._generation,
            flags=(tr.flags & ~ADOPTED) | COUNTERS_RESET,
            meta=meta,
        )
        self.connections[key] = new
        self.queue.push(key, now + self.timeouts.active, now + self.timeouts.idle)
        return new

    def _forget(self, tr: Tracked, now: float) -> None:
        """Drop a settled connection, leaving a tombstone for late events and rows."""
        if tr.orphan:
            self._orphans.pop(tr.flow_id, None)
            ikey = (tr.key, tr.conn.ct_id)
            if self._orphan_index.get(ikey) is tr:
                del self._orphan_index[ikey]
            if tr.end_reason != END_OF_FLOW:
                return  # given up (the registry remembers it) or reset (its successor holds the tuple)
        elif self.connections.get(tr.key) is tr:
            del self.connections[tr.key]
            self.queue.remove(tr.key)
            self._idle.pop(tr.key, None)
            self.stats.deleted += 1
        c = tr.conn
        tkey = (tr.key, c.ct_id)
        self._tombs[tkey] = Tombstone(
            tr.flow_id,
            c.ct_id,
            c.start_ns,
            tr.first_seen_ns,
            tr.next_seq,
            tr.base,
            tr.flags,
            tr.destroyed,
            now + self.tombstone_ttl,
        )
        self._tomb_order.append((now + self.tombstone_ttl, tkey))

    def _sweep(self, now: float, gen: int) -> None:
        """Connections missing from this dump left the table: report them now, not at a deadline."""
        gone = [tr for tr in self.connections.values() if tr.seen != gen and tr.present and not tr.destroyed]
        for tr in gone:
            tr.present = False
            if not tr.end_reason:
                self._end(tr, END_OF_FLOW, now)
        if self._given_up:
            for key in [k for k, g in self._given_up.items() if g[2] != gen]:
                del self._given_up[key]
        order = self._tomb_order
        while order and order[0][0] <= now:
            _, tkey = order.popleft()
            tomb = self._tombs.get(tkey)
            if tomb is not None and tomb.deadline <= now:
                del self._tombs[tkey]

    # ---------------------------------------------------------------- expiring
    def next_deadline(self) -> float | None:
        if any(tr.pending is None for tr in self._orphan_due):
            return float("-inf")
        deadline = self.queue.next_deadline()
        if self._resend:
            due = self._resend[0][0]
            deadline = due if deadline is None else min(deadline, due)
        return deadline

    def expire(self, now: float, wall_ns: int, limit: int | None = None) -> list[Export]:
        """Records for every connection that is due at ``now`` (at most ``limit``), resends first.

        What the limit holds back stays due and is exported later with its latest
        counters: while Kafka is slow, connections coalesce instead of queueing.
        """
        out: list[Export] = []
        resend = self._resend
        while resend and resend[0][0] <= now and (limit is None or len(out) < limit):
            out.append(heapq.heappop(resend)[2])
        if self._orphan_due:
            waiting = []
            for tr in self._orphan_due:
                if tr.pending is not None or (limit is not None and len(out) >= limit):
                    waiting.append(tr)  # goes when its record in flight settles
                elif tr.final_due:
                    out.append(self._build(tr, tr.end_reason, now))
            self._orphan_due = waiting
        active = self.timeouts.active
        queue = self.queue
        requeue = queue.requeue
        conns = self.connections
        append = out.append
        retry: list[ConnectionKey] = []
        for key, item in queue.pop_due(now):
            if limit is not None and len(out) >= limit:
                queue.push(key, item.active_expire, item.idle_expire)
                break
            tr = conns[key]
            if tr.pending is not None:
                retry.append(key)
                continue
            if tr.end_reason:
                if tr.final_due:
                    out.append(self._build(tr, tr.end_reason, now))
                continue
            if tr.conn.dying:
                # TIME_WAIT or CLOSE: still in the table, but over; later movement queues it again.
                out.append(self._build(tr, END_OF_FLOW, now))
                continue
            if item.idle_expire <= now:
                tr.active = False
                self._idle[key] = None
                out.append(self._build(tr, IDLE_TIMEOUT, now))
                continue
            append(self._build(tr, ACTIVE_TIMEOUT, now))
            requeue(key, item, now + active, item.idle_expire)
        for key in retry:
            queue.push(key, now + RETRY_DELAY, now + RETRY_DELAY)
        return out

    def export_all(self, now: float, reason: int = FORCED_END) -> list[Export]:
        """Shutdown: a last record for every connection with something unreported (or never reported).

        Live connections get ``reason`` (forced end); ones that already ended get their own
        end reason. A connection with a record in flight gets its turn once that settles,
        so no counts are sent twice; resends go out as they are.
        """
        out = [e for _, _, e in self._resend]
        self._resend.clear()
        for tr in [*self._orphans.values(), *self.connections.values()]:
            if tr.pending is not None or tr.closed:
                continue
            if tr.end_reason:
                if tr.final_due:
                    out.append(self._build(tr, tr.end_reason, now))
                continue
            tr.closed = True
            if tr.conn.dying and tr.next_seq and tr.totals == tr.base:
                continue  # its end-of-flow record told it all (TIME_WAIT)
            self.queue.remove(tr.key)
            out.append(self._build(tr, reason, now))
        self._orphan_due = []
        return out

    def unfinished(self) -> int:
        """Records built and not delivered, plus connections still owing one (shutdown)."""
        n = len(self._loose)
        for tr in [*self._orphans.values(), *self.connections.values()]:
            if tr.pending is not None or (tr.final_due if tr.end_reason else not tr.closed):
                n += 1
        return n

    def _build(self, tr: Tracked, reason: int, now: float) -> Export:
        # One call per record (bench/bench_app_export.py): attribute reads and conditionals, no max() calls.
        c = tr.conn
        totals = (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes)
        b = tr.base
        d0 = totals[0] - b[0]
        d1 = totals[1] - b[1]
        d2 = totals[2] - b[2]
        d3 = totals[3] - b[3]
        deltas = (d0 if d0 > 0 else 0, d1 if d1 > 0 else 0, d2 if d2 > 0 else 0, d3 if d3 > 0 else 0)
        final = bool(tr.end_reason)
        e = Export(tr, reason, tr.next_seq, totals, deltas, final, c.stop_ns or tr.last_active_ns, tr.flow_id)
        tr.next_seq += 1
        tr.base = totals
        tr.pending = e
        tr.last_export = now
        if final:
            tr.final_due = False
        self.stats.records_built += 1
        return e

    # ------------------------------------------------------------ acknowledging
    def acknowledge(self, export: Export, delivered: bool, now: float, *, permanent: bool = False) -> None:
        """Settle a record after Kafka's delivery report.

        Failed: the same record (same bytes) goes again after a backoff, and the
        connection's newer counts wait for the record after it. Delivered, or failed
        for good (``permanent``: a record Kafka will never take, counted by the caller):
        the connection may have its next record, or be forgotten if it has ended.
        """
        if not delivered and not permanent:
            self.stats.resends += 1
            delay = min(RETRY_DELAY * (2 ** min(export.attempts, 16)), RESEND_MAX_DELAY)
            export.attempts += 1
            heapq.heappush(self._resend, (now + delay, next(self._resend_seq), export))
            return
        tr = export.tracked
        if tr is None:
            self._loose.pop((export.flow_id, export.sequence), None)
            return
        if tr.pending is not export:
            return
        tr.pending = None
        if tr.end_reason:
            if tr.final_due or tr.totals != tr.base:
                tr.final_due = True  # more counts arrived (a late DESTROY) after its record was built
                if tr.orphan:
                    self._orphan_due.append(tr)
                elif tr.key not in self.queue:
                    self.queue.push(tr.key, now, now)
            elif tr.settled:
                self._forget(tr, now)
        elif not tr.active:
            tr.avro_prefix = None  # idle: free the cached record prefix until it is needed again

    # -------------------------------------------------------------- checkpoint
    def reported(self) -> Iterator[Restored]:
        """What a checkpoint keeps: every connection a restarted exporter may meet again with a record built.

        Tracked connections, connections given up at the cap, and rows restored from the
        last checkpoint that no dump has matched yet; not the orphans that ended.
        """
        new = tuple.__new__  # a NamedTuple without its __new__'s overhead: 250k of them per snapshot
        for tr in self.connections.values():
            if tr.next_seq:
                c = tr.conn
                yield new(Restored, (tr.key, c.ct_id, c.start_ns, tr.first_seen_ns, tr.flow_id, tr.next_seq, tr.base,
                                     tr.flags))  # fmt: skip
        for tr in self._orphans.values():
            if tr.next_seq and tr.end_reason == LACK_OF_RESOURCES:
                c = tr.conn
                yield new(Restored, (tr.key, c.ct_id, c.start_ns, tr.first_seen_ns, tr.flow_id, tr.next_seq, tr.base,
                                     tr.flags))  # fmt: skip
        for rows in self._restored.values():
            yield from rows

    def in_flight(self) -> Iterator[Export]:
        """Every record built and not known to be delivered (in flight or waiting to be resent)."""
        yield from self._loose.values()  # restored from a checkpoint: no connection holds them
        for tr in [*self.connections.values(), *self._orphans.values()]:
            if tr.pending is not None:
                yield tr.pending


def _with_totals(conn: Connection, totals: tuple[int, int, int, int]) -> Connection:
    return replace(
        conn, orig_packets=totals[0], orig_bytes=totals[1], reply_packets=totals[2], reply_bytes=totals[3]
    )
