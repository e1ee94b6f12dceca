"""What the store remembers of connections it does not track, and what that memory says a row or an event is.

Four things, each bounded:

* tombstones: connections forgotten after their last record, kept a while for a late DESTROY event or a
  dump row of an entry the previous dump missed, which continue their sequence instead of starting over;
* connections given up at the cap: not taken back while their entry lasts (and a tombstone's life after);
* a checkpoint's rows no dump has matched yet (a restart): matched by tuple and incarnation;
* the complete dumps of this process: an entry that lived through one and is met as unknown was forgotten.

The table (:mod:`flow_exporter.store.table`) asks, with the row or event in hand, and acts on the answer;
this object decides and keeps its own dictionaries. The compiled admission reads ``restored``, ``given_up``
and ``tombs`` (membership only) to leave every remembered tuple to the table's Python path.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from flow_exporter.connection import Connection, ConnectionKey
from flow_exporter.flow import RECORD_FLAGS, ROW_ENDED, ROW_GIVEN_UP, ROW_RESET, Restored, Totals
from flow_exporter.store.stats import StoreStats

log = logging.getLogger("flow_exporter.store")

# A tombstone lives at least this long (seconds) after its connection was forgotten: a DESTROY
# event read later than that (listener lag under load, a large conntrack.eventBuffer) finds no
# record of it. limits.maxConnections also bounds how many are kept (oldest go first, counted).
TOMBSTONE_MIN_TTL = 60.0

# Slack (ns) between the kernel's start stamp and our reading of the clock before a dump.
_DUMP_MARGIN_NS = 100_000_000
_NO_DUMP = -(1 << 63)  # the compiled admission's readmission bound while no dump has been timed


@dataclass(slots=True)
class GivenUp:
    """A connection given up at the cap: remembered (and checkpointed) while its entry lasts."""

    ct_id: int
    start_ns: int
    first_seen_ns: int
    flow_id: int
    last_seen: float | None  # monotonic time of the last dump that showed it; None: restored, not seen yet


@dataclass(slots=True)
class Tombstone:
    """What is left of a connection after it was forgotten, for late events and rows."""

    flow_id: int
    ct_id: int
    start_ns: int
    first_seen_ns: int
    next_seq: int
    base: Totals
    flags: int
    destroyed: bool
    deadline: float
    reset: bool = False  # ended by a counter reset: its entry lives on under a successor id


def same_incarnation(ct_id: int, start_ns: int, conn: Connection, first_seen_ns: int = 0) -> bool:
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


def _ambiguous(start_ns: int, next_seq: int, conn: Connection) -> bool:
    """A start-less entry with records (known from its NEW event only) met by a row with a start stamp.

    The row started before the entry was first seen (else it is plainly a later incarnation), so
    it is that entry, or a later incarnation of its tuple whose predecessor's NEW was read late:
    nothing tells them apart, and continuing could put two incarnations under one connectionId.
    """
    return not start_ns and bool(conn.start_ns) and next_seq > 0


def _unsure(g: GivenUp, conn: Connection) -> bool:
    """A restored given-up entry with no start stamp, met by a dump row that started before it was first seen.

    A NEW event never gives a connection up (``Table.apply_events``), so a given-up entry has the kernel's start
    wherever the kernel stamps starts; a start-less one comes from a state an earlier release wrote, which gave
    connections up at their NEW. The row is that entry, or a later incarnation of its tuple with the same
    conntrack id whose predecessor's DESTROY died unread with the previous process: nothing tells them apart,
    and taking it for the given-up entry would never report a live connection, so it is tracked under a new id,
    flagged adopted (or given up again, with a record, at the cap).
    """
    return g.last_seen is None and _ambiguous(g.start_ns, 1, conn)  # 1: it has its one record


def _totals(c: Connection) -> Totals:
    return (c.orig_packets, c.orig_bytes, c.reply_packets, c.reply_bytes)


class Memory:
    """Tombstones, given-up connections, unmatched checkpoint rows and the dumps seen: what the store remembers."""

    def __init__(self, stats: StoreStats, tombstone_ttl: float, max_tombstones: int) -> None:
        self._stats = stats
        self.tombstone_ttl = tombstone_ttl
        self.max_tombstones = max_tombstones
        self.tombs: dict[tuple[ConnectionKey, int], Tombstone] = {}  # (tuple, ct id)
        self._tomb_order: deque[tuple[float, tuple[ConnectionKey, int]]] = deque()
        self.given_up: dict[ConnectionKey, GivenUp] = {}  # the registry: one given-up incarnation a tuple
        # Given-up incarnations whose tuple a newer incarnation took in the registry before their DESTROY was read:
        # kept for a tombstone's life, so that DESTROY is known (unreported, as the registry's own) and not met as
        # an incarnation never seen, which the cap would give up a second time (found by the model soak).
        self._replaced: dict[tuple[ConnectionKey, int], list[GivenUp]] = {}  # (tuple, ct id): oldest first
        self.restored: dict[ConnectionKey, list[Restored]] = {}  # a checkpoint's rows no dump has matched yet
        # Wall-clock (begin, end) of recent complete dumps: an entry that lived through one of them was
        # seen by it, so meeting it as unknown means it was forgotten (bounded: a few hours of polls).
        self._dumps: deque[tuple[int, int]] = deque(maxlen=4096)

    # ------------------------------------------------------------------ a checkpoint's rows
    def restore(self, rows: Iterable[Restored]) -> None:
        """A previous process's rows of connections it tracked or gave up, until a dump or an event meets them."""
        given_up = self.given_up
        for row in rows:
            if row.flags & ROW_GIVEN_UP:
                g = GivenUp(row.ct_id, row.start_ns, row.first_seen_ns, row.flow_id, None)
                if row.key in given_up:  # several given-up incarnations of one tuple: the first dump tells which
                    self._replaced.setdefault((row.key, row.ct_id), []).append(g)  # one is live
                else:
                    given_up[row.key] = g
            else:
                self.restored.setdefault(row.key, []).append(row)

    def match_restored(self, key: ConnectionKey, conn: Connection) -> tuple[Restored | None, bool]:
        """The checkpoint row ``conn`` continues, taken with every other row of its incarnation (or None), and
        whether only start-less rows with records matched it (``_ambiguous``: a new id, flagged adopted)."""
        rows = self.restored.get(key)
        if rows is None:
            return None, False
        # A live row before an ended one: a reset successor with records outranks its ended predecessor.
        match = [
            (bool(row.flags & ROW_ENDED), i)
            for i, row in enumerate(rows)
            if same_incarnation(row.ct_id, row.start_ns, conn, row.first_seen_ns)
            and not _ambiguous(row.start_ns, row.next_seq, conn)
        ]
        if not match:
            return None, any(same_incarnation(row.ct_id, row.start_ns, conn, row.first_seen_ns) for row in rows)
        # Of several live rows (a reset seen, the old id's forced-end record not journaled yet when the
        # process died), the one written last: the connectionId the entry went on under.
        live = [i for ended, i in match if not ended]
        row = rows[live[-1] if live else match[-1][1]]
        answered = {i for _, i in match}  # every row of this incarnation is answered by this one
        rows[:] = [r for i, r in enumerate(rows) if i not in answered]
        if not rows:
            del self.restored[key]
        return row, False

    def bury_restored(self, now: float) -> None:
        """The first complete dump is over: the rows it did not show ended while no exporter ran, or just
        before it (the listener may still bring their DESTROY). They become tombstones, so a late event
        continues them instead of meeting them as new."""
        if not self.restored:
            return
        gone = 0
        for rows in self.restored.values():
            for row in rows:
                gone += 1
                flags = row.flags
                self.bury(
                    row.key, row.ct_id,
                    Tombstone(
                        row.flow_id, row.ct_id, row.start_ns, row.first_seen_ns, row.next_seq, row.base,
                        flags & RECORD_FLAGS, False, now + self.tombstone_ttl,
                        bool(flags & ROW_ENDED and flags & ROW_RESET),
                    ),
                    now,
                )  # fmt: skip
        self._stats.restored_gone += gone
        log.info(
            "%d connections of the checkpoint ended while no exporter ran; "
            "counts after their last record are unknown unless their DESTROY is still read",
            gone,
        )
        self.restored.clear()

    # ------------------------------------------------------------------ tombstones
    def bury(self, key: ConnectionKey, ct_id: int, tomb: Tombstone, now: float) -> None:
        """Remember a forgotten connection until its deadline; past the bound, the oldest goes first."""
        tombs = self.tombs
        tkey = (key, ct_id)
        tombs[tkey] = tomb
        order = self._tomb_order
        order.append((tomb.deadline, tkey))
        while len(tombs) > self.max_tombstones and order:
            deadline, old = order.popleft()
            t = tombs.get(old)
            if t is not None and t.deadline == deadline:
                del tombs[old]
                if deadline > now:
                    self._stats.tombstones_dropped_early += 1

    # ------------------------------------------------------------------ given up at the cap
    def give_up(self, key: ConnectionKey, g: GivenUp) -> None:
        """The tuple's incarnation ``g`` is given up: not tracked again while dumps show it."""
        self.given_up[key] = g

    def _take_replaced(self, key: ConnectionKey, conn: Connection) -> GivenUp | None:
        """The replaced given-up incarnation ``conn`` is, taken out of their list (a list: the kernel re-creates a
        tuple with the same id again and again), or None."""
        replaced = self._replaced.get((key, conn.ct_id), [])
        for i, g in enumerate(replaced):
            if same_incarnation(g.ct_id, g.start_ns, conn, g.first_seen_ns):
                del replaced[i]
                return g
        return None

    # ------------------------------------------------------------------ what a row or an event is
    def meet_row(
        self, key: ConnectionKey, conn: Connection, now: float, adopted: bool | None
    ) -> tuple[Tombstone | None, bool | None] | None:
        """A dump row for a tuple the keyed table does not hold, as this memory sees it.

        None: nothing to track (the given-up entry itself, seen again; or a dump older than the entry's
        DESTROY). Else (tomb, adopted): continue ``tomb`` (taken out), or with None admit the row as new,
        ``adopted`` saying whether to flag it (None: the store's default; the caller's ``adopted`` unless this
        memory is unsure which incarnation the row is).
        """
        g = self.given_up.get(key)
        if g is not None:
            if not same_incarnation(g.ct_id, g.start_ns, conn, g.first_seen_ns):
                g.last_seen = now
                self._replaced.setdefault((key, g.ct_id), []).append(g)
            elif not _unsure(g, conn):
                g.last_seen = now
                return None
            else:
                adopted = True
            del self.given_up[key]
        if self._replaced:
            # The row may be an incarnation given up before the registry's (a restart restores every given-up
            # row of a tuple; which one is live, only a dump tells): it is the registry's again.
            g = self._take_replaced(key, conn)
            if g is not None:
                if not _unsure(g, conn):
                    g.last_seen = now
                    self.given_up[key] = g
                    return None
                adopted = True
        if self.tombs:
            tomb = self.tombs.get((key, conn.ct_id))
            if tomb is not None and same_incarnation(tomb.ct_id, tomb.start_ns, conn, tomb.first_seen_ns):
                if tomb.destroyed:
                    return None  # a dump older than its DESTROY event
                if _ambiguous(tomb.start_ns, tomb.next_seq, conn):
                    adopted = True  # the tomb stays for its own DESTROY
                else:
                    del self.tombs[(key, conn.ct_id)]
                    return tomb, adopted
        return None, adopted

    def meet_new(self, key: ConnectionKey, ct_id: int) -> bool:
        """Whether a NEW event of a tuple the keyed table does not hold (or whose entry was destroyed) is to be
        left alone: a tombstone of its id whose DESTROY is still to come, or a given-up tuple."""
        if self.tombs:
            tomb = self.tombs.get((key, ct_id))
            if tomb is not None:
                if not tomb.destroyed:
                    return True  # seen by a dump, swept, its DESTROY still to come
                del self.tombs[(key, ct_id)]
        # The given-up entry itself, or an incarnation of its tuple whose NEW is read late or comes after a
        # DESTROY that was lost: a NEW carries no start stamp to tell them apart. Its DESTROY (read in kernel
        # order) or the next dump decides; a NEW never does.
        return key in self.given_up

    def meet_destroy(self, key: ConnectionKey, conn: Connection) -> tuple[bool, Tombstone | None]:
        """A DESTROY event no tracked slot took, as this memory sees it: (settled, tomb).

        Settled: nothing to report (a tombstone's entry with nothing new, or a given-up one: its last counts
        are not reported; both counted). A tomb (taken out): the entry it remembers, to report with the
        event's counts. Neither: an incarnation this memory never saw.
        """
        tomb = self.tombs.get((key, conn.ct_id))
        if tomb is not None and same_incarnation(tomb.ct_id, tomb.start_ns, conn, tomb.first_seen_ns):
            if tomb.destroyed or conn.orig_packets + conn.reply_packets == 0 or _totals(conn) == tomb.base:
                self._stats.late_destroys_dropped += 1
                # Nothing to report, but the entry is gone: a later row or NEW of this tuple and id is
                # a new incarnation, even one whose start precedes our first sighting of this one
                # (its NEW event was read late). The event's start stamp pins the incarnation.
                tomb.destroyed = True
                if not tomb.start_ns:
                    tomb.start_ns = conn.start_ns
                return True, None
            del self.tombs[(key, conn.ct_id)]
            return False, tomb
        g = self.given_up.get(key)
        if g is not None and same_incarnation(g.ct_id, g.start_ns, conn):
            del self.given_up[key]
            self._stats.unreported_ends += 1  # given up at the cap: its last counts are not reported
            return True, None
        if self._replaced and self._take_replaced(key, conn) is not None:
            self._stats.unreported_ends += 1
            return True, None
        return False, None

    # ------------------------------------------------------------------ the dumps seen
    def dumped(self, begin: int, end: int) -> None:
        """A complete dump ran from ``begin`` to ``end`` (wall-clock ns; 0: unknown, not remembered)."""
        if begin and end:
            self._dumps.append((begin, end))

    def readmitted(self, conn: Connection, wall_ns: int) -> bool:
        """Whether ``conn`` lived through a complete dump of this process, so the store saw and then forgot it.

        A dump shows every entry that exists from its begin to its end. An entry the store meets
        as unknown although it started before such a dump, and ended after it (or lives on),
        was tracked once and forgotten (its tombstone or give-up record went before it did):
        it gets a new connectionId flagged adopted, and ``readmitted`` counts it.
        """
        start = conn.start_ns
        dumps = self._dumps
        if not start or not dumps or start > dumps[-1][0] - _DUMP_MARGIN_NS:
            return False
        stop = conn.stop_ns or wall_ns
        for begin, end in dumps:
            if begin - _DUMP_MARGIN_NS >= start:
                if end <= stop:
                    self._stats.readmitted += 1
                    return True
                return False
        return False

    def readmit_bound(self) -> int:
        """The bulk admission's bound: a row that started at or before it may be one the store forgot
        (:meth:`readmitted`), which the admission leaves to the table's Python path."""
        dumps = self._dumps
        return dumps[-1][0] - _DUMP_MARGIN_NS if dumps else _NO_DUMP

    # ------------------------------------------------------------------ ageing, and what a checkpoint keeps
    def expire(self, now: float) -> None:
        """Drop what is past its time (a dump is over): tombstones past their deadline; given-up connections no
        dump showed for a tombstone's life (one dump that misses an entry does not make it new again)."""
        ttl = self.tombstone_ttl
        if self.given_up:
            for key in [k for k, g in self.given_up.items() if g.last_seen is None or now - g.last_seen > ttl]:
                del self.given_up[key]
        if self._replaced:
            for k, gs in list(self._replaced.items()):
                gs[:] = [g for g in gs if g.last_seen is not None and now - g.last_seen <= ttl]
                if not gs:
                    del self._replaced[k]
        order = self._tomb_order
        while order and order[0][0] <= now:
            _, tkey = order.popleft()
            tomb = self.tombs.get(tkey)
            if tomb is not None and tomb.deadline <= now:
                del self.tombs[tkey]

    def restored_rows(self) -> Iterator[Restored]:
        """A checkpoint's rows no dump has matched yet, as they came."""
        for rows in self.restored.values():
            yield from rows

    def tomb_rows(self) -> Iterator[Restored]:
        """The tombstones a later process may still meet (not the destroyed ones), as checkpoint rows."""
        for (key, _), t in self.tombs.items():
            if not t.destroyed:  # a destroyed entry cannot be met again by a later process
                kind = ROW_ENDED | (ROW_RESET if t.reset else 0)
                yield Restored(key, t.ct_id, t.start_ns, t.first_seen_ns, t.flow_id, t.next_seq, t.base, t.flags | kind)
