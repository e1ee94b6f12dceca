"""Consistent connection sampling (issue 42): which connections the exporter keeps, decided once, alike on every node.

A connection is kept when a keyed hash of its direction-independent, post-DNAT tuple falls below
``p * 2**64`` (RFC 7014's hash-based flow selection; PSAMP's hash-based filtering, RFC 5475). The tuple is
the record's own ends: the original source address and port, the destination after DNAT (the reply
tuple's source address and port), the protocol and the family; the two ends ordered as Community ID
orders them (address, then port), so a connection seen in either direction hashes alike. ICMP has the
echo identifier on both ends. The zone and the conntrack id are not in it: two nodes that see one
pod-to-pod connection (each in its own table, under its own id) make the same choice when they share
``sampling.seed``, so the cross-node rule (keep the source node's report) still holds on a sample.

The hash is SipHash-2-4 (Aumasson and Bernstein, 2012) keyed by 128 bits derived from the seed: a PRF,
so without the seed nobody can pick tuples that fall outside (or inside) the sample, and its output is
uniform, which the estimator's unbiasedness rests on. Its message is five 64-bit little-endian words
(the two ends' addresses as two words each, then ports, protocol and family), 40 bytes; the tests hold
it to the ``siphash24`` package (a C implementation independent of this one) on those bytes. Written here
because the decision runs on every row of every dump of a sampled node, inside the compiled walk, where a
library would be a Python call per row (a dropped row's whole cost, measured:
docs/performance.md#sampling-deciding-and-a-node-at-p-116).

A dropped connection is never a store row. What deciding needs is to count it once (the markers'
``connectionsObserved``): the sampler remembers the keys it dropped (:class:`DroppedSet`), each marked with
the dump interval it was last met in, so a connection is counted when first met and forgotten one dump
after it is gone. A kept one needs nothing here: the store holds it. The set is written here, not a
Python ``set``: an ``int`` object per key and two sets swapped per dump cost more time and memory per dropped
row than one open-addressing table of 64-bit keys, one probe a row (bench_sampling; the table's cost, measured:
docs/performance.md#sampling-deciding-and-a-node-at-p-116).

Cython's pure-Python mode: compiled, 64-bit C arithmetic; interpreted, the same operations masked.
"""

from __future__ import annotations

import hashlib
from array import array
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterable
from fractions import Fraction
from functools import partial
from typing import TYPE_CHECKING, Any

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, Connection

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

__all__ = ["ASK", "DROP", "KEEP", "DroppedSet", "Sampler", "Schedule", "sampling_key", "threshold_of"]

_M: cython.ulonglong = 0xFFFFFFFFFFFFFFFF
_C0: cython.ulonglong = 0x736F6D6570736575  # SipHash's initial state: "somepseudorandomlygeneratedbytes"
_C1: cython.ulonglong = 0x646F72616E646F6D
_C2: cython.ulonglong = 0x6C7967656E657261
_C3: cython.ulonglong = 0x7465646279746573
_LAST: cython.ulonglong = 40 << 56  # the final block of a 40-byte message: its length in the top byte
_SPREAD: cython.ulonglong = 0x9E3779B97F4A7C15  # spreads the conntrack id over the remembered key's bits


def sampling_key(seed: str) -> tuple[int, int]:
    """SipHash's key (k0, k1) for ``sampling.seed``: the first 16 bytes of BLAKE2b of its UTF-8, as two
    little-endian words (any string is a seed; nodes that share it share the sample)."""
    k = hashlib.blake2b(seed.encode(), digest_size=16).digest()
    return int.from_bytes(k[:8], "little"), int.from_bytes(k[8:], "little")


def threshold_of(probability: float) -> int:
    """The hash bound of ``probability`` (0 < p <= 1): a connection is kept when its hash is below it.
    2**64 for p = 1 (everything, without hashing); otherwise floor(p * 2**64), exact for a float."""
    if not 0 < probability <= 1:
        raise ValueError(f"a sampling probability is in (0, 1], not {probability!r}")
    return int(Fraction(probability) * (1 << 64))


def _be(b: bytes, at: cython.Py_ssize_t, n: cython.Py_ssize_t) -> cython.ulonglong:
    """``n`` bytes of ``b`` from ``at``, big-endian (compiled: indexing a bytes object is a C read)."""
    x: cython.ulonglong = 0
    i: cython.Py_ssize_t
    for i in range(at, at + n):
        x = (x << 8) | b[i]
    return x


def _rotl(x: cython.ulonglong, b: cython.int) -> cython.ulonglong:
    return ((x << b) | (x >> (64 - b))) & _M


_MIN_CAPACITY: cython.Py_ssize_t = 1024
_KEPT: cython.uint = 0x80000000  # a mark's top bit: the key is a connection the sampler kept
_INTERVAL: cython.uint = 0x7FFFFFFF  # the rest: the interval it was last met in
# The sampler's answers for a row (:meth:`Sampler.decide`): dropped, kept, or ask the store (adaptive shedding).
DROP = 0
KEEP = 1
ASK = 2
_DROP: cython.int = DROP
_KEEP: cython.int = KEEP
_ASK: cython.int = ASK


@cython.final
@cython.cclass
class DroppedSet:
    """The keys of the dropped connections met since the last dump's end, or in the dump before it.

    Open addressing, linear probing, 64-bit keys (0 stands for empty: a key of 0 is stored as 1) and the
    interval each was last met in; at most half full. :meth:`dump_done` forgets the keys not met in the
    interval that ends (rehashing the others, and shrinking when they are few).
    """

    def __init__(self) -> None:
        self.count = 0  # keys held
        self.met = 0  # keys met in this interval
        self.interval = 1
        self._alloc(_MIN_CAPACITY)
        self.old_keys = self.keys
        self.old_marks = self.marks

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _slot(self, key: cython.ulonglong) -> cython.Py_ssize_t:
        """The slot holding ``key`` (a key, never 0), or the empty slot where it would go: the one probe."""
        i: cython.Py_ssize_t = cython.cast(cython.Py_ssize_t, key & self.mask)
        while self.keys[i] != 0 and self.keys[i] != key:
            i = (i + 1) & self.mask
        return i

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _met(self, i: cython.Py_ssize_t) -> cython.uint:
        """Slot ``i``'s key met in this interval (counted once per interval); its mark as it was."""
        m: cython.uint = self.marks[i]
        if m & _INTERVAL != self.interval:
            self.marks[i] = (m & _KEPT) | self.interval
            self.met += 1
        return m

    def touch(self, key: cython.ulonglong) -> cython.int:
        """Whether ``key`` is held, marked met now: 0 no, 1 dropped, 2 kept (:meth:`meet` with ``kept``)."""
        i: cython.Py_ssize_t = self._slot(key if key else 1)
        if self.keys[i] == 0:
            return 0
        return 2 if self._met(i) & _KEPT else 1

    def _alloc(self, capacity: cython.Py_ssize_t) -> None:
        self.key_array = array("Q", bytes(8 * capacity))
        self.mark_array = array("I", bytes(4 * capacity))
        self.keys = self.key_array  # (compiled: typed views of them)
        self.marks = self.mark_array
        self.mask = capacity - 1

    def entries(self) -> list[tuple[int, int]]:
        """(key, interval last met) of every key held, sorted (for the tests)."""
        return sorted((self.keys[i], self.marks[i]) for i in range(self.mask + 1) if self.keys[i])

    def _put(self, key: cython.ulonglong, mark: cython.uint) -> None:
        i: cython.Py_ssize_t = self._slot(key)
        self.keys[i] = key
        self.marks[i] = mark
        self.count += 1

    def meet(self, key: cython.ulonglong, kept: cython.bint = False) -> cython.bint:
        """``key`` met now: whether it is new (not met in this interval or the one before). A new key is held as a
        dropped connection's, or (``kept``) as one the sampler kept before the store holds it."""
        if key == 0:
            key = 1
        i: cython.Py_ssize_t = self._slot(key)
        if self.keys[i] == key:
            self._met(i)
            return False
        self._put(key, (_KEPT if kept else 0) | self.interval)
        self.met += 1
        if self.count * 2 > self.mask + 1:
            self._rehash((self.mask + 1) * 2, False)
        return True

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _rehash(self, capacity: cython.Py_ssize_t, met_only: cython.bint) -> None:
        """Into a table of ``capacity`` slots: every key, or (``met_only``) the ones met in this interval."""
        self.old_keys = self.keys
        self.old_marks = self.marks
        n: cython.Py_ssize_t = self.mask + 1
        self._alloc(capacity)
        self.count = 0
        i: cython.Py_ssize_t
        for i in range(n):
            if self.old_keys[i] != 0 and (not met_only or self.old_marks[i] & _INTERVAL == self.interval):
                self._put(self.old_keys[i], self.old_marks[i])
        self.old_keys = self.keys  # the old table goes
        self.old_marks = self.marks

    def dump_done(self) -> None:
        """A dump has ended: the keys not met since the last one ended are forgotten."""
        if self.met < self.count:
            capacity: cython.Py_ssize_t = self.mask + 1
            while capacity > _MIN_CAPACITY and self.met * 4 < capacity:
                capacity //= 2
            self._rehash(capacity, True)
        self.interval = (self.interval + 1) & _INTERVAL or 1
        self.met = 0


class Schedule:
    """The probability new connections are decided at, over time (adaptive shedding; README: Sampling).

    ``base`` (sampling.probability) halved ``level`` times from each change on: a connection is decided at
    the level in force at its first-seen time (the kernel's start when known, else when the exporter first
    met it), which is also what its records say (``samplingProbability``, from the record's ``flowStart``). The
    changes are kept for as long as the process runs (one a ``sampling.adjustInterval`` at most, a few bytes
    each) and in the state directory. Readers in other threads see one tuple, replaced whole.
    """

    def __init__(self, base: float, changes: list[tuple[int, int]] | None = None) -> None:
        threshold_of(base)  # (a probability in (0, 1])
        self.base = base
        self._changes: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        for t, level in changes or ():
            self.change(t, level)

    @property
    def changes(self) -> list[tuple[int, int]]:
        times, levels = self._changes
        return list(zip(times, levels, strict=True))

    @property
    def level(self) -> int:
        """The level new connections are decided at now."""
        levels = self._changes[1]
        return levels[-1] if levels else 0

    @property
    def deepest(self) -> int:
        """The lowest probability any connection may have been decided at (the largest level)."""
        return max(self._changes[1], default=0)

    def level_at(self, t_ns: int) -> int:
        """The level in force at ``t_ns`` (0 before the first change)."""
        times, levels = self._changes
        i = bisect_right(times, t_ns)
        return levels[i - 1] if i else 0

    @property
    def probability(self) -> float:
        """The probability new connections are decided at now."""
        return self.base / (1 << self.level)

    def probability_at(self, t_ns: int) -> float:
        """The probability a connection first seen at ``t_ns`` was decided at: its records' samplingProbability."""
        return self.base / (1 << self.level_at(t_ns))

    def count_levels(self, firsts: Iterable[int]) -> dict[int, int]:
        """How many of the first-seen times ``firsts`` fall in each level (rows by level: the shedder's load)."""
        times, levels = self._changes
        out: dict[int, int] = {}
        for i, n in Counter(map(partial(bisect_right, times), firsts)).items():
            level = levels[i - 1] if i else 0
            out[level] = out.get(level, 0) + n
        return out

    def change(self, t_ns: int, level: int) -> None:
        """From ``t_ns`` on (after every earlier change), new connections are decided at ``level``."""
        times, levels = self._changes
        if level < 0 or self.base / (1 << level) < 2.0**-32:
            raise ValueError(f"sampling level {level} out of range")
        if times and t_ns <= times[-1]:
            raise ValueError(f"a change at {t_ns} is not after the last one ({times[-1]})")
        self._changes = ((*times, t_ns), (*levels, level))


@cython.final
@cython.cclass
class Sampler:
    """The sampling decision for one exporter (``probability`` < 1; at 1 there is no sampler at all).

    ``dropped``: the connections it dropped so far, each counted once (when first met); the store's
    new connectionIds are the ones it kept.
    """

    def __init__(self, probability: float, seed: str, schedule: Schedule | None = None) -> None:
        self.probability = probability
        self.threshold = threshold_of(probability)
        if self.threshold >> 64 and schedule is None:
            raise ValueError("a probability of 1 needs no sampler")
        self._threshold = min(self.threshold, _M)  # (p = 1 with shedding: every hash but the largest is below)
        self.k0, self.k1 = sampling_key(seed)
        self.v0 = self.v1 = self.v2 = self.v3 = 0  # SipHash's state, while a hash runs
        self.dropped = 0
        self.remembered = DroppedSet()  # the dropped connections' keys, each counted once
        self.h = self.key = 0  # the last row's hash, and the key it is remembered by
        self.now_ns = 0  # the time a connection first met now is decided at, when the kernel gives no start
        self.schedule = schedule
        self._deep = self._threshold
        self.every = False
        self.rescheduled()

    def rescheduled(self) -> None:
        """The schedule changed: rows below the deepest level's bound are kept whenever they started."""
        deepest: cython.int = self.schedule.deepest if self.schedule is not None else 0
        self._deep = self._threshold >> deepest
        # p = 1 and never shed: every row is kept, without a hash
        self.every = self.threshold >> 64 != 0 and deepest == 0

    # -- SipHash-2-4 of the five words, on the state held in this object
    def _round(self) -> None:
        self.v0 = (self.v0 + self.v1) & _M
        self.v1 = _rotl(self.v1, 13) ^ self.v0
        self.v0 = _rotl(self.v0, 32)
        self.v2 = (self.v2 + self.v3) & _M
        self.v3 = _rotl(self.v3, 16) ^ self.v2
        self.v0 = (self.v0 + self.v3) & _M
        self.v3 = _rotl(self.v3, 21) ^ self.v0
        self.v2 = (self.v2 + self.v1) & _M
        self.v1 = _rotl(self.v1, 17) ^ self.v2
        self.v2 = _rotl(self.v2, 32)

    def _block(self, m: cython.ulonglong) -> None:
        self.v3 ^= m
        self._round()
        self._round()
        self.v0 ^= m

    def hash_words(
        self,
        w0: cython.ulonglong,
        w1: cython.ulonglong,
        w2: cython.ulonglong,
        w3: cython.ulonglong,
        w4: cython.ulonglong,
    ) -> cython.ulonglong:
        """SipHash-2-4, keyed by the seed, of the 40 bytes the five words are little-endian."""
        self.v0 = self.k0 ^ _C0
        self.v1 = self.k1 ^ _C1
        self.v2 = self.k0 ^ _C2
        self.v3 = self.k1 ^ _C3
        self._block(w0)
        self._block(w1)
        self._block(w2)
        self._block(w3)
        self._block(w4)
        self._block(_LAST)
        self.v2 ^= 0xFF
        self._round()
        self._round()
        self._round()
        self._round()
        h: cython.ulonglong = self.v0 ^ self.v1 ^ self.v2 ^ self.v3
        return h

    def decide(
        self,
        family: cython.uint,
        proto: cython.uint,
        a_hi: cython.ulonglong,
        a_lo: cython.ulonglong,
        sport: cython.ulonglong,
        b_hi: cython.ulonglong,
        b_lo: cython.ulonglong,
        dport: cython.ulonglong,
        ct_id: cython.ulonglong,
    ) -> cython.int:
        """Whether the connection from (a_hi, a_lo):sport to (b_hi, b_lo):dport (post-DNAT) is kept: the rule,
        written once. :data:`KEEP`, :data:`DROP`, or (only while shedding has lowered the probability)
        :data:`ASK`: kept if the store holds it, else :meth:`first_meeting` decides. A dropped one is counted in
        ``dropped`` the first time it is met (``ct_id`` tells a reused tuple's new entry from the old one)."""
        if self.every:
            return _KEEP
        t: cython.ulonglong
        if b_hi < a_hi or (b_hi == a_hi and (b_lo < a_lo or (b_lo == a_lo and dport < sport))):
            t = a_hi
            a_hi = b_hi
            b_hi = t
            t = a_lo
            a_lo = b_lo
            b_lo = t
            t = sport
            sport = dport
            dport = t
        h: cython.ulonglong = self.hash_words(
            a_hi, a_lo, b_hi, b_lo, ((sport & 0xFFFF) << 48) | ((dport & 0xFFFF) << 32) | ((proto & 0xFF) << 8) | family
        )
        self.h = h
        self.key = h ^ ((ct_id * _SPREAD) & _M)
        if h < self._deep:
            return _KEEP
        if h >= self._threshold:  # dropped at every level
            if self.remembered.meet(self.key):
                self.dropped += 1
            return _DROP
        return _ASK

    def first_meeting(self, start_ns: cython.longlong) -> cython.bint:
        """After :data:`ASK` for a row the store does not hold: decided before (remembered), or now, at the level
        of its first-seen time (the kernel's ``start_ns``, else ``now_ns``), and remembered either way until the
        store holds it (a NEW event's and the DESTROY's or dump row's answers must agree)."""
        seen: cython.int = self.remembered.touch(self.key)
        if seen:
            return seen == 2
        assert self.schedule is not None
        level: cython.int = self.schedule.level_at(start_ns if start_ns else self.now_ns)
        kept: cython.bint = self.h < (self._threshold >> level)
        self.remembered.meet(self.key, kept)
        if not kept:
            self.dropped += 1
        return kept

    def keeps(self, conn: Connection, held: object = None) -> cython.bint:
        """:meth:`decide` for a Connection (the store's rows that are not the fused poll's). ``held``: the
        store's table (:meth:`select`'s), which an :data:`ASK` is answered from."""
        v: cython.int = self._decide_connection(conn)
        if v != _ASK:
            return v == _KEEP
        if held is not None and held.holds(conn.key, conn.ct_id):  # type: ignore[attr-defined]
            return True
        return self.first_meeting(conn.start_ns)

    def _decide_connection(self, conn: Connection) -> cython.int:
        src: bytes = conn.orig_src
        dst: bytes = conn.reply_src  # the destination after DNAT
        proto: cython.uint = conn.proto
        sport: cython.ulonglong = conn.orig_sport or 0
        # the destination's port after DNAT; ICMP: the echo identifier on both ends
        dport: cython.ulonglong = sport if proto in (PROTO_ICMP, PROTO_ICMPV6) else conn.reply_sport or 0
        n: cython.Py_ssize_t = len(src)
        if n == 4 and len(dst) == 4:
            return self.decide(4, proto, 0, _be(src, 0, 4), sport, 0, _be(dst, 0, 4), dport, conn.ct_id)
        if n != 16 or len(dst) != 16:
            return _KEEP  # not an address the hash covers: the store's own checks say what is wrong
        return self.decide(
            6, proto, _be(src, 0, 8), _be(src, 8, 8), sport, _be(dst, 0, 8), _be(dst, 8, 8), dport, conn.ct_id
        )

    def select(self, rows: list[Any], held: object = None) -> list[Any]:
        """The rows of ``rows`` (Connections) that are kept, in order (``held``: as :meth:`keeps`)."""
        out: list[Any] = []
        for conn in rows:
            if type(conn) is not Connection or self.keeps(conn, held):
                out.append(conn)  # (not a Connection: the store's checks refuse it, as unsampled)
        return out

    def dump_done(self) -> None:
        """A full dump has been read: what it did not show of the dropped connections is forgotten."""
        self.remembered.dump_done()
