"""Expiry priority queue: which tracked connections are due for a record, and when.

Ordered by min(active expiry, idle expiry) like Antrea's queue, but without its
per-tick cap: ``pop_due`` hands back everything that is due.

Keyed by the store's slot numbers and held in flat arrays, not one object per
connection: the deadlines are two float columns, and the heap holds plain ints
(``millisecond << 32 | slot``), not a tuple, a float and an item object per entry
(bench/bench_poll.py, memory). The heap is only an index: an
entry is live while its slot is queued and its millisecond is the slot's current
deadline's, and a slot is yielded only once its exact float deadline has passed.
Updates are lazy (a new heap entry, the old one skipped when popped) because most
updates only move the idle deadline, which rarely changes the minimum; the heap is
rebuilt when stale entries outnumber live ones.

The heap is ``DeadlineHeap`` (``deadline_heap.py``, compiled by Cython where built): entries ordered
as heapq orders the ints, kept as (millisecond, slot) pairs in two typed arrays, so its comparisons
cost no objects and a millisecond past 31 bits (a node up more than 24.8 days) still fits.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

from flow_exporter import deadline_heap as _heap_module  # compiled where built (flow_exporter.compiled chooses)

_SLOT_BITS = 32
_SLOT_MASK = (1 << _SLOT_BITS) - 1


_ms = _heap_module.ms_of  # a deadline's millisecond: the heap's key


class ExpiryQueue:
    """Deadlines of queued slots plus a lazy min-heap over them."""

    def __init__(self) -> None:
        self.active = array("d")  # per slot: active-timeout deadline (monotonic seconds)
        self.idle = array("d")  # per slot: idle-timeout deadline
        self._queued = bytearray()  # per slot: 1 while queued
        self._heap: Any = _heap_module.DeadlineHeap()
        self._live = 0

    def grow(self, size: int) -> None:
        """Make room for slots ``0 .. size - 1`` (the store grows its columns in chunks)."""
        more = size - len(self._queued)
        if more > 0:
            self.active.frombytes(bytes(8 * more))
            self.idle.frombytes(bytes(8 * more))
            self._queued.extend(bytes(more))

    def __len__(self) -> int:
        return self._live

    def __contains__(self, slot: int) -> bool:
        return bool(self._queued[slot])

    def push(self, slot: int, active_expire: float, idle_expire: float) -> None:
        """Queue ``slot`` (or replace its deadlines if already queued)."""
        replaced = self._queued[slot]
        self.active[slot] = active_expire
        self.idle[slot] = idle_expire
        if not replaced:
            self._queued[slot] = 1
            self._live += 1
        deadline = active_expire if active_expire < idle_expire else idle_expire
        self._heap.push(_ms(deadline) << _SLOT_BITS | slot)
        if replaced:  # only a replaced slot leaves a stale heap entry (a new one is the first poll's hot path)
            self._maybe_compact()

    def update(self, slot: int, *, active_expire: float | None = None, idle_expire: float | None = None) -> None:
        """Move a queued slot's deadlines; a new heap entry only when its minimum moves to another millisecond."""
        a = self.active[slot]
        i = self.idle[slot]
        old = _ms(a if a < i else i)
        if active_expire is not None:
            self.active[slot] = a = active_expire
        if idle_expire is not None:
            self.idle[slot] = i = idle_expire
        new = _ms(a if a < i else i)
        if new != old:
            self._heap.push(new << _SLOT_BITS | slot)
            self._maybe_compact()

    def remove(self, slot: int) -> None:
        if self._queued[slot]:
            self._queued[slot] = 0
            self._live -= 1

    def deadline(self, slot: int) -> float:
        a = self.active[slot]
        i = self.idle[slot]
        return a if a < i else i

    def _is_live(self, entry: int) -> bool:
        slot = entry & _SLOT_MASK
        return bool(self._queued[slot]) and _ms(self.deadline(slot)) == entry >> _SLOT_BITS

    def next_deadline(self) -> float | None:
        """Earliest live deadline, or None when empty."""
        heap = self._heap
        while heap:
            if self._is_live(heap[0]):
                return self.deadline(heap[0] & _SLOT_MASK)
            heap.pop()
        return None

    def pop_due(self, now: float) -> Iterator[int]:
        """Yield every slot due at ``now``, earliest first, removing each from the queue (deadline_heap.DueSlots,
        the rule the compiled due loop takes them by).

        The caller re-queues the ones that stay queued; a re-queued slot whose new
        deadline is still <= now is yielded again, so callers must move deadlines forward.
        """
        due = _heap_module.DueSlots(self._heap, self._queued, self.active, self.idle, now)
        try:
            while (slot := due.take()) >= 0:
                self._live -= 1
                yield slot
        finally:
            due.close()

    def parts(self) -> tuple[Any, bytearray, array[float], array[float]]:
        """The heap, queued flags and deadlines, for the loops that queue slots in batches (the due loop in
        ledger_core takes them through deadline_heap.DueSlots, as :meth:`pop_due` does), which report the
        change in the number of queued slots through :meth:`counted`.
        """
        return self._heap, self._queued, self.active, self.idle

    def counted(self, change: int) -> None:
        """Slots the compiled loop took off the queue (negative) or queued again (positive)."""
        self._live += change

    def _maybe_compact(self) -> None:
        heap = self._heap
        if len(heap) > 64 and len(heap) > 2 * self._live:
            queued = self._queued
            self._heap = _heap_module.DeadlineHeap(
                [_ms(self.deadline(s)) << _SLOT_BITS | s for s in range(len(queued)) if queued[s]]
            )
