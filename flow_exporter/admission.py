"""New connections admitted into the store in bulk: the first poll's hot path (issue 24), written once (issue 39).

What ``Table._admit`` -> ``_track`` -> ``Columns._alloc`` do for one new connection (a connectionId from the
store's sequence, a first-seen stamp, a slot, its columns, the interned key, the keyed table, the expiry queue),
for a run of rows nothing else applies to, without a Python call per row. An :class:`Admission` stops, writing
nothing for it, at the first row that needs anything else: a key the store holds (a duplicate of a row admitted
in this dump is skipped, as ``update_batch`` skips it), a row the checkpoint restored, a tuple the store gave up,
a tombstone of the same incarnation, the cap, a row that may be one the store forgot (readmitted), a slot the
columns must grow for, a value a column cannot hold, an object that is not a plain Connection. The store does
that row in Python and admits the rest in a new run. The lockstep tests (tests/unit/test_native_admit.py) hold
this and the store's Python path to the same state.

Two callers: :func:`admit_rows` (a batch of Connections, ``Table.update_batch``) and the fused poll
(``flow_exporter/fused_poll.py``), which admits a dump row straight from the buffer. Why compiled: that chain
was most of a 1M table's first poll as Python (the first poll, pure and compiled, measured:
docs/performance.md#targets-issue-24-a-million-connections-the-hot-path-compiled). Cython's pure-Python mode:
compiled, the columns are typed views; interpreted, the same code indexes the arrays.

An admission holds the store's column views (``column_views.py``) while it is open: :meth:`Admission.pause`
writes its counters back to the store and lets them go before Python runs (it may grow the columns, admit rows
itself, compact the heap); :meth:`Admission.resume` reads everything again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flow_exporter.connection import Connection
from flow_exporter.flow import ADOPTED
from flow_exporter.flow_ids import id_at, step
from flow_exporter.slot_state import ACTIVE, PRESENT, UNCOUNTED
from flow_exporter.slot_static import intern_key, static_of

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
from flow_exporter.column_views import ColumnViews

if not cython.compiled:
    from flow_exporter.deadline_heap import ms_of, push_entry
    from flow_exporter.flow_ids import id_at, step
    from flow_exporter.slot_static import icmp_bits, intern_key, static_of
else:  # the heap's push, the id sequence, the key and the static bytes: C calls
    from cython.cimports.flow_exporter.deadline_heap import (  # type: ignore[import-untyped,import-not-found,no-redef,unused-ignore]
        ms_of,
        push_entry,
    )
    from cython.cimports.flow_exporter.flow_ids import (  # type: ignore[import-untyped,import-not-found,no-redef,unused-ignore]
        id_at,
        step,
    )
    from cython.cimports.flow_exporter.slot_static import (  # type: ignore[import-untyped,import-not-found,no-redef,unused-ignore]
        icmp_bits,
        intern_key,
        static_of,
    )

__all__ = ["DUPLICATE", "STOPPED", "Admission", "admit_rows", "stamp_after"]

STOPPED: cython.Py_ssize_t = -1  # nothing written: the row is the store's Python path's
DUPLICATE: cython.Py_ssize_t = -2  # a row this dump already showed: nothing to do
_FRESH: cython.uchar = PRESENT | ACTIVE
_UNCOUNTED: cython.uchar = UNCOUNTED
_U32: cython.ulonglong = 0xFFFFFFFF


def stamp_after(last: cython.longlong, wall_ns: cython.longlong) -> cython.longlong:
    """A first-seen stamp for an entry without the kernel's start: strictly after ``last``, so unique."""
    return wall_ns if wall_ns > last + 1 else last + 1


@cython.final
@cython.cclass
class Admission:
    """A run of admissions into ``table`` (a :class:`flow_exporter.store.table.Table`) at ``now`` / ``wall_ns``.

    ``admitted``: a list that gets (slot, connectionId, Connection) for each row admitted, for the store's hook for
    new connections (None: no hook, and rows without a Connection may be admitted).
    """

    def __init__(self, table: Any, now: cython.double, wall_ns: cython.longlong, admitted: list[Any] | None) -> None:
        self.table = table
        self.conns = table.connections
        t = table.timeouts
        self.active_at = now + t.active
        self.idle_at = now + t.idle
        self.wall_ns = wall_ns
        self.admitted = admitted
        self.open = False
        self.count = 0
        self.resume()

    def resume(self) -> None:
        """Read the store's tables, counters and columns (again): the admission may write."""
        if self.open:
            return
        t = self.table
        m = t.memory  # what the store remembers: a row it names is the table's Python path's
        self.orphans, self.restored, self.given_up, self.tombs = t._orphans, m.restored, m.given_up, m.tombs
        self.labels, self.free, self.intern = t._labels, t._free, t._intern
        self.max_conns = t.max_connections
        self.readmit_before = m.readmit_bound()
        self.gen = t._generation
        self.flags = ADOPTED if t.adopt else 0
        self.heap = t.queue.parts()[0]
        self.c = t._column_views()
        self.next_slot = t._next_slot
        self.ids = t._new_id.sequence
        self.stamp = t._last_stamp
        self.count = 0
        self.open = True

    def pause(self) -> None:
        """Write the counters back to the store and let its columns go (before Python runs, and at the end)."""
        if not self.open:
            return
        self.open = False
        self.c = None  # (compiled: its views released, the table keeps them)
        self.table._admitted(self.next_slot, self.ids, self.stamp, self.count)
        self.count = 0

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def admit(
        self,
        key: tuple[Any, ...],
        orig_dst: bytes,
        reply_dst: bytes,
        labels: object,
        opk: cython.ulonglong,
        oby: cython.ulonglong,
        rpk: cython.ulonglong,
        rby: cython.ulonglong,
        ct_id: cython.ulonglong,
        mark: cython.ulonglong,
        status: cython.ulonglong,
        orig_dport: cython.ulonglong,
        reply_sport: cython.ulonglong,
        reply_dport: cython.ulonglong,
        start: cython.longlong,
        stop: cython.longlong,
        tcp: cython.longlong,
        counted: cython.bint,
        icmp: cython.uchar,
        lookup: cython.bint,
        conn: object,
    ) -> cython.Py_ssize_t:
        """Admit one new connection with ``key`` (a ``Connection.key`` tuple) and these values, as ``Table._admit``
        would: its slot, or :data:`STOPPED` / :data:`DUPLICATE`. ``lookup``: whether the keyed table may hold the
        key (the fused poll has just looked it up). ``conn``: what the hook for new connections gets (None: no
        hook may be set). ``tcp``: -1 for none; ``icmp``: which ICMP fields the row has (slot_static.py)."""
        if not self.open or (self.admitted is not None and conn is None):
            return STOPPED
        if (
            ct_id > _U32 or mark > _U32 or status > _U32 or orig_dport > 0xFFFF or reply_sport > 0xFFFF
            or reply_dport > 0xFFFF or tcp < -128 or tcp > 127
        ):  # fmt: skip
            return STOPPED  # a value a column cannot hold
        if labels is not None and type(labels) is not bytes:
            return STOPPED
        c: ColumnViews = self.c
        hs: cython.Py_ssize_t
        if lookup:
            held = self.conns.get(key)
            if held is not None:
                hs = held
                return DUPLICATE if 0 <= hs < c.rows and c.seen[hs] == self.gen else STOPPED
        # Table._admit_row's cases: a restored row, a given-up tuple, a tombstone of this incarnation
        if (self.restored and key in self.restored) or (self.given_up and key in self.given_up):
            return STOPPED
        if self.tombs and (key, ct_id) in self.tombs:
            return STOPPED
        if (
            len(self.conns) + len(self.orphans) >= self.max_conns
            or (start and start <= self.readmit_before)
            or self.gen > _U32
        ):
            return STOPPED
        nfree: cython.Py_ssize_t = len(self.free)
        s: cython.Py_ssize_t = self.free[nfree - 1] if nfree else self.next_slot
        if s < 0 or s >= c.rows or c.queued[s]:
            return STOPPED  # the columns must grow first, or a slot in an unexpected state: Python's path
        # -- admitted: the objects first (an error here leaves the slot unused), then the columns
        ikey = intern_key(key, self.intern)
        static = static_of(orig_dst, reply_dst, orig_dport, reply_sport, reply_dport, icmp)
        first: cython.longlong = start
        if not first:
            self.stamp = stamp_after(self.stamp, self.wall_ns)
            first = self.stamp
        self.ids = step(self.ids)
        fid: cython.longlong = id_at(self.ids)
        if nfree:
            del self.free[nfree - 1]
        else:
            self.next_slot = s + 1
        c.keys[s] = ikey
        c.static[s] = static
        c.fid[s] = fid
        c.first[s] = first
        c.last_active[s] = stop if stop else self.wall_ns
        c.seen[s] = self.gen
        c.bits[s] = _FRESH if counted else _FRESH | _UNCOUNTED
        if self.flags:
            c.flags[s] = self.flags
        c.op[s] = opk
        c.ob[s] = oby
        c.rp[s] = rpk
        c.rb[s] = rby
        c.tcp[s] = tcp
        c.status[s] = status
        c.start[s] = start
        c.ct[s] = ct_id
        c.mark[s] = mark
        self.count += 1
        if labels is not None:
            self.labels[s] = labels
        self.conns[ikey] = s
        if self.admitted is not None:
            self.admitted.append((s, fid, conn))
        # ExpiryQueue.push of a slot not queued: both deadlines, the queued flag, one heap entry
        c.q_active[s] = self.active_at
        c.q_idle[s] = self.idle_at
        c.queued[s] = 1
        push_entry(self.heap, ms_of(self.active_at if self.active_at < self.idle_at else self.idle_at), s)
        return s


_U64_MAX = (1 << 64) - 1
_I64_MIN = -(1 << 63)
_I64_MAX = (1 << 63) - 1


def _u64(o: object) -> cython.ulonglong:
    """``o`` as a column's unsigned 64-bit value: TypeError / OverflowError when it is not an int in range (compiled,
    the conversion itself raises them)."""
    if not cython.compiled:
        if not isinstance(o, int):
            raise TypeError("not an int")
        if not 0 <= o <= _U64_MAX:
            raise OverflowError("outside 64 bits")
    return o  # type: ignore[return-value]


def _i64(o: object) -> cython.longlong:
    """``o`` as a column's signed 64-bit value (as :func:`_u64`)."""
    if not cython.compiled:
        if not isinstance(o, int):
            raise TypeError("not an int")
        if not _I64_MIN <= o <= _I64_MAX:
            raise OverflowError("outside 64 bits")
    return o  # type: ignore[return-value]


def _admit_connection(adm: Admission, conn: Connection) -> cython.Py_ssize_t:
    """One Connection admitted (:meth:`Admission.admit`'s answer); :data:`STOPPED` when a field is not what the
    columns hold (the store's Python path says what is wrong with it)."""
    odst = conn.orig_dst
    rdst = conn.reply_dst
    counted = conn.counted
    if type(odst) is not bytes or type(rdst) is not bytes or type(counted) is not bool:
        return STOPPED
    icmp: cython.uchar = icmp_bits(conn.icmp_type, conn.icmp_code, conn.icmp_id)
    ts = conn.tcp_state
    try:
        key = conn.key
        return adm.admit(
            key, odst, rdst, conn.labels, _u64(conn.orig_packets), _u64(conn.orig_bytes), _u64(conn.reply_packets),
            _u64(conn.reply_bytes), _u64(conn.ct_id), _u64(conn.mark), _u64(conn.status), _u64(conn.orig_dport),
            _u64(conn.reply_sport), _u64(conn.reply_dport), _i64(conn.start_ns), _i64(conn.stop_ns),
            -1 if ts is None else _i64(ts), counted, icmp, True, conn,
        )  # fmt: skip
    except (TypeError, OverflowError):
        return STOPPED


def admit_rows(
    table: Any,
    rows: Sequence[Connection],
    i: cython.Py_ssize_t,
    now: cython.double,
    wall_ns: cython.longlong,
    admitted: Any,
) -> cython.Py_ssize_t:
    """Admit the new connections of ``rows`` from ``i`` on, until one needs the store's Python path: its index
    (``len(rows)``: all done). ``admitted``: as :class:`Admission`'s."""
    adm = Admission(table, now, wall_ns, admitted)
    n: cython.Py_ssize_t = len(rows)
    try:
        while i < n:
            conn = rows[i]
            if type(conn) is not Connection or _admit_connection(adm, conn) == STOPPED:
                break
            i += 1
    finally:
        adm.pause()
    return i
