"""The bytes of the state directory's rows: a snapshot's connections and records, the journal's entries.

Written once (issue 39), in Cython's pure-Python mode: compiled, each field is a few C stores into the
output buffer; interpreted, the same code appends each field's bytes (slower, same bytes). The layouts
are stated here twice, on purpose and side by side: as :mod:`struct` formats, which the checkpoint's
reader parses with (:data:`ROW`, :data:`SENT_ROW`, :data:`RECORD`, :data:`ACK`), and as the writers
below, field by field in the same order. ``tests/unit/test_checkpoint_rows.py`` holds each writer to
its format (both builds), so a field added to one and not the other fails there.

Why compiled: at 50k records/s over a 250k table a snapshot is due every few seconds and every record
is journaled twice (sent, settled); packing a row through a ``Restored`` and :mod:`struct` was a large share
of the exporter's CPU (py-spy), reading the store's columns directly a small one (a snapshot packed either
way, measured: docs/performance.md#checkpoint).

A value that does not fit its field raises: ``OverflowError`` (a negative or too large number),
``TypeError`` (not an int, an address that is not bytes, columns that are not the store's arrays),
``ValueError`` (addresses of two lengths or of neither family's), ``IndexError`` (a slot past the
columns); the output keeps what was packed before it. Both builds raise the same type for the same input.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from flow_exporter.export import Export
from flow_exporter.flow import ReportedRows, RowColumns

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
    from flow_exporter.flow import Restored
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:  # C's memcpy and the bytearray's own resize (interpreted, bytes are appended instead)
    from cython.cimports.cpython.bytearray import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyByteArray_AS_STRING,
        PyByteArray_Resize,
    )
    from cython.cimports.cpython.long import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyLong_AsLongLongAndOverflow,
        PyLong_AsUnsignedLongLong,
    )
    from cython.cimports.flow_exporter.export import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        as_export,
    )
    from cython.cimports.libc.string import memcpy  # type: ignore[import-untyped,import-not-found,unused-ignore]
else:
    from flow_exporter.export import as_export

__all__ = [
    "ACK", "RECORD", "ROW", "SENT_ROW", "journal_acked", "journal_sent", "pack_columns", "pack_records",
    "pack_restored", "row_size",
]  # fmt: skip

# A row: address length, zone, proto, sport, dport, src, dst, ct_id, start, first seen, flow id,
# next sequence, base totals x4, flags (see _put_row). One struct per address family.
_ROW_FIELDS = "BHBHH{0}s{0}sIQQqQQQQQB"
ROW = {4: struct.Struct("!" + _ROW_FIELDS.format(4)), 16: struct.Struct("!" + _ROW_FIELDS.format(16))}
# A journaled record: its connection's row (next sequence = its sequence + 1, base = its totals),
# then ended, topic length, key length, value length; then topic, key and value bytes (see _put_sent).
SENT_ROW = {n: struct.Struct(r.format + "BHHI") for n, r in ROW.items()}
# A record in a snapshot: flow id, sequence, totals x4, topic, key and value lengths; then the bytes.
RECORD = struct.Struct("!qQQQQQHHI")
ACK = struct.Struct("!qQ")  # a settled record: flow id, sequence
# Their sizes as C constants compiled (read once here, not as an attribute of a struct object per record)
_RECORD_SIZE: cython.Py_ssize_t = RECORD.size
_ACK_SIZE: cython.Py_ssize_t = ACK.size

# flow.RECORD_FLAGS: the record's own flags, kept in a journaled row beside its ROW_* kind bits
_RECORD_FLAGS = 0x1F
# The typecode of each flow.RowColumns field, in its order: an array's, or None for the one bytearray (flags)
_COLUMN_CODES = ("I", "q", "q", "q", "I", "Q", "Q", "Q", "Q", None)


def row_size(alen: cython.Py_ssize_t) -> cython.Py_ssize_t:
    """A row's bytes for an address length (4 or 16): ROW[alen].size."""
    return 85 + 2 * alen


@cython.final
@cython.cclass
class _Out:
    """A bytearray appended to. Compiled: room made ahead and each field stored at a pointer into the
    bytearray's own buffer (taken again after every resize); interpreted: each field's bytes appended.
    :meth:`close` trims the room not used.

    The room doubles what this writer wrote (or what :meth:`room` is asked for, when the caller knows the
    whole), by a resize of the bytearray in place (realloc), never with a zeroed block beside it. Why a
    pointer and not a typed memoryview: a store through the view reloads the view's base from this object
    for every byte (a byte store may alias anything), where a local pointer lets the C compiler merge a
    field's bytes into one store (perf: through the view, the rows' writers were slower than the hand-written
    C they replaced)."""

    def __init__(self, out: bytearray) -> None:
        self.out = out
        self.pos = len(out)
        self.start = self.pos
        self.cap = self.pos
        if cython.compiled:
            self.buf = cython.cast(cython.p_uchar, PyByteArray_AS_STRING(out))

    def room(self, n: cython.Py_ssize_t) -> None:
        """At least ``n`` more bytes may be stored (compiled; interpreted, appends need none)."""
        if cython.compiled and self.pos + n > self.cap:
            more: cython.Py_ssize_t = max(n, self.pos - self.start, 4096)
            PyByteArray_Resize(self.out, self.cap + more)
            self.cap += more
            self.buf = cython.cast(cython.p_uchar, PyByteArray_AS_STRING(self.out))

    def close(self) -> None:
        """Trim the buffer to what was stored."""
        if self.cap > self.pos:
            del self.out[self.pos :]
        self.cap = self.pos
        if cython.compiled:
            self.buf = cython.NULL

    def u8(self, v: cython.uchar) -> None:
        if cython.compiled:
            self.buf[self.pos] = v
            self.pos += 1
        else:
            self.out.append(v)  # ValueError past 255 interpreted: see _uint
            self.pos += 1

    def be(self, v: cython.ulonglong, size: cython.int) -> None:
        """``v`` as ``size`` bytes, big-endian (network order, struct's "!")."""
        if cython.compiled:
            p: cython.p_uchar = self.buf + self.pos
            i: cython.int
            for i in range(size - 1, -1, -1):
                p[i] = v & 0xFF
                v >>= 8
            self.pos += size
        else:
            self.out += v.to_bytes(size, "big")
            self.pos += size

    def i64(self, v: cython.longlong) -> None:
        """``v`` as a signed 64-bit big-endian field (struct's "q")."""
        if cython.compiled:
            self.be(cython.cast(cython.ulonglong, v), 8)
        else:
            self.be(v & 0xFFFFFFFFFFFFFFFF, 8)

    def raw(self, data: bytes) -> None:
        n: cython.Py_ssize_t = len(data)
        if cython.compiled:
            if n:
                memcpy(self.buf + self.pos, cython.cast(cython.p_char, data), n)
        else:
            self.out += data
        self.pos += n


def _uint(v: object, bits: cython.int) -> cython.ulonglong:
    """``v`` when it is an int that fits ``bits`` unsigned bits, else OverflowError (TypeError: not an int).

    Compiled, C's conversions without a try block (its set-up cost more than the conversion: perf of the node
    run); interpreted, Python's ints are compared. Both refuse the same values with the same error."""
    if not isinstance(v, int):
        raise TypeError(f"an int is needed, not {type(v).__name__}")
    if cython.compiled:
        overflow: cython.int = 0
        x: cython.longlong = PyLong_AsLongLongAndOverflow(v, cython.address(overflow))
        u: cython.ulonglong
        if overflow == 0 and x >= 0:
            u = x
        elif overflow > 0 and bits == 64 and v <= 0xFFFFFFFFFFFFFFFF:
            u = PyLong_AsUnsignedLongLong(v)  # past 63 bits, within 64
        else:
            raise OverflowError(f"{v} does not fit {bits} unsigned bits")
        if bits < 64 and u >> bits:
            raise OverflowError(f"{v} does not fit {bits} unsigned bits")
    elif v < 0 or v >> bits:
        raise OverflowError(f"{v} does not fit {bits} unsigned bits")
    else:
        u = v
    return u


def _int64(v: object) -> cython.longlong:
    """``v`` when it is an int that fits 64 signed bits, else OverflowError (TypeError: not an int)."""
    if not isinstance(v, int):
        raise TypeError(f"an int is needed, not {type(v).__name__}")
    if cython.compiled:
        overflow: cython.int = 0
        i: cython.longlong = PyLong_AsLongLongAndOverflow(v, cython.address(overflow))
        if overflow:
            raise OverflowError(f"{v} does not fit 64 signed bits")
    elif v < -0x8000000000000000 or v > 0x7FFFFFFFFFFFFFFF:
        raise OverflowError(f"{v} does not fit 64 signed bits")
    else:
        i = v
    return i


def _blob(v: object) -> bytes:
    """``v or b""`` for a record's key or value: bytes only (what the sink leaves there)."""
    if v is None:
        return b""
    if not isinstance(v, bytes):
        raise TypeError(f"bytes are needed, not {type(v).__name__}")
    return v


def _four(totals: Sequence[object]) -> Sequence[object]:
    """A record's or a row's totals (packets and bytes, each way): four of them (a clear error, both builds)."""
    if len(totals) != 4:
        raise ValueError(f"4 totals are needed, not {len(totals)}")
    return totals


def _alen(key: Sequence[Any]) -> cython.Py_ssize_t:
    """The address length of a connection key (a tuple: zone, proto, src, sport, dst, dport): 4 or 16."""
    if type(key) is not tuple:  # compiled, a row's key fields are read as a tuple's items (a subclass's may not be)
        raise TypeError(f"a connection key is a tuple, not {type(key).__name__}")
    k: tuple[Any, ...] = key
    if len(k) != 6:
        raise ValueError(f"a connection key has 6 fields, not {len(k)}")
    src, dst = k[2], k[4]
    if not isinstance(src, bytes) or not isinstance(dst, bytes):
        raise TypeError(f"addresses are bytes, not {type(src).__name__} and {type(dst).__name__}")
    n: cython.Py_ssize_t = len(src)
    if (n != 4 and n != 16) or len(dst) != n:
        raise ValueError(f"addresses of {n} and {len(dst)} bytes (4 or 16, both alike)")
    return n


def _put_row(
    o: _Out,
    key: Sequence[Any],
    alen: cython.Py_ssize_t,
    ct: cython.uint,
    start: cython.ulonglong,
    first: cython.ulonglong,
    flow_id: cython.longlong,
    next_seq: cython.ulonglong,
    b0: cython.ulonglong,
    b1: cython.ulonglong,
    b2: cython.ulonglong,
    b3: cython.ulonglong,
    flags: cython.uchar,
) -> None:
    """One ROW (room for row_size(alen) made, alen from _alen(key)): the key, ct_id, start, first seen, flow id,
    next sequence, base totals, flags."""
    o.u8(alen)
    o.be(_uint(key[0] & 0xFFFF, 16), 2)  # the zone's low 16 bits, as the kernel's u16
    o.u8(_uint(key[1], 8))
    o.be(_uint(key[3], 16), 2)
    o.be(_uint(key[5], 16), 2)
    o.raw(key[2])
    o.raw(key[4])
    o.be(ct, 4)
    o.be(start, 8)
    o.be(first, 8)
    o.i64(flow_id)
    o.be(next_seq, 8)
    o.be(b0, 8)
    o.be(b1, 8)
    o.be(b2, 8)
    o.be(b3, 8)
    o.u8(flags)


def _put_row_of(
    o: _Out,
    key: Sequence[Any],
    alen: cython.Py_ssize_t,
    ct: object,
    start: object,
    first: object,
    flow_id: object,
    next_seq: object,
    base: Sequence[object],
    flags: object,
) -> None:
    """One ROW from Python values (room made for it, alen from _alen(key)); ct_id and flags keep their low 32 and
    8 bits."""
    b0, b1, b2, b3 = _four(base)
    _put_row(o, key, alen, _uint(ct & 0xFFFFFFFF, 32), _uint(start, 64), _uint(first, 64),  # type: ignore[operator]
             _int64(flow_id), _uint(next_seq, 64), _uint(b0, 64), _uint(b1, 64), _uint(b2, 64), _uint(b3, 64),
             _uint(flags & 0xFF, 8))  # type: ignore[operator]  # fmt: skip


def _put_message(o: _Out, topic: bytes, key: bytes, value: bytes) -> None:
    """A record's message (room made for it): topic, key and value lengths (16, 16, 32 bits), then their bytes;
    the tail of a snapshot RECORD and of a journal SENT_ROW alike."""
    o.be(_uint(len(topic), 16), 2)
    o.be(_uint(len(key), 16), 2)
    o.be(_uint(len(value), 32), 4)
    o.raw(topic)
    o.raw(key)
    o.raw(value)


@cython.final
@cython.cclass
class _Columns:
    """The store's columns (flow.RowColumns), checked by name: nine arrays of these typecodes, then a
    bytearray. Compiled, held as typed views (the .pxd), so reading a slot's value is one load."""

    def __init__(self, columns: Any) -> None:
        got = []
        for name, code in zip(RowColumns._fields, _COLUMN_CODES, strict=True):
            c = getattr(columns, name, None)
            if code is None:
                if not isinstance(c, bytearray):
                    raise TypeError(f"the {name} column is a bytearray, not {type(c).__name__}")
            elif not isinstance(c, array) or c.typecode != code:
                raise TypeError(f"the {name} column is an array of {code!r}, not {type(c).__name__}")
            got.append(c)
        self.ct, self.start, self.first, self.fid, self.seq, self.bp, self.bb, self.brp, self.brb, self.flags = got
        self.rows = min(len(c) for c in got)


def pack_columns(slots: list[int], keys: Sequence[Any], columns: Any, out: bytearray) -> int:
    """The ROW of every slot, from the store's columns (flow.RowColumns), appended to ``out``; their count."""
    c = _Columns(columns)
    o = _Out(out)
    s: cython.Py_ssize_t
    alen: cython.Py_ssize_t
    # The room for every row at once, as the rows will take it: a snapshot's buffer is the exporter's peak
    # memory, and growing it step by step left the steps behind it (a higher peak RSS in the issue 39 gate).
    need: cython.Py_ssize_t = 0
    for s in slots:
        if s < 0 or s >= c.rows or s >= len(keys):
            raise IndexError(f"slot {s:d} past the columns ({c.rows} rows)")
        need += row_size(_alen(keys[s]))
    o.room(need)
    try:
        for s in slots:
            key = keys[s]
            alen = _alen(key)
            if c.start[s] < 0 or c.first[s] < 0:  # the columns' signed stamps, unsigned in a row
                raise OverflowError(f"a negative time stamp in slot {s:d}")
            _put_row(o, key, alen, c.ct[s], c.start[s], c.first[s], c.fid[s], c.seq[s], c.bp[s], c.bb[s],
                     c.brp[s], c.brb[s], c.flags[s])  # fmt: skip
    finally:
        o.close()
    return len(slots)


def pack_restored(rows: Iterable[Restored], out: bytearray) -> int:
    """Every row (``Restored``: given-up, restored and ended rows the store made) appended to ``out``; the count."""
    o = _Out(out)
    n: cython.Py_ssize_t = 0
    alen: cython.Py_ssize_t
    try:
        for key, ct, start, first, flow_id, next_seq, base, flags in rows:
            alen = _alen(key)
            o.room(row_size(alen))
            _put_row_of(o, key, alen, ct, start, first, flow_id, next_seq, base, flags)
            n += 1
    finally:
        o.close()
    return n


def pack_reported(reported: Iterable[Restored], out: bytearray) -> int:
    """A snapshot's rows: the store's ReportedRows (from its columns, then the rows it made), or any rows."""
    if isinstance(reported, ReportedRows):
        return pack_columns(reported.slots, reported.keys, reported.columns, out) + pack_restored(reported.rest, out)
    return pack_restored(reported, out)


def pack_records(exports: Iterable[Export], out: bytearray) -> int:
    """A snapshot's records in flight, each a RECORD then its topic, key and value bytes; their count."""
    o = _Out(out)
    n: cython.Py_ssize_t = 0
    try:
        for x in exports:
            e: Export = as_export(x)
            topic: bytes = (e.topic or "").encode()
            key = _blob(e.key)
            value = _blob(e.value)
            t0, t1, t2, t3 = _four(e.totals)
            o.room(_RECORD_SIZE + len(topic) + len(key) + len(value))
            o.i64(_int64(e.flow_id))
            o.be(_uint(e.sequence, 64), 8)
            o.be(_uint(t0, 64), 8)
            o.be(_uint(t1, 64), 8)
            o.be(_uint(t2, 64), 8)
            o.be(_uint(t3, 64), 8)
            _put_message(o, topic, key, value)
            n += 1
    finally:
        o.close()
    return n


def journal_sent(exports: Iterable[Export], topics: dict[str | None, bytes]) -> bytearray:
    """The SENT entry's payload for records about to be produced: a count, then a SENT_ROW per first send
    (a resend is journaled already; a record restored from a checkpoint has no connection key) followed by
    its topic, key and value bytes. Empty when there is none. ``topics``: each topic's bytes, kept."""
    out = bytearray(4)
    o = _Out(out)
    n: cython.Py_ssize_t = 0
    alen: cython.Py_ssize_t
    try:
        for x in exports:
            e: Export = as_export(x)
            conn_key = e.conn_key
            if e.attempts or conn_key is None:
                continue
            topic = topics.get(e.topic)
            if topic is None:
                topic = topics[e.topic] = (e.topic or "").encode()
            key = _blob(e.key)
            value = _blob(e.value)
            alen = _alen(conn_key)
            o.room(row_size(alen) + 9 + len(topic) + len(key) + len(value))
            _put_row_of(o, conn_key, alen, e.ct_id, e.start_ns, e.first_seen_ns, e.flow_id, e.sequence + 1, e.totals,
                        (e.flags & _RECORD_FLAGS) | e.row_kind)  # fmt: skip
            o.u8(1 if e.ended else 0)
            _put_message(o, topic, key, value)
            n += 1
    finally:
        o.close()
    if not n:
        return bytearray()
    out[:4] = n.to_bytes(4, "big")
    return out


def journal_acked(exports: Iterable[Export]) -> bytearray:
    """The ACKED entry's payload for settled records (delivered, or given up for good): an ACK each."""
    out = bytearray()
    o = _Out(out)
    try:
        for x in exports:
            e: Export = as_export(x)
            o.room(_ACK_SIZE)
            o.i64(_int64(e.flow_id))
            o.be(_uint(e.sequence, 64), 8)
    finally:
        o.close()
    return out
