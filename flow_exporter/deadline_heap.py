"""The expiry queue's heap: (deadline millisecond, slot) pairs, ordered as heapq orders ``ms << 32 | slot``.

Written once (issue 39), in Cython's pure-Python mode: compiled, the pairs live in two typed arrays and
every comparison is two C integer compares; interpreted (no compiler, or ``FLOW_EXPORTER_INTERPRETED``),
the same code runs on the same arrays, slower. ``deadline_heap.pxd`` gives the C types, and the
push the compiled admission (``admission.py``) calls without a Python call per entry; :class:`DueSlots` is the
expiry queue's pop rule, which the due loop (``ledger_core.due``) and ``ExpiryQueue.pop_due`` both take.

Why not a list of ints and :mod:`heapq`: at 250k connections and an active timeout of 5 s, heapq's
sifts and the int comparisons they call were a large share of the exporter's CPU (perf; measured:
docs/performance.md#targets-issue-24-a-million-connections-the-hot-path-compiled), every entry an object of
its own (40 bytes with its list pointer; 12 here); and ``ms << 32`` no longer fits an int64 once the
monotonic clock passes 2^31 ms (a node up 24.8 days). Why not ``heapq`` over the pairs: it has no key.

The order is the ints' order (ms first, then slot) and the algorithm is heapq's (push: append, then move
up past larger parents; pop: the last entry to the root, down along the smaller children to a leaf, then
up), so the arrays hold the same entries in the same places as a heapq list of the ints would: the
property tests compare them with :meth:`DeadlineHeap.tolist`.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:  # the C library's floor: a double, truncated to the key's int64 (no Python int)
    from cython.cimports.libc.math import floor  # type: ignore[import-untyped,import-not-found,unused-ignore]
else:
    from math import floor

_SLOT_MASK = 0xFFFFFFFF
_GROW_MIN = 64


@cython.cclass
class DeadlineHeap:
    """A min-heap of ``ms << 32 | slot`` entries (Python ints at this interface, pairs inside)."""

    def __init__(self, entries: Iterable[int] = ()) -> None:
        """``entries``: heapified, as :func:`heapq.heapify`."""
        items = list(entries)
        self._adopt(array("q", [e >> 32 for e in items]), array("I", [e & _SLOT_MASK for e in items]))
        self.n = len(items)  # entries held; the arrays have room for self.cap
        i: cython.Py_ssize_t = self.n // 2 - 1
        while i >= 0:
            _down(self, self.n, i)
            i -= 1

    def _adopt(self, ms: array[int], slot: array[int]) -> None:
        """Own the two arrays, and (compiled) the typed views of them the sifts index."""
        self._ms_store = ms
        self._slot_store = slot
        self.cap = len(ms)
        self.ms = ms
        self.slot = slot

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i < 0 or i >= self.n:
            raise IndexError("heap index out of range")
        return _entry_of(self.ms[i], self.slot[i])

    def push(self, entry: int) -> None:
        """heapq.heappush of ``entry`` (``ms << 32 | slot``)."""
        e: cython.longlong
        try:
            e = entry  # compiled: one conversion, then C arithmetic
        except OverflowError:  # a millisecond past 31 bits: Python's ints
            push_entry(self, entry >> 32, entry & _SLOT_MASK)
            return
        push_entry(self, e >> 32, e & _SLOT_MASK)

    def pop(self) -> int:
        """heapq.heappop: the smallest entry."""
        if self.n == 0:
            raise IndexError("pop from an empty heap")
        ms: cython.longlong = min_ms(self)
        return _entry_of(ms, pop_min(self))

    def tolist(self) -> list[int]:
        """The entries in heap order, as a heapq list of the same ints holds them."""
        return [_entry_of(self.ms[i], self.slot[i]) for i in range(self.n)]


def _entry_of(ms: cython.longlong, slot: cython.uint) -> int:
    """The pair as one Python int: in C arithmetic while ``ms << 32`` fits an int64, else in Python's ints."""
    if -0x80000000 <= ms < 0x80000000:  # a literal: compiled, a C comparison
        return (ms << 32) | slot
    return _entry(ms, slot)


def _entry(ms: object, slot: object) -> int:
    """The pair as one Python int (objects here: compiled, ``ms << 32`` must not overflow a C int64)."""
    return ms << 32 | slot  # type: ignore[operator]


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _up(h: DeadlineHeap, start: cython.Py_ssize_t, pos: cython.Py_ssize_t) -> None:
    """heapq's ``_siftdown``: the entry at ``pos`` moves up past larger parents, no higher than ``start``."""
    ms: cython.longlong = h.ms[pos]
    slot: cython.uint = h.slot[pos]
    parent: cython.Py_ssize_t
    pm: cython.longlong
    while pos > start:
        parent = (pos - 1) >> 1
        pm = h.ms[parent]
        if pm < ms or (pm == ms and h.slot[parent] <= slot):
            break
        h.ms[pos] = pm
        h.slot[pos] = h.slot[parent]
        pos = parent
    h.ms[pos] = ms
    h.slot[pos] = slot


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def _down(h: DeadlineHeap, n: cython.Py_ssize_t, pos: cython.Py_ssize_t) -> None:
    """heapq's ``_siftup``: the entry at ``pos`` goes down along the smaller children to a leaf, then back up."""
    start: cython.Py_ssize_t = pos
    ms: cython.longlong = h.ms[pos]
    slot: cython.uint = h.slot[pos]
    child: cython.Py_ssize_t = 2 * pos + 1
    right: cython.Py_ssize_t
    while child < n:
        right = child + 1
        if right < n and not (
            h.ms[child] < h.ms[right] or (h.ms[child] == h.ms[right] and h.slot[child] < h.slot[right])
        ):
            child = right
        h.ms[pos] = h.ms[child]
        h.slot[pos] = h.slot[child]
        pos = child
        child = 2 * pos + 1
    h.ms[pos] = ms
    h.slot[pos] = slot
    _up(h, start, pos)


def _grow(h: DeadlineHeap) -> None:
    """Half as much room again (64 entries at least); the views let go first: an array whose buffer is
    exported cannot resize."""
    more = max(_GROW_MIN, h.n // 2)
    ms, slot = h._ms_store, h._slot_store
    h.ms = h.slot = None  # type: ignore[assignment]  # (compiled: the typed views' buffers released)
    ms.frombytes(bytes(8 * more))
    slot.frombytes(bytes(4 * more))
    h._adopt(ms, slot)


def ms_of(deadline: cython.double) -> cython.longlong:
    """A deadline's millisecond, the heap's key (a slot due at ``now`` has a key up to ``ms_of(now)``)."""
    ms: cython.longlong = cython.cast(cython.longlong, floor(deadline * 1000.0))
    return ms


@cython.final
@cython.cclass
class DueSlots:
    """The expiry queue's slots due at ``now``, taken off one by one, earliest first: the queue's pop rule, once.

    ``queued``, ``active``, ``idle``: the queue's per-slot flags and deadlines (compiled: typed views of them,
    held until :meth:`close`; the queue grows them only between two loops). An entry is stale when its slot
    is no longer queued or its deadline moved to another millisecond (the queue updates lazily); a live one
    of ``now``'s millisecond whose exact deadline is later than ``now`` is held back and goes back into the
    heap at :meth:`close`, which the caller must reach (``try``/``finally``). ``change`` counts the queued
    slots taken off (-1 each) and queued again (+1 each), for the queue's count, exact after an error too.
    """

    def __init__(
        self, heap: DeadlineHeap, queued: bytearray, active: array[float], idle: array[float], now: float
    ) -> None:
        if not isinstance(heap, DeadlineHeap):  # (compiled, the argument's type is checked before: same error)
            raise TypeError(f"expected a DeadlineHeap, got {type(heap).__name__}")
        self.heap = heap
        self.queued = queued
        self.active = active
        self.idle = idle
        self.now = now
        self.last_ms = ms_of(now)
        self.early: list[int] = []
        self.change = 0

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.initializedcheck(False)
    def take(self) -> cython.Py_ssize_t:
        """The next due slot, taken off the queue; -1 when none is left."""
        h: DeadlineHeap = self.heap
        ms: cython.longlong
        slot: cython.Py_ssize_t
        a: cython.double
        i: cython.double
        while h.n > 0 and min_ms(h) <= self.last_ms:
            ms = min_ms(h)
            slot = pop_min(h)
            if not self.queued[slot]:
                continue
            a = self.active[slot]
            i = self.idle[slot]
            if i < a:
                a = i
            if ms_of(a) != ms:
                continue  # stale: the slot's deadline moved
            if a > self.now:
                self.early.append(_entry_of(ms, slot))
                continue
            self.queued[slot] = 0
            self.change -= 1
            return slot
        return -1

    @cython.boundscheck(False)
    @cython.wraparound(False)
    @cython.initializedcheck(False)
    def requeue(self, slot: cython.Py_ssize_t, active: cython.double, idle: cython.double) -> None:
        """Queue again a slot :meth:`take` took, with these deadlines (a deadline still due at ``now`` would
        come back from :meth:`take` at once: the caller moves it forward)."""
        self.active[slot] = active
        self.idle[slot] = idle
        self.queued[slot] = 1
        self.change += 1
        push_entry(self.heap, ms_of(active if active < idle else idle), slot)

    def close(self) -> None:
        """The held-back entries back into the heap, and the queue's columns let go."""
        early = self.early
        self.early = []
        for entry in early:
            self.heap.push(entry)
        self.queued = self.active = self.idle = None  # type: ignore[assignment]  # (compiled: views released)


# The heap as an object the caller knows is one (the admission pushes; the due loop pops).


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def push_entry(heap: object, ms: cython.longlong, slot: cython.uint) -> cython.int:
    """Push the pair (0; -1 with MemoryError set, compiled)."""
    h: DeadlineHeap = cython.cast(DeadlineHeap, heap)
    if h.n == h.cap:
        _grow(h)
    h.ms[h.n] = ms
    h.slot[h.n] = slot
    h.n += 1
    _up(h, 0, h.n - 1)
    return 0


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def min_ms(heap: object) -> cython.longlong:
    """The smallest entry's millisecond (the heap must not be empty)."""
    h: DeadlineHeap = cython.cast(DeadlineHeap, heap)
    return h.ms[0]


@cython.boundscheck(False)
@cython.wraparound(False)
@cython.initializedcheck(False)
def pop_min(heap: object) -> cython.uint:
    """Pop the smallest entry and return its slot (its millisecond is :func:`min_ms`'s; not empty)."""
    h: DeadlineHeap = cython.cast(DeadlineHeap, heap)
    h.n -= 1
    n: cython.Py_ssize_t = h.n
    top: cython.uint = h.slot[0]
    if n:
        h.ms[0] = h.ms[n]
        h.slot[0] = h.slot[n]
        _down(h, n, 0)
    return top
