"""Shutdown: a last record for every connection, and what is still owed."""

from __future__ import annotations

import heapq

from flow_exporter.flow import (
    FORCED_END,
    Export,
)
from flow_exporter.slot_state import CLOSED, FINAL_DUE
from flow_exporter.store.ledger import Ledger


class Shutdown(Ledger):
    """What SIGTERM needs of the store: final records, and how many are still to come."""

    def _init_shutdown(self) -> None:
        # export_all's pass over the connections, continued by the next call while a limit cuts it short:
        # starting every call from the first connection again rescanned the closed ones (quadratic in rounds).
        self._closing: list[int] | None = None
        self._closing_at = 0

    def export_all(self, now: float, reason: int = FORCED_END, limit: int | None = None) -> list[Export]:
        """Shutdown: a last record for every connection with something unreported (or never reported).

        Live connections get ``reason`` (forced end); ones that already ended get their own
        end reason. A connection with a record in flight gets its turn once that settles,
        so no counts are sent twice; resends go out as they are. At most ``limit`` records
        (the room under limits.maxInFlight): the rest come at the next call, so the final
        records of a large table are not all in memory at once (1M of them took ~2 GB).
        """
        resend = self._resend
        out: list[Export] = []
        while resend and (limit is None or len(out) < limit):
            out.append(heapq.heappop(resend)[2])
        self._orphan_due = []  # the orphans owing a record are met below, in this call or a later one
        bits = self._bits
        keys = self._keys
        todo = self._closing
        if todo is None:  # a new pass: it also meets connections whose record was in flight at the last one
            todo = self._closing = [*self._orphans.values(), *self.connections.values()]
            self._closing_at = 0
        i = self._closing_at
        # Which slots get a record, and why, decided first; the records are built after, in that order, in one
        # compiled call when built (_build_all): a build touches only its own slot.
        slots: list[int] = []
        why = bytearray()
        room = None if limit is None else limit - len(out)
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
        self._closing_at = i
        if i >= len(todo):
            self._closing = None
        self._build_all(slots, bytes(why), out, now)
        return out

    def unfinished(self) -> int:
        """Records built and not delivered, plus connections still owing one (shutdown)."""
        n = len(self._loose)
        bits = self._bits
        for s in [*self._orphans.values(), *self.connections.values()]:
            if self._pending[s] is not None or (bits[s] & FINAL_DUE if self._reason[s] else not bits[s] & CLOSED):
                n += 1
        return n
