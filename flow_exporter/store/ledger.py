"""The ledger of what was reported: records asked for when due, delivered, resent.

What it holds to keep the accounting contract (README, "Counting: the contract"):

* everything due is exported, with no per-tick cap;
* a record is frozen when built and its totals become the base of the next delta at once; a
  failed delivery is resent as the same record (the sink keeps its bytes), so (connectionId,
  sequence) never carries two contents and the deltas always add up;
* a connection has at most one record in flight: while Kafka is slow its counts coalesce into
  the next record instead of queueing.

The counts behind these rules are the table's (:mod:`flow_exporter.store.table` owns every column and
builds, settles and checkpoints records through its batch API); the ledger keeps what no connection
holds: the failed records waiting to be resent, with their backoff.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from flow_exporter.flow import Export, Restored
from flow_exporter.store.stats import StoreStats
from flow_exporter.store.table import RETRY_DELAY, Table

# A failed record is resent after RETRY_DELAY, doubling per attempt up to this.
RESEND_MAX_DELAY = 30.0

__all__ = ["RESEND_MAX_DELAY", "RETRY_DELAY", "Ledger"]


class Ledger:
    """Records: asking the table for the due ones, settling their delivery, resending the failed ones.

    It owns the resend queue (a heap of failed records by when they go again); the connections and
    what was reported of them are the table's, reached through its batch API.
    """

    def __init__(self, table: Table, stats: StoreStats) -> None:
        self._table = table
        self._stats = stats
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
        resends = list(resends)
        self._table.restore(rows, resends, adopting=adopting)
        for e in resends:
            heapq.heappush(self._resend, (float("-inf"), next(self._resend_seq), e))

    def next_deadline(self) -> float | None:
        deadline = self._table.next_due()
        if self._resend:
            due = self._resend[0][0]
            deadline = due if deadline is None else min(deadline, due)
        return deadline

    def take_resends(self, limit: int | None, now: float = float("inf")) -> list[Export]:
        """The failed records due again at ``now`` (at most ``limit``), in order; all of them by default."""
        resend = self._resend
        out: list[Export] = []
        while resend and resend[0][0] <= now and (limit is None or len(out) < limit):
            out.append(heapq.heappop(resend)[2])
        return out

    def expire(self, now: float, wall_ns: int, limit: int | None = None) -> list[Export]:
        """Records for every connection that is due at ``now`` (at most ``limit``), resends first.

        What the limit holds back stays due and is exported later with its latest
        counters: while Kafka is slow, connections coalesce instead of queueing.
        """
        out = self.take_resends(limit, now)
        self._table.due(now, None if limit is None else limit - len(out), out)
        return out

    def acknowledge(self, export: Export, delivered: bool, now: float, *, permanent: bool = False) -> None:
        """Settle a record after Kafka's delivery report.

        Failed: the same record (same bytes) goes again after a backoff, and the
        connection's newer counts wait for the record after it. Delivered, or failed
        for good (``permanent``: a record Kafka will never take, counted by the caller):
        the connection may have its next record, or be forgotten if it has ended.
        """
        if not delivered and not permanent:
            self._stats.resends += 1
            delay = min(RETRY_DELAY * (2 ** min(export.attempts, 16)), RESEND_MAX_DELAY)
            export.attempts += 1
            heapq.heappush(self._resend, (now + delay, next(self._resend_seq), export))
            return
        self._table.settle([export], now)

    def acknowledge_delivered(self, exports: list[Export], now: float) -> None:
        """:meth:`acknowledge` of delivered records, a batch in one call, in order."""
        self._table.settle(exports, now)
