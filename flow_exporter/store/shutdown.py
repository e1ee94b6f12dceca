"""Shutdown: a last record for every connection, and what is still owed."""

from __future__ import annotations

from flow_exporter.flow import FORCED_END, Export
from flow_exporter.store.ledger import Ledger
from flow_exporter.store.table import Table


class Shutdown:
    """What SIGTERM needs of the store: final records, in passes the caller's limit cuts short.

    It owns the pass over the connections, continued by the next call while a limit cuts it short:
    starting every call from the first connection again rescanned the closed ones (quadratic in rounds).
    """

    def __init__(self, table: Table, ledger: Ledger) -> None:
        self._table = table
        self._ledger = ledger
        self._closing: list[int] | None = None
        self._closing_at = 0

    def export_all(self, now: float, reason: int = FORCED_END, limit: int | None = None) -> list[Export]:
        """Shutdown: a last record for every connection with something unreported (or never reported).

        Live connections get ``reason`` (forced end); ones that already ended get their own
        end reason. A connection with a record in flight gets its turn once that settles,
        so no counts are sent twice; resends go out as they are. At most ``limit`` records
        (the room under limits.maxInFlight): the rest come at the next call, so the final
        records of a large table are not all in memory at once (the shutdown's peak at 1M, measured:
        docs/performance.md#targets-issue-24-a-million-connections-the-hot-path-compiled).
        """
        out = self._ledger.take_resends(limit)
        todo = self._closing
        if todo is None:  # a new pass: it also meets connections whose record was in flight at the last one
            todo = self._closing = self._table.slots()
            self._closing_at = 0
        room = None if limit is None else limit - len(out)
        i = self._closing_at = self._table.finals(todo, self._closing_at, room, reason, out)
        if i >= len(todo):
            self._closing = None
        return out

    def unfinished(self) -> int:
        """Records built and not delivered, plus connections still owing one (shutdown)."""
        return self._table.unfinished()
