"""Slot mechanics: every tracked connection's fields in flat columns, indexed by slot number.

Why columns: a Python object per connection, its counters as int objects and a fresh row
object per poll cost more than twice the RSS per connection; columns (``array`` and
``bytearray``) cost a fixed few bytes per field, a poll writes numbers in place and keeps no
object of the dump (bench/bench_poll.py, memory; measured before and after:
docs/performance.md#targets-issue-13-export-memory-first-poll-events-the-whole-node). What is left per
connection is its key tuple (the dict key, interned) and one packed ``bytes`` of static fields (both
flow_exporter/slot_static.py).
Hand-written because no library keeps dict-keyed, growable, mixed-type columns at this cost; numpy would add a large
dependency for a few element reads per row, where it is slower than ``array``.

This layer knows slots and rows only: which connection a slot holds, and what the kernel
said of it. What is done with them (the key index, ending, reporting) is the table's
(:mod:`flow_exporter.store.table`, the one class built on this one).
"""

from __future__ import annotations

import itertools
import socket
from array import array
from typing import Any

from flow_exporter.connection import Connection, ConnectionKey
from flow_exporter.dying import is_dying
from flow_exporter.expiry import ExpiryQueue
from flow_exporter.flow import (
    ZERO,
    Export,
    Totals,
)
from flow_exporter.slot_state import ACTIVE, FINAL_DUE, PRESENT, UNCOUNTED
from flow_exporter.slot_static import STATIC, icmp_bits, intern_key, static_of

_MIN_GROW = 1024


def _static(conn: Connection) -> bytes:
    """The connection's static bytes (flow_exporter/slot_static.py says what they hold)."""
    icmp = icmp_bits(conn.icmp_type, conn.icmp_code, conn.icmp_id)
    return static_of(conn.orig_dst, conn.reply_dst, conn.orig_dport, conn.reply_sport, conn.reply_dport, icmp)


class Columns:
    """The slot columns and their mechanics: allocate, write a row, release, read back."""

    _generation: int  # the current dump's number (the table's; rows it shows are stamped with it)

    def __init__(self) -> None:
        self.queue = ExpiryQueue()  # deadlines per slot
        self._idle: dict[int, None] = {}  # slots of idle connections, oldest first: eviction candidates
        # Slot columns (one element per slot; see the module docstring).
        self._keys: list[ConnectionKey | None] = []  # None: a free slot
        self._static: list[bytes | None] = []
        self._meta: list[dict[str, Any] | None] = []
        self._prefix: list[bytes | None] = []  # the encoder's record prefix, cached while active
        self._pending: list[Export | None] = []  # the record in flight: at most one per connection
        self._labels: dict[int, bytes] = {}  # the few slots whose entry has conntrack labels
        self._ct = array("I")
        self._status = array("I")
        self._mark = array("I")
        self._seen = array("I")  # generation of the last dump that contained it
        self._start = array("q")
        self._first = array("q")  # first-seen stamp (the kernel's start when known)
        self._last_active = array("q")  # the kernel's stop stamp once known, else the last movement seen
        self._fid = array("q")  # connectionId
        self._op = array("Q")  # current totals: packets, bytes, reverse packets, reverse bytes
        self._ob = array("Q")
        self._rp = array("Q")
        self._rb = array("Q")
        self._bp = array("Q")  # base: the totals of the last record built
        self._bb = array("Q")
        self._brp = array("Q")
        self._brb = array("Q")
        self._seq = array("I")  # next sequence
        self._epoch = array("I")  # prefix-cache stamp (wrapping): changes whenever the prefix would
        self._tcp = array("b")  # TCP state, -1 for none
        self._flags = bytearray()
        self._reason = bytearray()  # why it ended for the exporter (0: it has not)
        self._bits = bytearray()
        self._numeric = (
            self._ct, self._status, self._mark, self._seen, self._start, self._first,
            self._last_active, self._fid, self._op, self._ob, self._rp, self._rb, self._bp, self._bb,
            self._brp, self._brb, self._seq, self._epoch, self._tcp,
        )  # fmt: skip
        self._free: list[int] = []
        # The compiled rules' typed views of these columns (flow_exporter/column_views.py), kept while a poll runs:
        # a column that exports a buffer cannot be resized, so _grow drops them first.
        self._views: Any = None
        self._intern: dict[bytes | int, Any] = {}
        self._next_slot = 0
        self._epochs = itertools.count(1)

    # ------------------------------------------------------------------- slots
    def reserve(self, n: int) -> None:
        """Room for ``n`` slots in one step: the poll reserves the table's size (nf_conntrack_count) before a
        dump. A first poll of 1M entries otherwise grew the columns 18 times, to 1.35M slots."""
        if n > len(self._keys):
            self._grow(n - len(self._keys))

    def _grow(self, more: int = 0) -> None:
        self._views = None  # see __init__: the columns cannot be resized while viewed
        n = len(self._keys)
        # The slack is touched memory: keep it small. Growing costs only the new part (large arrays and lists
        # are reallocated in place), so small steps are cheap.
        more = more or max(_MIN_GROW, n // 8)
        for col in self._numeric:
            col.frombytes(bytes(col.itemsize * more))
        for b in (self._flags, self._reason, self._bits):
            b.extend(bytes(more))
        pad: list[Any] = [None] * more
        for lst in (self._keys, self._static, self._meta, self._prefix, self._pending):
            lst.extend(pad)
        self.queue.grow(n + more)

    def _alloc(
        self,
        key: ConnectionKey,
        conn: Connection,
        flow_id: int,
        first_seen: int,
        wall_ns: int,
        flags: int = 0,
        next_seq: int = 0,
        base: Totals = ZERO,
    ) -> int:
        """A slot holding ``conn`` as a new connection (not keyed, not queued).

        A slot comes back from ``_release`` with its sequence, base, reason and flags zero, as
        a fresh one is: only other values are written (the first poll's hot path).
        """
        if self._free:
            s = self._free.pop()
        else:
            s = self._next_slot
            if s == len(self._keys):
                self._grow()
            self._next_slot = s + 1
        self._keys[s] = intern_key(key, self._intern)
        self._static[s] = _static(conn)
        self._fid[s] = flow_id
        self._first[s] = first_seen
        self._last_active[s] = conn.stop_ns or wall_ns
        self._seen[s] = self._generation
        self._bits[s] = PRESENT | ACTIVE if conn.counted else PRESENT | ACTIVE | UNCOUNTED
        if flags:
            self._flags[s] = flags
        if next_seq:
            self._seq[s] = next_seq
        if base is not ZERO:
            self._bp[s], self._bb[s], self._brp[s], self._brb[s] = base
        # The row's fields, as _set_row writes them; a fresh or released slot has no cached prefix.
        self._op[s] = conn.orig_packets
        self._ob[s] = conn.orig_bytes
        self._rp[s] = conn.reply_packets
        self._rb[s] = conn.reply_bytes
        ts = conn.tcp_state
        self._tcp[s] = -1 if ts is None else ts
        self._status[s] = conn.status
        self._start[s] = conn.start_ns
        self._ct[s] = conn.ct_id
        self._mark[s] = conn.mark
        if conn.labels is not None:
            self._labels[s] = conn.labels
        return s

    def _set_row(self, s: int, conn: Connection) -> None:
        """Write a row's changing fields (counters, state, ids) into slot ``s``."""
        self._bits[s] = self._bits[s] & ~UNCOUNTED if conn.counted else self._bits[s] | UNCOUNTED
        self._op[s] = conn.orig_packets
        self._ob[s] = conn.orig_bytes
        self._rp[s] = conn.reply_packets
        self._rb[s] = conn.reply_bytes
        ts = conn.tcp_state
        self._tcp[s] = -1 if ts is None else ts
        self._status[s] = conn.status
        if conn.stop_ns:
            self._last_active[s] = conn.stop_ns
        if conn.start_ns and not self._start[s]:
            self._learn_start(s, conn.start_ns)
        self._start[s] = conn.start_ns
        if self._ct[s] != conn.ct_id or self._mark[s] != conn.mark or self._labels.get(s) != conn.labels:
            self._ct[s] = conn.ct_id
            self._mark[s] = conn.mark
            if conn.labels is None:
                self._labels.pop(s, None)
            else:
                self._labels[s] = conn.labels
            self._invalidate(s)

    def _learn_start(self, s: int, start_ns: int) -> None:
        """The kernel's start stamp of an entry first met in a NEW event (which carries none).

        Before its first record it replaces the first-seen stamp as ``flowStart``, so every
        connectionId of the incarnation (one met again after it was forgotten, too) carries the
        kernel's start, the totals rule's key. After a record, ``flowStart`` stays as sent.
        """
        if self._seq[s] == 0 and start_ns < self._first[s]:
            self._first[s] = start_ns
            self._invalidate(s)

    def _invalidate(self, s: int) -> None:
        """Something the record prefix holds changed: the cached one, and any in flight, are stale."""
        self._prefix[s] = None
        self._epoch[s] = next(self._epochs) & 0xFFFFFFFF

    def _release(self, s: int) -> None:
        self._keys[s] = None
        self._static[s] = None
        self._meta[s] = None
        self._prefix[s] = None
        self._pending[s] = None
        self._labels.pop(s, None)
        self._ct[s] = 0
        self._mark[s] = 0
        self._seq[s] = 0
        self._bp[s] = self._bb[s] = self._brp[s] = self._brb[s] = 0
        self._reason[s] = 0
        self._flags[s] = 0
        self.queue.remove(s)
        self._idle.pop(s, None)
        self._free.append(s)

    def _totals_of(self, s: int) -> Totals:
        return (self._op[s], self._ob[s], self._rp[s], self._rb[s])

    def _base_of(self, s: int) -> Totals:
        return (self._bp[s], self._bb[s], self._brp[s], self._brb[s])

    def _dying(self, s: int) -> bool:
        key = self._keys[s]
        return key is not None and is_dying(key[1], self._tcp[s], self._status[s])

    def _went_down(self, s: int, new: Connection) -> bool:
        return (
            new.orig_bytes < self._ob[s]
            or new.reply_bytes < self._rb[s]
            or new.orig_packets < self._op[s]
            or new.reply_packets < self._rp[s]
        )

    def _settled(self, s: int) -> bool:
        """Ended, reported to the last byte, nothing in flight: safe to forget."""
        return (
            self._reason[s] != 0
            and self._pending[s] is None
            and not self._bits[s] & FINAL_DUE
            and self._seq[s] > 0
            and self._totals_of(s) == self._base_of(s)
        )

    def _view(self, s: int) -> Connection:
        """The connection as a row again (static fields plus the latest counters), to encode a record prefix."""
        key = self._keys[s]
        static = self._static[s]
        assert key is not None and static is not None
        zone, proto, src, sport, dst, _ = key
        n = len(src)
        orig_dport, reply_sport, reply_dport, icmp = STATIC.unpack_from(static, 2 * n)
        ts = self._tcp[s]
        # Positional (the field order of Connection): a keyword call costs twice as much, once per
        # connection's first record.
        return Connection(
            socket.AF_INET if n == 4 else socket.AF_INET6,
            proto,
            src,
            static[:n],
            sport,
            orig_dport,
            dst,
            static[n : 2 * n],
            reply_sport,
            reply_dport,
            zone,
            self._ct[s],
            self._mark[s],
            self._labels.get(s),
            self._status[s],
            None if ts < 0 else ts,
            self._op[s],
            self._ob[s],
            self._rp[s],
            self._rb[s],
            self._start[s],
            0,
            orig_dport >> 8 if icmp & 1 else None,
            orig_dport & 0xFF if icmp & 2 else None,
            sport if icmp & 4 else None,
        )
