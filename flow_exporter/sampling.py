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
it to the ``siphash24`` package (the reference C code) on those bytes. Written here because the decision
runs on every row of every dump of a sampled node: compiled it is a few tens of ns, a Python call to
any library several hundred (BENCHMARKS.md, "Sampling").

A dropped connection is never a store row. What deciding needs is to count it once (the markers'
``connectionsObserved``): the sampler remembers the keys it dropped (:class:`DroppedSet`), each marked with
the dump interval it was last met in, so a connection is counted when first met and forgotten one dump
after it is gone. A kept one needs nothing here: the store holds it. The set is written here, not a
Python ``set``: with one ``int`` per key and two sets swapped per dump, a dropped row cost 655 ns a poll
and 155 bytes; one open-addressing table of 64-bit keys is one probe, ~300 ns and ~35 bytes (bench_sampling).

Cython's pure-Python mode: compiled, 64-bit C arithmetic; interpreted, the same operations masked.
"""

from __future__ import annotations

import hashlib
from array import array
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from flow_exporter.connection import PROTO_ICMP, PROTO_ICMPV6, Connection

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

__all__ = ["DroppedSet", "Sampler", "sampling_key", "threshold_of", "tuple_words"]

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


def tuple_words(family: int, proto: int, src: bytes, sport: int, dst: bytes, dport: int) -> tuple[int, ...]:
    """The five message words of a connection from ``src``:``sport`` to ``dst``:``dport`` (post-DNAT), as
    :class:`Sampler` hashes them (for the tests and the benchmark; the sampler builds them in place)."""
    a_hi, a_lo = _address_words(src)
    b_hi, b_lo = _address_words(dst)
    if (b_hi, b_lo, dport) < (a_hi, a_lo, sport):
        a_hi, a_lo, sport, b_hi, b_lo, dport = b_hi, b_lo, dport, a_hi, a_lo, sport
    return a_hi, a_lo, b_hi, b_lo, (sport << 48) | (dport << 32) | (proto << 8) | family


def _address_words(a: bytes) -> tuple[int, int]:
    """A packed address as (high, low) words, big-endian: an IPv4 address is the low word's low 32 bits."""
    if len(a) == 4:
        return 0, int.from_bytes(a, "big")
    return int.from_bytes(a[:8], "big"), int.from_bytes(a[8:16], "big")


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

    def _alloc(self, capacity: cython.Py_ssize_t) -> None:
        self.key_array = array("Q", bytes(8 * capacity))
        self.mark_array = array("I", bytes(4 * capacity))
        self.keys = self.key_array  # (compiled: typed views of them)
        self.marks = self.mark_array
        self.mask = capacity - 1

    def __len__(self) -> int:
        return self.count

    def entries(self) -> list[tuple[int, int]]:
        """(key, interval last met) of every key held, sorted (for the tests)."""
        return sorted((self.keys[i], self.marks[i]) for i in range(self.mask + 1) if self.keys[i])

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _put(self, key: cython.ulonglong, mark: cython.uint) -> None:
        i: cython.Py_ssize_t = cython.cast(cython.Py_ssize_t, key & self.mask)
        while self.keys[i] != 0:
            i = (i + 1) & self.mask
        self.keys[i] = key
        self.marks[i] = mark
        self.count += 1

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def meet(self, key: cython.ulonglong) -> cython.bint:
        """``key`` met now: whether it is new (not met in this interval or the one before)."""
        if key == 0:
            key = 1
        i: cython.Py_ssize_t = cython.cast(cython.Py_ssize_t, key & self.mask)
        k: cython.ulonglong
        while True:
            k = self.keys[i]
            if k == key:
                if self.marks[i] != self.interval:
                    self.marks[i] = self.interval
                    self.met += 1
                return False
            if k == 0:
                self.keys[i] = key
                self.marks[i] = self.interval
                self.count += 1
                self.met += 1
                if self.count * 2 > self.mask + 1:
                    self._rehash((self.mask + 1) * 2, False)
                return True
            i = (i + 1) & self.mask

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
            if self.old_keys[i] != 0 and (not met_only or self.old_marks[i] == self.interval):
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
        self.interval += 1
        self.met = 0


@cython.final
@cython.cclass
class Sampler:
    """The sampling decision for one exporter (``probability`` < 1; at 1 there is no sampler at all).

    ``dropped``: the connections it dropped so far, each counted once (when first met); the store's
    new connectionIds are the ones it kept.
    """

    def __init__(self, probability: float, seed: str) -> None:
        self.probability = probability
        self.threshold = threshold_of(probability)
        if self.threshold >> 64:
            raise ValueError("a probability of 1 needs no sampler")
        self._threshold = self.threshold
        self.k0, self.k1 = sampling_key(seed)
        self.v0 = self.v1 = self.v2 = self.v3 = 0  # SipHash's state, while a hash runs
        self.dropped = 0
        self.remembered = DroppedSet()  # the dropped connections' keys, each counted once

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
    ) -> cython.bint:
        """Whether the connection from (a_hi, a_lo):sport to (b_hi, b_lo):dport (post-DNAT) is kept: the rule,
        written once. A dropped one is counted in ``dropped`` the first time it is met (``ct_id`` tells a
        reused tuple's new entry from the old one)."""
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
        if h < self._threshold:
            return True
        if self.remembered.meet(h ^ ((ct_id * _SPREAD) & _M)):
            self.dropped += 1
        return False

    def keeps(self, conn: Connection) -> cython.bint:
        """:meth:`decide` for a Connection (the store's rows that are not the fused poll's)."""
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
            return True  # not an address the hash covers: the store's own checks say what is wrong
        return self.decide(
            6, proto, _be(src, 0, 8), _be(src, 8, 8), sport, _be(dst, 0, 8), _be(dst, 8, 8), dport, conn.ct_id
        )

    def select(self, rows: list[Any]) -> list[Any]:
        """The rows of ``rows`` (Connections) that are kept, in order."""
        out: list[Any] = []
        for conn in rows:
            if type(conn) is not Connection or self.keeps(conn):
                out.append(conn)  # (not a Connection: the store's checks refuse it, as unsampled)
        return out

    def dump_done(self) -> None:
        """A full dump has been read: what it did not show of the dropped connections is forgotten."""
        self.remembered.dump_done()
