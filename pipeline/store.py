"""Connection store: the latest state of every tracked connection and its export bookkeeping.

Pure logic, no I/O and no clock of its own: the caller passes ``now`` (monotonic
seconds, for deadlines) and ``wall_ns`` (real time, for record timestamps), so
tests drive it with a fake clock.

Behaviour follows Antrea's ConntrackConnectionStore (mark-and-sweep on presence,
dying detection, active/idle/stale timeouts, re-queue on renewed activity) with
these differences, each closing a gap of the original:

* everything due is exported, with no per-tick cap;
* deltas are computed against the last record Kafka *acknowledged*, and a
  connection has at most one record in flight, so a lost record's counts ride in
  the next one and the sum of deltas always equals the kernel's totals;
* a connection that left the table is deleted only once its last record was
  acknowledged (or the stale timeout passed with nothing left to report);
* a 5-tuple reused by a new conntrack entry (new id or start time) ends the old
  connection with a final record instead of merging the two.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.connection import Connection, ConnectionKey
from pipeline.expiry import ExpiryQueue
from pipeline.timeouts import Timeouts

log = logging.getLogger(__name__)

# flowEndReason codes (IPFIX, REFERENCE.md section 2).
IDLE_TIMEOUT = 1
ACTIVE_TIMEOUT = 2
END_OF_FLOW = 3
FORCED_END = 4
LACK_OF_RESOURCES = 5

EVICTION_REASONS = (
    "idle, fully reported connections",
    "ended connections whose final record was not acknowledged",
    "active connections",
)

# How soon a connection whose record is still in flight (or failed) is looked at again.
RETRY_DELAY = 1.0


def connection_id(key: ConnectionKey, ct_id: int) -> int:
    """A signed 64-bit id stable for the connection's life (fits Avro ``long``).

    From the 5-tuple, zone and the kernel's conntrack id: all known from the first
    sight of a connection, whether a dump or a NEW event (which carries no start
    timestamp), and unchanged when the exporter restarts, so a consumer can match a
    restarted exporter's records to the earlier ones.
    """
    zone, proto, src, sport, dst, dport = key
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("!HB", zone & 0xFFFF, proto))
    h.update(src)
    h.update(dst)
    h.update(struct.pack("!HHI", sport, dport, ct_id & 0xFFFFFFFF))
    return int.from_bytes(h.digest(), "big", signed=True)


@dataclass(slots=True)
class Tracked:
    """A connection in the store plus what the exporter knows about its records."""

    key: ConnectionKey
    conn: Connection
    flow_id: int
    first_seen_ns: int
    last_active_ns: int
    last_export: float  # monotonic time of the last record built
    seen: int = 0  # generation of the last dump that contained it

    present: bool = True
    active: bool = True
    ready_to_delete: bool = False
    in_flight: bool = False
    final_acked: bool = False
    acked_records: int = 0  # also the sequence number of the next record
    acked: tuple[int, int, int, int] = (0, 0, 0, 0)
    meta: dict[str, Any] | None = None
    orphan: bool = False  # replaced in the store by a newer entry with the same 5-tuple
    destroyed: bool = False  # a DESTROY event gave its final counters
    avro_prefix: bytes | None = None  # the record's per-connection prefix (sink.encoder), cached
    avro_stamp: tuple[Any, ...] | None = None

    @property
    def totals(self) -> tuple[int, int, int, int]:
        c = self.conn
        return (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes)


@dataclass(slots=True)
class Export:
    """One record to build: a frozen snapshot of a tracked connection."""

    tracked: Tracked
    reason: int
    sequence: int
    totals: tuple[int, int, int, int]
    deltas: tuple[int, int, int, int]
    final: bool
    flow_end_ns: int


@dataclass
class StoreStats:
    added: int = 0
    deleted: int = 0
    reused_tuples: int = 0
    records_built: int = 0
    added_from_events: int = 0
    destroyed_events: int = 0
    evicted: int = 0
    dropped_new: int = 0
    evicted_by_reason: dict[str, int] = field(default_factory=dict)


@dataclass
class ConnectionStore:
    """Tracked connections keyed by :class:`ConnectionKey`, and their expiry queue."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    on_new: Callable[[Tracked], None] | None = None  # enrichment hook, called once per new connection
    max_connections: int = 500_000  # bounded memory: beyond this, evict (counted, logged)

    def __post_init__(self) -> None:
        self.connections: dict[ConnectionKey, Tracked] = {}
        self.queue = ExpiryQueue()
        self._orphans: list[Tracked] = []
        self._generation = 0
        self.stats = StoreStats()

    def __len__(self) -> int:
        return len(self.connections) + len(self._orphans)

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
                self._add(key, conn, now, wall_ns)
                continue
            if tr.seen == gen:
                continue  # the same tuple twice in one dump (another zone filtered later): keep the first
            old = tr.conn
            if (old.ct_id != conn.ct_id and old.ct_id and conn.ct_id) or (
                old.start_ns != conn.start_ns and old.start_ns and conn.start_ns
            ):  # a new incarnation of the 5-tuple (inlined _is_new_incarnation: hot loop)
                self._orphan(tr)
                self._add(key, conn, now, wall_ns)
                continue
            tr.seen = gen
            if tr.destroyed:
                continue  # a dump older than its DESTROY event: the event's counters are final
            tr.present = True
            if old.dying:
                continue  # counters of a dying connection are frozen (Antrea)
            moved = (
                conn.orig_packets > old.orig_packets
                or conn.reply_packets > old.reply_packets
                or conn.tcp_state != old.tcp_state
            )
            tr.conn = conn
            if moved:
                tr.active = True
                tr.last_active_ns = conn.stop_ns or wall_ns
                item = queue.get(key)
                if conn.dying:
                    # Just ended: its final record need not wait for the active timeout.
                    if item is None:
                        queue.push(key, now, now)
                    else:
                        queue.update(key, active_expire=now)
                elif item is None:
                    # Inactive (left the queue on idle timeout) and active again: back in.
                    queue.push(key, now + t.active, now + t.idle)
                else:
                    queue.update(key, idle_expire=now + t.idle)

    def apply_events(
        self, new: Iterable[Connection], destroyed: Iterable[Connection], now: float, wall_ns: int
    ) -> None:
        """Conntrack NEW and DESTROY events: connections polling may never see.

        NEW adds a connection the next dump has not shown yet (so enrichment and the
        flow start happen early); DESTROY sets its final counters and schedules its
        end-of-flow record now, even if no dump ever contained it.
        """
        for conn in new:
            key = conn.key
            if key not in self.connections:
                self._add(key, conn, now, wall_ns)
                self.stats.added_from_events += 1
        queue = self.queue
        for conn in destroyed:
            key = conn.key
            tr = self.connections.get(key)
            if tr is not None and _is_new_incarnation(tr.conn, conn):
                if conn.start_ns and tr.conn.start_ns and conn.start_ns < tr.conn.start_ns:
                    continue  # the end of an incarnation already replaced
                self._orphan(tr)
                tr = None
            if tr is None:
                tr = self._add(key, conn, now, wall_ns)
                if tr is None:
                    continue
                self.stats.added_from_events += 1
            elif tr.ready_to_delete or tr.final_acked:
                # Its final record went out before the event was read (it left the dump
                # first). If the event shows more traffic, one more end-of-flow record
                # carries the difference; otherwise there is nothing to add.
                if tr.in_flight or tr.orphan or _totals(conn) == tr.totals:
                    continue
                tr.conn = conn
                tr.ready_to_delete = tr.final_acked = False
            else:
                tr.conn = conn
            tr.destroyed = True
            tr.present = False
            tr.last_active_ns = conn.stop_ns or wall_ns
            self.stats.destroyed_events += 1
            if key in queue:
                queue.update(key, active_expire=now)
            else:
                queue.push(key, now, now)

    def _add(self, key: ConnectionKey, conn: Connection, now: float, wall_ns: int) -> Tracked | None:
        if len(self.connections) + len(self._orphans) >= self.max_connections and not self._make_room():
            self.stats.dropped_new += 1
            return None
        start = conn.start_ns or wall_ns
        tr = Tracked(
            key=key,
            conn=conn,
            flow_id=connection_id(key, conn.ct_id),
            first_seen_ns=start,
            last_active_ns=conn.stop_ns or wall_ns,
            last_export=now,
            seen=self._generation,
        )
        self.connections[key] = tr
        self.stats.added += 1
        if self.on_new is not None:
            self.on_new(tr)
        self.queue.push(key, now + self.timeouts.active, now + self.timeouts.idle)
        return tr

    def _make_room(self) -> bool:
        """Evict about 1% of the cap, least valuable first; False if nothing could go.

        Order: connections with nothing unreported that are idle (their next record,
        if any, starts a new sequence), then ended connections whose final record is
        not acknowledged (Kafka down for long: that record is lost), then active ones.
        Every eviction is counted by reason and logged.
        """
        want = max(1, self.max_connections // 100)
        tiers: tuple[list[ConnectionKey], list[ConnectionKey], list[ConnectionKey]] = ([], [], [])
        queue = self.queue
        for key, tr in self.connections.items():
            if tr.in_flight:
                continue
            if tr.totals == tr.acked and key not in queue:
                tiers[0].append(key)
                if len(tiers[0]) >= want:
                    break
            elif tr.ready_to_delete or not tr.present:
                tiers[1].append(key)
            else:
                tiers[2].append(key)
        evicted = 0
        for reason, keys in zip(EVICTION_REASONS, tiers, strict=True):
            take = keys[: want - evicted]
            for key in take:
                queue.remove(key)
                del self.connections[key]
            if take:
                self.stats.evicted += len(take)
                self.stats.evicted_by_reason[reason] = self.stats.evicted_by_reason.get(reason, 0) + len(take)
                log.warning("connection cap %d reached: evicted %d %s", self.max_connections, len(take), reason)
            evicted += len(take)
            if evicted >= want:
                break
        if evicted < want and self._orphans:
            n = min(len(self._orphans), want - evicted)
            del self._orphans[:n]
            self.stats.evicted += n
            log.warning("connection cap %d reached: dropped %d unreported ended connections", self.max_connections, n)
            evicted += n
        return evicted > 0

    def _orphan(self, tr: Tracked) -> None:
        """The 5-tuple now belongs to a new entry: the old connection ended unseen."""
        self.queue.remove(tr.key)
        del self.connections[tr.key]
        tr.present = False
        tr.orphan = True
        self.stats.reused_tuples += 1
        self._orphans.append(tr)

    def _sweep(self, now: float, gen: int) -> None:
        """Mark connections missing from this dump; delete those with nothing left to report."""
        stale = self.timeouts.stale
        queue = self.queue
        doomed = []
        for key, tr in self.connections.items():
            if tr.seen == gen:
                continue
            if tr.present:
                tr.present = False
                # Left the table (deleted, expired, evicted): report it now, not at its deadline.
                if key in queue:
                    queue.update(key, active_expire=now)
                elif not tr.in_flight and tr.totals != tr.acked:
                    queue.push(key, now, now)
            if tr.in_flight:
                continue
            if tr.ready_to_delete:
                if tr.final_acked:
                    doomed.append(key)
            elif key not in queue and tr.totals == tr.acked:
                doomed.append(key)  # left the table with nothing unreported
            elif now - tr.last_export >= stale and tr.totals == tr.acked:
                doomed.append(key)
        for key in doomed:
            queue.remove(key)
            del self.connections[key]
        self.stats.deleted += len(doomed)
        self._orphans = [tr for tr in self._orphans if not tr.final_acked]

    # ---------------------------------------------------------------- expiring
    def next_deadline(self) -> float | None:
        if any(not tr.in_flight and not tr.final_acked for tr in self._orphans):
            return 0.0
        return self.queue.next_deadline()

    def expire(self, now: float, wall_ns: int, limit: int | None = None) -> list[Export]:
        """Records for every connection that is due at ``now`` (at most ``limit``).

        What the limit holds back stays due and is exported later with its latest
        counters: while Kafka is slow, connections coalesce instead of queueing.
        """
        out: list[Export] = []
        t = self.timeouts
        queue = self.queue
        for tr in self._orphans:
            if not tr.in_flight and not tr.final_acked:
                tr.ready_to_delete = True
                out.append(self._export(tr, END_OF_FLOW, now, final=True))
        retry: list[Tracked] = []
        for key, item in queue.pop_due(now):
            if limit is not None and len(out) >= limit:
                queue.push(key, item.active_expire, item.idle_expire)
                break
            tr = self.connections[key]
            if tr.in_flight:
                retry.append(tr)
                continue
            if tr.conn.dying or not tr.present:
                tr.ready_to_delete = True
                out.append(self._export(tr, END_OF_FLOW, now, final=True))
                continue
            if item.idle_expire <= now:
                tr.active = False
                out.append(self._export(tr, IDLE_TIMEOUT, now, final=False))
                continue
            out.append(self._export(tr, ACTIVE_TIMEOUT, now, final=False))
            queue.push(key, now + t.active, item.idle_expire)
        for tr in retry:
            queue.push(tr.key, now + RETRY_DELAY, now + RETRY_DELAY)
        return out

    def export_all(self, now: float, reason: int = FORCED_END) -> list[Export]:
        """Final records for every connection whose end has not been acknowledged (shutdown)."""
        out = []
        for tr in [*self._orphans, *self.connections.values()]:
            if tr.final_acked or tr.in_flight:
                continue
            self.queue.remove(tr.key)
            tr.ready_to_delete = True
            out.append(self._export(tr, END_OF_FLOW if tr.orphan else reason, now, final=True))
        return out

    def unfinished(self) -> int:
        """Connections whose final record has not been acknowledged yet."""
        return sum(1 for tr in [*self._orphans, *self.connections.values()] if not tr.final_acked)

    def _export(self, tr: Tracked, reason: int, now: float, *, final: bool) -> Export:
        totals = tr.totals
        a = tr.acked
        deltas = (
            max(totals[0] - a[0], 0),
            max(totals[1] - a[1], 0),
            max(totals[2] - a[2], 0),
            max(totals[3] - a[3], 0),
        )
        tr.in_flight = True
        tr.last_export = now
        self.stats.records_built += 1
        return Export(tr, reason, tr.acked_records, totals, deltas, final, tr.conn.stop_ns or tr.last_active_ns)

    # ------------------------------------------------------------ acknowledging
    def acknowledge(self, export: Export, delivered: bool, now: float) -> None:
        """Settle a record after Kafka's delivery report.

        Delivered: its totals become the base of the next delta. Failed: nothing
        moves, and the connection is queued again so its counts go out in a new
        record with the same sequence number.
        """
        tr = export.tracked
        tr.in_flight = False
        if delivered:
            tr.acked = export.totals
            tr.acked_records += 1
            if not tr.active:
                tr.avro_prefix = None  # idle: free the cached record prefix until it is needed again
            if export.final:
                tr.final_acked = True
            return
        if export.final or tr.orphan:
            tr.ready_to_delete = False
            if not tr.orphan:
                self.queue.push(tr.key, now + RETRY_DELAY, now + RETRY_DELAY)
        elif tr.key not in self.queue and self.connections.get(tr.key) is tr:
            idle = now + (self.timeouts.idle if tr.active else RETRY_DELAY)
            self.queue.push(tr.key, now + RETRY_DELAY, idle)


def _totals(c: Connection) -> tuple[int, int, int, int]:
    return (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes)


def _is_new_incarnation(old: Connection, new: Connection) -> bool:
    if old.ct_id and new.ct_id and old.ct_id != new.ct_id:
        return True
    return bool(old.start_ns and new.start_ns and old.start_ns != new.start_ns)
