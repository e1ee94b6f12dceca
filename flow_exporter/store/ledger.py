"""The ledger of what was reported: records built, in flight, acknowledged, and what a checkpoint keeps.

What it holds to keep the accounting contract (README, "Counting: the contract"):

* everything due is exported, with no per-tick cap;
* a record is frozen when built and its totals become the base of the next delta at once; a
  failed delivery is resent as the same record (the sink keeps its bytes), so (connectionId,
  sequence) never carries two contents and the deltas always add up;
* a connection has at most one record in flight: while Kafka is slow its counts coalesce into
  the next record instead of queueing.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator

from flow_exporter import compiled as compiled_build
from flow_exporter import ledger_core as _core  # a record built and settled, written once (compiled where built)
from flow_exporter.connection import (
    Connection,
    ConnectionKey,
)
from flow_exporter.flow import (
    ADOPTED,
    COUNTERS_RESET,
    LACK_OF_RESOURCES,
    RECORD_FLAGS,
    ROW_ENDED,
    ROW_GIVEN_UP,
    ROW_RESET,
    ZERO,
    Export,
    ReportedRows,
    Restored,
)
from flow_exporter.slot_state import ACTIVE, FINAL_DUE, LAST_ACTIVE, ORPHAN
from flow_exporter.store.table import GivenUp, Table, Tombstone

# How soon a connection whose record is still in flight is looked at again.
RETRY_DELAY = 1.0
# A failed record is resent after RETRY_DELAY, doubling per attempt up to this.
RESEND_MAX_DELAY = 30.0


class Ledger(Table):
    """Records: building them when due, settling their delivery, and the state a checkpoint keeps."""

    cache_prefixes: bool

    def _init_ledger(self) -> None:
        # The compiled build of the record rules, or (compiled=False, a test seam) the interpreted one beside it.
        self._core = _core if self.compiled else compiled_build.reference("ledger_core")
        # The bit that keeps a delivered record's prefix for the connection's next one: ACTIVE, or 0 when
        # prefixes are not cached (every record rebuilds its own; export.prefixCache).
        self._keep_prefix = ACTIVE if self.cache_prefixes else 0
        self._orphan_due: list[int] = []
        self._loose: dict[tuple[int, int], Export] = {}  # restored records in flight: no connection holds them
        self._loose_last: dict[int, int] = {}  # flow id -> the sequence of its last loose record, until met again
        self._resend: list[tuple[float, int, Export]] = []  # heap of failed records waiting to go again
        self._resend_seq = itertools.count()

    def restore(self, rows: Iterable[Restored], resends: Iterable[Export], *, adopting: bool = False) -> None:
        """Continue from a previous process's checkpoint (before the first poll).

        Rows are matched to the table by tuple and incarnation as the first dump (or an
        event) shows them; the ones no dump shows ended while no exporter ran. Resends are
        records the previous process built but could not see delivered: they go out
        again as they were, and their totals are already in the rows' bases. ``adopting``:
        the checkpoint was written before a first complete poll after a state loss, so what
        the first dump finds that no row names is flagged adopted (checkpoint.Loaded.adopting).
        """
        self.adopt = adopting
        given_up = self._given_up
        for row in rows:
            if row.flags & ROW_GIVEN_UP:
                g = GivenUp(row.ct_id, row.start_ns, row.first_seen_ns, row.flow_id, None)
                if row.key in given_up:  # several given-up incarnations of one tuple: the first dump tells which
                    self._given_up_replaced.setdefault((row.key, row.ct_id), []).append(g)  # one is live
                else:
                    given_up[row.key] = g
            else:
                self._restored.setdefault(row.key, []).append(row)
        last = self._loose_last
        for e in resends:
            self._loose[(e.flow_id, e.sequence)] = e
            if e.sequence >= last.get(e.flow_id, -1):
                last[e.flow_id] = e.sequence
            heapq.heappush(self._resend, (float("-inf"), next(self._resend_seq), e))

    def _continue(
        self, key: ConnectionKey, conn: Connection, known: Tombstone | Restored, now: float, wall_ns: int
    ) -> int:
        s = super()._continue(key, conn, known, now, wall_ns)
        if self._loose_last:
            self._attach_in_flight(known.flow_id, s)
        return s

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

    def next_deadline(self) -> float | None:
        if any(self._pending[s] is None for s in self._orphan_due):
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
        # Which slots get a record, and why, decided first; the records are built after, in that order
        # (_build_all): a build touches only its own slot. An orphan may be queued too: once taken here,
        # it waits in the queue as one whose record is in flight would (the build makes it so).
        todo: list[int] = []
        why = bytearray()
        if limit is not None:
            limit -= len(out)
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
            self._build_all(todo, bytes(why), out, now)
        return out

    def _build_all(self, slots: list[int], reasons: bytes, out: list[Export], now: float) -> None:
        """The records of ``slots`` (for ``reasons``), appended to ``out`` in order (ledger_core.build_records)."""
        before = len(out)
        try:
            self._core.build_records(self, slots, reasons, out, self._view)
        finally:
            self.stats.records_built += len(out) - before

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
        # a live connection's record: ledger_core; the rest here
        self._core.settle_delivered(self, [export], self._keep_prefix, lambda e: self._settle_other(e, now))

    def acknowledge_delivered(self, exports: list[Export], now: float) -> None:
        """:meth:`acknowledge` of delivered records, a batch in one call (ledger_core.settle_delivered), in order."""
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
        columns = (self._ct, self._start, self._first, self._fid, seq, self._bp, self._bb, self._brp, self._brb, fl)
        return ReportedRows(slots, self._keys, columns, self._untracked_rows(), self.adopt)

    def _untracked_rows(self) -> Iterator[Restored]:
        for rows in self._restored.values():
            yield from rows
        orphans = self._orphans
        for key, g in self._given_up.items():
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
        for (key, _), t in self._tombs.items():
            if not t.destroyed:  # a destroyed entry cannot be met again by a later process
                kind = ROW_ENDED | (ROW_RESET if t.reset else 0)
                yield Restored(key, t.ct_id, t.start_ns, t.first_seen_ns, t.flow_id, t.next_seq, t.base, t.flags | kind)

    def _owes_give_up(self, s: int) -> bool:
        """Whether orphan ``s`` was given up at the cap and its lack-of-resources record is not built yet."""
        return self._reason[s] == LACK_OF_RESOURCES and self._pending[s] is None and bool(self._bits[s] & FINAL_DUE)

    def in_flight(self) -> Iterator[Export]:
        """Every record built and not known to be delivered (in flight or waiting to be resent)."""
        yield from self._loose.values()  # restored from a checkpoint: no connection holds them
        for s in [*self.connections.values(), *self._orphans.values()]:
            e = self._pending[s]
            if e is not None:
                yield e
