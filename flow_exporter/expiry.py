"""Expiry priority queue: which tracked connections are due for a record, and when.

Ordered by min(active expiry, idle expiry) like Antrea's queue, but without its
per-tick cap: ``pop_due`` hands back everything that is due. Updates are lazy
(a new heap entry, the old one skipped when popped) because most updates only
move the idle deadline, which rarely changes the minimum; the heap is rebuilt
when stale entries outnumber live ones.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from dataclasses import dataclass


@dataclass(slots=True)
class QueueItem:
    """Deadlines of one queued connection (seconds on the store's monotonic clock)."""

    active_expire: float
    idle_expire: float
    version: int = 0

    @property
    def deadline(self) -> float:
        return min(self.active_expire, self.idle_expire)


class ExpiryQueue:
    """Min-heap of deadlines plus a key -> item map."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._items: dict[Hashable, QueueItem] = {}
        self._version = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def get(self, key: Hashable) -> QueueItem | None:
        return self._items.get(key)

    def push(self, key: Hashable, active_expire: float, idle_expire: float) -> QueueItem:
        """Queue ``key`` (or replace its deadlines if already queued)."""
        self._version += 1
        version = self._version
        item = QueueItem(active_expire, idle_expire, version)
        replaced = self._items.get(key) is not None
        self._items[key] = item
        heapq.heappush(self._heap, (active_expire if active_expire < idle_expire else idle_expire, version, key))
        if replaced:  # only a replaced item leaves a stale heap entry (a new key is the first poll's hot path)
            self._maybe_compact()
        return item

    def requeue(self, key: Hashable, item: QueueItem, active_expire: float, idle_expire: float) -> None:
        """Queue again an item ``pop_due`` just yielded, with new deadlines.

        The export hot path: the popped item is reused (no new object) and no stale heap entry
        can exist for it (its entry was popped), so no compaction check is needed.
        """
        self._version += 1
        item.active_expire = active_expire
        item.idle_expire = idle_expire
        item.version = version = self._version
        self._items[key] = item
        heapq.heappush(self._heap, (active_expire if active_expire < idle_expire else idle_expire, version, key))

    def update(
        self, key: Hashable, *, active_expire: float | None = None, idle_expire: float | None = None
    ) -> None:
        item = self._items[key]
        old = item.deadline
        if active_expire is not None:
            item.active_expire = active_expire
        if idle_expire is not None:
            item.idle_expire = idle_expire
        if item.deadline != old:
            self._version += 1
            item.version = self._version
            heapq.heappush(self._heap, (item.deadline, self._version, key))
            self._maybe_compact()

    def remove(self, key: Hashable) -> QueueItem | None:
        return self._items.pop(key, None)

    def next_deadline(self) -> float | None:
        """Earliest live deadline, or None when empty."""
        heap = self._heap
        while heap:
            deadline, version, key = heap[0]
            item = self._items.get(key)
            if item is not None and item.version == version:
                return deadline
            heapq.heappop(heap)
        return None

    def pop_due(self, now: float) -> Iterator[tuple[Hashable, QueueItem]]:
        """Yield (key, item) for every item due at ``now``, removing each from the queue.

        The caller re-pushes the ones that stay queued; a re-pushed item whose new
        deadline is still <= now is yielded again, so callers must move deadlines forward.
        """
        heap = self._heap
        items = self._items
        while heap and heap[0][0] <= now:
            _, version, key = heapq.heappop(heap)
            item = items.get(key)
            if item is None or item.version != version:
                continue
            del items[key]
            yield key, item

    def _maybe_compact(self) -> None:
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._items):
            self._heap = [(it.deadline, it.version, k) for k, it in self._items.items()]
            heapq.heapify(self._heap)
