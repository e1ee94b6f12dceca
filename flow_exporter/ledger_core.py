"""The ledger's per-record rules over the store's columns, written once (issue 39): a record built, a delivery settled.

:func:`build_records` freezes a due connection's counts into an :class:`~flow_exporter.flow.Export` (its
totals become the base of the next delta at once, and it is the one record in flight);
:func:`settle_delivered` settles delivered records of live connections. Both work on a batch, straight on
the store's columns (``flow_exporter.store.columns``), in Cython's pure-Python mode: compiled, a column is a
typed view and a record's fields are struct members; interpreted, the same code indexes the arrays.
:class:`flow_exporter.store.table.Table` calls them (its batch API: ``due``, ``build``, ``settle``); what
they leave to it (a record of a restored or ended connection settled) it does itself.

Why compiled: at 50k records/s the build and the settling of each record were a visible share of the node
run's CPU as Python (bench_node, py-spy); the hand-written C they replaced (``_records.c``, before issue 39) was the
same work.

A sequence at its column's limit (2**32 - 1) cannot be followed: building that record raises OverflowError
before anything is written, in both builds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flow_exporter.connection import IPS_HW_OFFLOAD, IPS_OFFLOAD
from flow_exporter.deadline_heap import DueSlots
from flow_exporter.export import Export
from flow_exporter.flow import (
    ACTIVE_TIMEOUT,
    END_OF_FLOW,
    FORCED_END,
    IDLE_TIMEOUT,
    LACK_OF_RESOURCES,
    NO_COUNTERS,
    OFFLOADED,
    ROW_ENDED,
    ROW_GIVEN_UP,
    ROW_RESET,
)
from flow_exporter.slot_state import ACTIVE, DESTROYED, FINAL_DUE, LAST_ACTIVE, UNCOUNTED

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from collections.abc import Callable

    from flow_exporter import cython_shim as cython
    from flow_exporter.connection import Connection
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:  # a record's fields as struct members, once checked to be an Export; the dying rule, a C call
    from cython.cimports.flow_exporter.dying import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        is_dying,
    )
    from cython.cimports.flow_exporter.export import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        as_export,
    )
else:
    from flow_exporter.dying import is_dying
    from flow_exporter.export import as_export

__all__ = ["build_records", "due", "settle_delivered"]

_UNCOUNTED: cython.uchar = UNCOUNTED
_DESTROYED: cython.uchar = DESTROYED
_FINAL_DUE: cython.uchar = FINAL_DUE
_LAST_ACTIVE: cython.uchar = LAST_ACTIVE
_NO_COUNTERS: cython.uchar = NO_COUNTERS
_OFFLOADED: cython.uchar = OFFLOADED
_OFFLOAD_STATUS: cython.uint = IPS_OFFLOAD | IPS_HW_OFFLOAD
_ACTIVE_TIMEOUT: cython.int = ACTIVE_TIMEOUT
_FORCED_END: cython.int = FORCED_END
_LACK_OF_RESOURCES: cython.int = LACK_OF_RESOURCES
_ROW_ENDED: cython.int = ROW_ENDED
_ROW_GIVEN_UP: cython.int = ROW_GIVEN_UP
_ROW_RESET: cython.int = ROW_RESET
_SEQ_MAX: cython.uint = 0xFFFFFFFF
_ACTIVE: cython.uchar = ACTIVE
_END_OF_FLOW: cython.uchar = END_OF_FLOW
_IDLE_TIMEOUT: cython.uchar = IDLE_TIMEOUT
_ACTIVE_TIMEOUT_CODE: cython.uchar = ACTIVE_TIMEOUT


@cython.final
@cython.cclass
class _DueColumns:
    """The columns the due loop reads (compiled: typed views), taken once per loop."""

    def __init__(self, store: Any, idle: Any) -> None:
        self.reason, self.bits, self.tcp, self.status = store._reason, store._bits, store._tcp, store._status
        self.idle = idle
        self.keys, self.pending = store._keys, store._pending
        self.rows = min(len(self.keys), len(self.pending), len(self.reason), len(self.bits), len(self.tcp),
                        len(self.status), len(idle))  # fmt: skip


@cython.boundscheck(False)
@cython.wraparound(False)
def due(
    store: Any,
    now: cython.double,
    limit: cython.Py_ssize_t,
    todo: list[int],
    why: bytearray,
    retry: list[int],
    taken: set[int],
) -> None:
    """What the store's expiry queue has due at ``now``, earliest first, sorted into records to build (``todo``,
    with the reason of each in ``why``) and retries (``retry``: the slot's record, or one taken before in this
    round, in ``taken``, is in flight); at most ``limit`` records (-1: no limit), the one past it queued again.

    A live connection's slot is over (the dying rule: END_OF_FLOW), idle (IDLE_TIMEOUT: it leaves the queue,
    oldest-idle order) or active (ACTIVE_TIMEOUT: queued again for its next active timeout). A slot with an
    end reason gets its final record once (FINAL_DUE) and nothing after. The queue's count stays exact when a
    key's protocol cannot be read (an error stops the loop where it is).
    """
    queue = store.queue
    heap, queued, active_at, idle_at = queue.parts()
    c = _DueColumns(store, idle_at)
    d: DueSlots = DueSlots(heap, queued, active_at, idle_at, now)
    every: cython.double = store.timeouts.active
    idle_order: dict[int, None] = store._idle
    some_taken: cython.bint = len(taken) > 0
    s: cython.Py_ssize_t
    r: cython.uchar
    try:
        while True:
            s = d.take()
            if s < 0:
                break
            if s >= c.rows:
                raise IndexError(f"slot {s} past the columns ({c.rows} rows)")
            if limit >= 0 and len(todo) >= limit:
                d.requeue(s, active_at[s], c.idle[s])
                break
            if c.pending[s] is not None or (some_taken and s in taken):
                retry.append(s)
                continue
            r = c.reason[s]
            if r:
                if c.bits[s] & _FINAL_DUE:
                    todo.append(s)
                    why.append(r)
                continue
            key = c.keys[s]
            if key is not None and is_dying(key[1], c.tcp[s], c.status[s]):
                # TIME_WAIT or CLOSE: still in the table, but over; later movement queues it again.
                todo.append(s)
                why.append(_END_OF_FLOW)
            elif c.idle[s] <= now:
                todo.append(s)
                c.bits[s] &= ~_ACTIVE
                idle_order[s] = None
                why.append(_IDLE_TIMEOUT)
            else:
                todo.append(s)
                why.append(_ACTIVE_TIMEOUT_CODE)
                d.requeue(s, now + every, c.idle[s])
    finally:
        d.close()
        queue.counted(d.change)


@cython.final
@cython.cclass
class _Columns:
    """The columns a record's build reads and writes, taken from the store once per batch (compiled: typed views,
    so a slot's value is one load; the store grows its columns between batches, never during one)."""

    def __init__(self, store: Any) -> None:
        self.op, self.ob, self.rp, self.rb = store._op, store._ob, store._rp, store._rb
        self.bp, self.bb, self.brp, self.brb = store._bp, store._bb, store._brp, store._brb
        self.seq, self.status, self.ct, self.epoch = store._seq, store._status, store._ct, store._epoch
        self.last, self.fid, self.first, self.start = store._last_active, store._fid, store._first, store._start
        self.tcp = store._tcp
        self.source_flags = store.source_flags
        self.flags, self.reason, self.bits = store._flags, store._reason, store._bits
        self.keys, self.meta, self.prefix, self.pending = store._keys, store._meta, store._prefix, store._pending
        self.rows = min(len(store._keys), len(self.op), len(self.bits), len(self.pending), len(self.prefix))


@cython.boundscheck(False)
@cython.wraparound(False)
def _build(c: _Columns, s: cython.Py_ssize_t, reason: cython.int, view: Callable[[int], Connection]) -> Export:
    """The record of slot ``s`` for ``reason`` (Ledger: README, "Counting: the contract")."""
    if s < 0 or s >= c.rows:
        raise IndexError(f"slot {s} past the columns ({c.rows} rows)")
    seq: cython.uint = c.seq[s]
    if seq == _SEQ_MAX:
        raise OverflowError(f"slot {s}: sequence {seq} is the column's last")
    o0: cython.ulonglong = c.op[s]
    o1: cython.ulonglong = c.ob[s]
    o2: cython.ulonglong = c.rp[s]
    o3: cython.ulonglong = c.rb[s]
    b0: cython.ulonglong = c.bp[s]
    b1: cython.ulonglong = c.bb[s]
    b2: cython.ulonglong = c.brp[s]
    b3: cython.ulonglong = c.brb[s]
    end_reason: cython.int = c.reason[s]
    prefix = c.prefix[s]
    flags: cython.uchar = c.flags[s]
    # Counter fidelity (flow.NO_COUNTERS, flow.OFFLOADED, the source's flow.BOTH_DIRECTIONS): kept once seen; the
    # cached prefix holds the old flags, so it goes.
    b: cython.uchar = c.bits[s]
    seen: cython.uchar = (
        (_NO_COUNTERS if b & _UNCOUNTED else 0) | (_OFFLOADED if c.status[s] & _OFFLOAD_STATUS else 0) | c.source_flags
    )
    if seen & ~flags:
        flags = flags | seen
        c.flags[s] = flags
        prefix = None
        c.prefix[s] = None
    ts: cython.int = c.tcp[s]
    e: Export = Export.__new__(Export)
    e.reason = reason
    e.sequence = seq
    e.totals = (o0, o1, o2, o3)
    # the positive part of each delta (a counter that went back, after a reset, is no negative delta)
    e.deltas = (o0 - b0 if o0 > b0 else 0, o1 - b1 if o1 > b1 else 0, o2 - b2 if o2 > b2 else 0,
                o3 - b3 if o3 > b3 else 0)  # fmt: skip
    e.final = end_reason != 0
    e.flow_end_ns = c.last[s]
    e.flow_id = c.fid[s]
    e.first_seen_ns = c.first[s]
    e.conn_key = c.keys[s]
    e.ct_id = c.ct[s]
    e.start_ns = c.start[s]
    e.flags = flags
    # Over for good (not a give-up of a live entry): the journal lets its row go.
    e.ended = end_reason != 0 and (end_reason != _LACK_OF_RESOURCES or (b & _DESTROYED) != 0)
    e.tcp_state = None if ts < 0 else ts
    e.meta = c.meta[s]
    e.conn = None if prefix is not None else view(s)
    e.prefix = prefix
    e.slot = s
    e.epoch = c.epoch[s]
    e.value = None
    e.topic = None
    e.key = None
    e.attempts = 0
    e.export_ms = 0
    row_kind: cython.int = 0
    # An active-timeout record leaves the connection's end unreported: its end owes one more record.
    b = (b | _LAST_ACTIVE) if reason == _ACTIVE_TIMEOUT else (b & ~_LAST_ACTIVE)
    if end_reason:
        b &= ~_FINAL_DUE
        if b & _DESTROYED:
            pass  # a destroyed entry cannot be met again: its row can go (also one given up at its DESTROY)
        elif end_reason == _LACK_OF_RESOURCES:
            row_kind = _ROW_GIVEN_UP
        else:
            row_kind = _ROW_ENDED | (_ROW_RESET if end_reason == _FORCED_END else 0)
    e.row_kind = row_kind
    # frozen: its totals are the next delta's base, and it is the one record in flight
    c.seq[s] = seq + 1
    c.bp[s] = o0
    c.bb[s] = o1
    c.brp[s] = o2
    c.brb[s] = o3
    c.bits[s] = b
    c.pending[s] = e
    return e


def build_records(store: Any, slots: list[int], reasons: bytes, out: list[Export], view: Any) -> None:
    """The record of each slot in ``slots`` for the reason at the same index of ``reasons``, appended to ``out``
    in order; ``view(slot)``: the connection's fields, for a record without a cached prefix."""
    if len(reasons) != len(slots):
        raise ValueError(f"{len(slots)} slots and {len(reasons)} reasons")
    c = _Columns(store)
    i: cython.Py_ssize_t
    for i in range(len(slots)):
        out.append(_build(c, slots[i], reasons[i], view))


def settle_delivered(store: Any, exports: list[Export], keep_prefix: cython.uchar, other: Any) -> None:
    """Delivered records settled, in order: a live connection's record in flight is in flight no more, and its
    prefix is kept for the connection's next record while ``keep_prefix`` (ACTIVE, or 0: no cache) is among its
    bits (dropped otherwise). Any other record (restored, stale, of an ended connection) goes to
    ``other(export)``."""
    pending: list[Any] = store._pending
    prefix: list[Any] = store._prefix
    reason = store._reason
    bits = store._bits
    epoch = store._epoch
    rows: cython.Py_ssize_t = min(len(pending), len(prefix), len(reason), len(bits), len(epoch))
    s: cython.Py_ssize_t
    for x in exports:
        e: Export = as_export(x)
        s = e.slot
        if s < 0 or s >= rows or pending[s] is not e or reason[s] != 0:
            other(e)
            continue
        pending[s] = None
        if bits[s] & keep_prefix:
            if e.prefix is not None and e.epoch == epoch[s]:
                prefix[s] = e.prefix  # the encoder's work, kept for the next record
        else:
            prefix[s] = None  # idle (or no cache): free the record prefix until it is needed again
