"""The steady poll, fused (issue 24), written once (issue 39): one dump buffer decoded and applied to the store.

Its specification is the pair it fuses: the buffer decoded into Connections (``ctnetlink.decode``) and those
applied by ``Table.update_batch``; the lockstep tests (tests/unit/test_native.py, test_native_admit.py) hold
both to the same store state and the same records on the same bytes, hostile ones included.

Each row is walked by ctnetlink's walk and looked up in the store's key index without making a Connection; a
row whose connection is known and did not move (the common case) updates the columns in place, exactly as
``update_batch`` would. Every other row (new, moved, reset, re-created, labelled, anything odd) becomes a
Connection and goes to ``update_batch`` in dump order: pending rows are handed over before a known row is
looked at, so the store sees the rows in the order the pair would. A row is first matched against the slot its
position in the dump held last poll (the kernel lists its table in the same order every time), which needs no
key object; only a miss builds the key. When the store has no hook for new connections, a new row no earlier
row waits for is admitted in place (``admission.py``), without a Connection: the first poll of a large table is
mostly such rows.

Cython's pure-Python mode: compiled, the buffer and the columns are typed views; interpreted, the same code.
Nothing here raises on garbage bytes: a malformed message is skipped and counted.
"""

from __future__ import annotations

from collections.abc import Container, MutableMapping
from typing import TYPE_CHECKING, Any

from flow_exporter.column_views import ColumnViews
from flow_exporter.sampling import ASK, DROP, KEEP
from flow_exporter.slot_state import DESTROYED, ORPHAN, PRESENT, UNCOUNTED

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if not cython.compiled:
    from flow_exporter.admission import STOPPED, Admission
    from flow_exporter.ctnetlink import (
        _DST,
        _INET,
        _LABELS,
        _R,
        _SRC,
        _address,
        _bytes_at,
        _connection,
        _next_entry,
        _result,
        _Row,
        _row_of,
        _Walk,
    )
    from flow_exporter.sampling import Sampler
else:  # the walk's state and rules, and the admission, as C calls
    from cython.cimports.flow_exporter.admission import (  # type: ignore[import-untyped,import-not-found,no-redef,unused-ignore]
        STOPPED,
        Admission,
    )
    from cython.cimports.flow_exporter.ctnetlink import (  # type: ignore[import-untyped,import-not-found,no-redef,unused-ignore]
        _DST,
        _INET,
        _LABELS,
        _R,
        _SRC,
        _address,
        _bytes_at,
        _connection,
        _next_entry,
        _result,
        _Row,
        _row_of,
        _Walk,
    )
    from cython.cimports.flow_exporter.sampling import (  # type: ignore[import-untyped,import-not-found,no-redef,unused-ignore]
        Sampler,
    )
    from cython.cimports.libc.string import memcmp  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["apply_dump"]

_PRESENT: cython.uchar = PRESENT
_DESTROYED: cython.uchar = DESTROYED
_ORPHAN: cython.uchar = ORPHAN
_UNCOUNTED: cython.uchar = UNCOUNTED
_KEEP: cython.int = KEEP  # the sampler's answers (sampling.py)
_DROP: cython.int = DROP
_ASK: cython.int = ASK
_I64_MAX: cython.ulonglong = 0x7FFFFFFFFFFFFFFF
_U32: cython.ulonglong = 0xFFFFFFFF


def _int_is(o: object, v: cython.ulonglong) -> cython.bint:
    """Whether ``o`` (a key's field) is the int ``v``, without making an int of ``v``."""
    if type(o) is not int:
        return False
    x: cython.ulonglong
    try:
        x = o
    except OverflowError:
        return False
    return x == v


def _bytes_is(o: object, w: _Walk, f: cython.int) -> cython.bint:
    """Whether ``o`` (a key's field) is the bytes of address ``f`` of the walked message, without copying them."""
    if type(o) is not bytes:
        return False
    b: bytes = o
    size: cython.Py_ssize_t = 4 if w.family == _INET else 16
    if len(b) != size:
        return False
    same: cython.bint
    if cython.compiled:
        at: cython.Py_ssize_t = w.v[f]
        same = memcmp(cython.cast(cython.p_const_char, b), cython.address(w.buf[at]), size) == 0
    else:
        same = b == _address(w, f)
    return same


@cython.boundscheck(False)
@cython.wraparound(False)
def _slot_holds(c: ColumnViews, s: cython.Py_ssize_t, w: _Walk, r: _Row) -> cython.bint:
    """Whether slot ``s`` holds this row's tuple in the keyed table: a slot that holds a key and is not an orphan
    is the one the key index maps it to (the table keeps that invariant)."""
    if s < 0 or s >= c.rows or c.bits[s] & _ORPHAN:
        return False
    o = c.keys[s]
    if type(o) is not tuple:
        return False
    k: tuple[Any, ...] = o
    if len(k) != 6:
        return False
    return (
        _int_is(k[3], r.sport)
        and _bytes_is(k[2], w, _SRC)
        and _int_is(k[5], _key_port(r))
        and _bytes_is(k[4], w, _R + _SRC)
        and _int_is(k[1], r.proto)
        and _int_is(k[0], r.zone)
    )


def _key_port(r: _Row) -> cython.ulonglong:
    """The key's last field, as ``Connection.key`` picks it: the destination port (type << 8 | code) for ICMP, the
    reply's source port otherwise."""
    return r.dport if r.icmp else r.rsport


def _key(w: _Walk, r: _Row) -> tuple[Any, ...]:
    """The row's lookup key: (zone, proto, orig_src, sport, reply_src, the key port), as ``Connection.key``."""
    return (r.zone, r.proto, _address(w, _SRC), r.sport, _address(w, _R + _SRC), _key_port(r))


def _find(conns: dict, key: tuple) -> cython.Py_ssize_t:  # type: ignore[type-arg]
    """The slot of ``key`` in the keyed table, or -1."""
    slot = conns.get(key)
    if slot is None:
        return -1
    s: cython.Py_ssize_t = slot
    return s if s >= 0 else -1


@cython.boundscheck(False)
@cython.wraparound(False)
def _fast_update(
    c: ColumnViews, s: cython.Py_ssize_t, r: _Row, gen: cython.ulonglong, labelled_slot: cython.bint
) -> cython.bint:
    """Apply a known row in place if ``update_batch`` would only write its status, seen mark, counted bit and stop
    time: True done, False leave it to ``update_batch`` (nothing written). Mirrors it line by line."""
    if c.seen[s] == gen:
        return True  # the same tuple twice in one dump: keep the first
    if r.start > _I64_MAX or r.stop > _I64_MAX:
        return False
    old_ct: cython.ulonglong = c.ct[s]
    old_start: cython.longlong = c.start[s]
    cstart: cython.longlong = r.start
    if (
        (old_ct != r.ct_id and old_ct and r.ct_id)
        or (old_start != cstart and old_start and cstart)
        or (not old_start and cstart and (cstart > c.first[s] or c.seq[s]))
    ):
        return False  # a new incarnation
    b: cython.uchar = c.bits[s]
    if b & _DESTROYED:
        c.seen[s] = gen
        return True  # a dump older than its DESTROY event
    if r.oby < c.ob[s] or r.rby < c.rb[s] or r.opk < c.op[s] or r.rpk < c.rp[s]:
        return False  # a counter reset
    if r.opk > c.op[s] or r.rpk > c.rp[s] or r.tcp != c.tcp[s]:
        return False  # it moved: the expiry queue has work
    if old_start != cstart:
        return False  # learns its start stamp
    if old_ct != r.ct_id or c.mark[s] != r.mark or r.labelled or labelled_slot:
        return False
    if not b & _PRESENT:
        return False  # the previous dump missed it
    if r.status > _U32:
        return False
    c.seen[s] = gen
    if r.counted:
        b &= ~_UNCOUNTED
    else:
        b |= _UNCOUNTED
    c.bits[s] = b
    c.status[s] = r.status
    if r.stop:
        c.last_active[s] = r.stop
    return True


def _admit(adm: Admission, key: tuple[Any, ...], w: _Walk, r: _Row) -> cython.Py_ssize_t:
    """A row the store does not hold, admitted straight from the buffer: :meth:`Admission.admit`'s answer
    (:data:`STOPPED` also when a value does not fit the admission's types: the row goes the Connection's way)."""
    if r.start > _I64_MAX or r.stop > _I64_MAX:
        return STOPPED
    return adm.admit(
        key, _address(w, _DST), _address(w, _R + _DST),
        _bytes_at(w, _LABELS, w.labels_len) if r.labelled else None, r.opk, r.oby,
        r.rpk, r.rby, r.ct_id, r.mark, r.status, r.dport, r.rsport, r.rdport, r.start, r.stop, r.tcp, r.counted,
        7 if r.icmp else 0, False, None,
    )  # fmt: skip


def _word(w: _Walk, at: cython.Py_ssize_t, n: cython.Py_ssize_t) -> cython.ulonglong:
    """``n`` bytes of the buffer from ``at``, big-endian (an address, as the sampler's words)."""
    x: cython.ulonglong = 0
    i: cython.Py_ssize_t
    for i in range(at, at + n):
        x = (x << 8) | w.buf[i]
    return x


def _sampled(w: _Walk, r: _Row, sampler: Sampler) -> cython.int:
    """The sampler's answer for the walked row (``Sampler.keeps`` of its Connection, read from the buffer): the
    original source and the destination after DNAT (the reply's source), ICMP's identifier on both ends."""
    src: cython.Py_ssize_t = w.v[_SRC]
    dst: cython.Py_ssize_t = w.v[_R + _SRC]
    dport: cython.ulonglong = r.sport if r.icmp else r.rsport
    if w.family == _INET:
        return sampler.decide(4, r.proto, 0, _word(w, src, 4), r.sport, 0, _word(w, dst, 4), dport, r.ct_id)
    return sampler.decide(
        6, r.proto, _word(w, src, 8), _word(w, src + 8, 8), r.sport, _word(w, dst, 8), _word(w, dst + 8, 8), dport,
        r.ct_id,
    )  # fmt: skip


def _count_zone(zone_counts: MutableMapping[int, int], zone: cython.ulonglong, count: cython.Py_ssize_t) -> None:
    if count:
        zone_counts[zone] = zone_counts.get(zone, 0) + count


def _hand_over(table: Any, pending: list[Any], adm: Admission | None, now: float, wall_ns: int) -> ColumnViews:
    """The pending rows applied by ``update_batch`` (the caller has let the columns go: it may grow them; the
    admission is paused around it); the columns taken again."""
    if adm is not None:
        adm.pause()
    rows = pending[:]
    del pending[:]
    table.apply_rows(rows, now, wall_ns)  # sampled already
    if adm is not None:
        adm.resume()
    views: ColumnViews = table._column_views()
    return views


@cython.boundscheck(False)
@cython.wraparound(False)
def apply_dump(
    table: Any,
    buf: memoryview,
    zones: Container[int] | None,
    now: cython.double,
    wall_ns: cython.longlong,
    zone_counts: MutableMapping[int, int],  # a Counter, as the poll loop passes it (a typed dict would refuse one)
) -> tuple[int, int, int, bool, int, bool, int]:
    """One receive buffer of the current dump of ``table`` (a :class:`flow_exporter.store.table.Table` between its
    ``begin_poll`` and ``end_poll``) applied; ``zone_counts`` gets the kept entries per zone added.

    Returns (decoded, skipped, ignored, done, errno, interrupted, kept), as ``ctnetlink.decode``.
    """
    w = _Walk(buf)
    r = _Row()
    c: ColumnViews = table._column_views()
    conns: dict[Any, int] = table.connections
    labels: dict[int, bytes] = table._labels
    gen: cython.ulonglong = table._generation
    ordinal: cython.Py_ssize_t = table._dump_rows
    admit: cython.bint = table.on_new is None
    sampler: Sampler | None = table.sampler
    verdict: cython.int = _KEEP
    if sampler is not None:
        sampler.now_ns = wall_ns
    adm: Admission | None = None
    pending: list[Any] = []
    run_zone: cython.ulonglong = 0
    run: cython.Py_ssize_t = 0
    pos: cython.Py_ssize_t
    s: cython.Py_ssize_t
    got: cython.Py_ssize_t
    done: cython.bint
    try:
        while _next_entry(w, zones):
            _row_of(w, r)
            pos = ordinal + w.kept - 1  # this row's position among the dump's kept rows
            if run and r.zone != run_zone:
                _count_zone(zone_counts, run_zone, run)
                run = 0
            run_zone = r.zone
            run += 1  # (a row the sampler drops is in the table: counted, as the Connections' path counts it)
            if sampler is not None:
                verdict = _sampled(w, r, sampler)
                if verdict == _DROP:
                    continue
            key = None
            if pos < c.orders and _slot_holds(c, c.order[pos], w, r):
                s = c.order[pos]
            else:
                key = _key(w, r)
                s = _find(conns, key)
            if verdict == _ASK:  # shedding's band: kept if the store holds this incarnation, else decided now
                verdict = _KEEP
                held: cython.bint = 0 <= s < c.rows and (c.ct[s] == r.ct_id or not c.ct[s] or not r.ct_id)
                if not held and not sampler.first_meeting(r.start):  # type: ignore[union-attr]
                    continue
            if s >= 0 and pending:  # earlier rows first: they may change what this one finds
                c = None  # type: ignore[assignment]  # its views let go: update_batch may grow the columns
                c = _hand_over(table, pending, adm, now, wall_ns)
                if key is None:
                    key = _key(w, r)
                s = _find(conns, key)
            if s == -1 and admit and not pending:  # new, and no earlier row waits
                if adm is None:  # the first new row of this buffer: a steady poll's buffers have none
                    adm = Admission(table, now, wall_ns, None)
                assert key is not None  # s is -1: the lookup built the key
                got = _admit(adm, key, w, r)
                if got >= 0:
                    if pos < c.orders:
                        c.order[pos] = got
                    continue
            done = False
            if 0 <= s < c.rows:
                if pos < c.orders:
                    c.order[pos] = s
                done = _fast_update(c, s, r, gen, bool(labels) and s in labels)
            if not done:
                pending.append(_connection(w, r))
        _count_zone(zone_counts, run_zone, run)
        if pending:
            c = None  # type: ignore[assignment]
            _hand_over(table, pending, adm, now, wall_ns)
    finally:
        if adm is not None:
            adm.pause()
    return _result(w)
