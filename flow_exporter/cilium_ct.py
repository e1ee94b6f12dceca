"""Cilium's connection-tracking entries as Connections (issue 41): the Cilium source's decode, written once.

The netfilter source turns ctnetlink messages into :class:`~flow_exporter.connection.Connection` values
(``ctnetlink``); this module does the same for the key/value bytes of Cilium's global CT maps, as
:class:`flow_exporter.cilium.bpf_maps.PinnedMap` reads them in batches. The store applies both the same
way (``Table.update_batch``), so identity, sequences, the cap, the state directory and the end rule are
the netfilter source's, not a second copy. What each Cilium field becomes is the README's table
("Clusters running Cilium"); the layouts are Cilium's ``bpf/lib/common.h`` and ``bpf/lib/conntrack.h``:

* key (``ipv4_ct_tuple``/``ipv6_ct_tuple``, packed): daddr, saddr, dport, sport (big-endian), nexthdr,
  flags. The addresses are named for the reply direction and the ports for the original one, so for an
  ``OUT`` or ``IN`` entry the connection's originator is (daddr, sport) and its responder (saddr, dport);
  a ``SERVICE`` entry is the client's packet before the load balancer: client (saddr, dport), service
  (daddr, sport). That is how Cilium's own lister (``cilium-dbg bpf ct list global``) prints them.
* value (``ct_entry``, 56 bytes): the counters in the first 32 bytes, in one of two layouts of the same
  size (:data:`SPLIT` before Cilium 1.16, :data:`COMBINED` since); then ``lifetime`` (u32), the flag
  bits (u16: rx_closing, tx_closing, ...), ``rev_nat_index`` (u16), ... The maps carry no BTF, so the
  layout is a setting (``cilium.counters``). Values are in the host's byte order: little-endian on both
  architectures the image is built for.

One connection per ``OUT`` entry, or per ``IN`` entry with no ``OUT`` twin (the same tuple seen at both
ends of a pod-to-pod connection on one node: the ``OUT`` one is kept, always the same one, so its
counters never seem to go back); ``RELATED`` entries (ICMP errors riding on a connection) are skipped;
``SERVICE`` entries give a connection through a service its original destination: an entry's reverse-NAT
index names the service frontend (the key of Cilium's reverse-NAT map, which holds the frontend's address
and port), so any ``SERVICE`` entry of the read with the connection's index, family and protocol gives its
address and port. A connection whose index no ``SERVICE`` entry has shown yet is held until the whole read
is done (:meth:`CtDecoder.joined`): the maps are hashes, the service entries may come after it. Only those
are held: a service's first client entry read names it for every later one (holding every connection
through a service until the end of a 1M-entry read would keep most of them in memory at once).

Cython's pure-Python mode: compiled, the buffers are typed views and each field one load; interpreted,
the same code.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from flow_exporter.connection import IPS_DYING, Connection

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:  # the IN twin's lookup, made in C (CtDecoder._has_twin)
    from cython.cimports.libc.errno import ENOENT, errno  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["COMBINED", "SPLIT", "TUPLE_F_IN", "TUPLE_F_OUT", "TUPLE_F_RELATED", "TUPLE_F_SERVICE", "CtDecoder"]

SPLIT = 0
"""Cilium 1.15 and earlier: rx_packets, rx_bytes, tx_packets, tx_bytes (the endpoint's receive and send)."""
COMBINED = 1
"""Cilium 1.16 and later: 16 bytes of NAT address or service backend, then one packets and one bytes counter
for both directions together."""

# The key's flags byte (Cilium's TUPLE_F_*).
TUPLE_F_OUT = 0
TUPLE_F_IN = 1
TUPLE_F_RELATED = 2
TUPLE_F_SERVICE = 4

# The value's flag bits (ct_entry: rx_closing, tx_closing, ...).
_RX_CLOSING: cython.uint = 1
_TX_CLOSING: cython.uint = 2

_VALUE_SIZE: cython.Py_ssize_t = 56
_LIFETIME: cython.Py_ssize_t = 32
_FLAGS: cython.Py_ssize_t = 36
_REV_NAT: cython.Py_ssize_t = 38
_DYING: cython.uint = IPS_DYING
_AF_INET: cython.int = 2
_AF_INET6: cython.int = 10
_ICMP: cython.int = 1
_ICMPV6: cython.int = 58


@cython.boundscheck(False)
@cython.wraparound(False)
def _u16be(b: _Bytes, at: cython.Py_ssize_t) -> cython.uint:
    return (b.v[at] << 8) | b.v[at + 1]


@cython.boundscheck(False)
@cython.wraparound(False)
def _u16le(b: _Bytes, at: cython.Py_ssize_t) -> cython.uint:
    return (b.v[at + 1] << 8) | b.v[at]


@cython.boundscheck(False)
@cython.wraparound(False)
def _ule(b: _Bytes, at: cython.Py_ssize_t, size: cython.int) -> cython.ulonglong:
    """``size`` bytes at ``at``, little-endian."""
    x: cython.ulonglong = 0
    i: cython.int
    for i in range(size - 1, -1, -1):
        x = (x << 8) | b.v[at + i]
    return x


def _through(conn: Connection, address: bytes, port: object) -> None:
    """The service frontend as the connection's original destination (an ICMP connection's destination port is its
    type and code, part of its key: only the address)."""
    conn.orig_dst = address
    if conn.proto != _ICMP and conn.proto != _ICMPV6:
        conn.orig_dport = port  # type: ignore[assignment]  # an int: the frontend's port (object for the C signature)


@cython.final
@cython.cclass
class _Bytes:
    """A batch's key or value bytes (compiled: a typed view, each byte one load)."""

    def __init__(self, data: bytes) -> None:
        self.v = data


@cython.cclass
class CtDecoder:
    """One read of the maps: ``decode`` each batch, then ``joined`` once, for the connections held back.

    ``layout``: :data:`SPLIT` or :data:`COMBINED`. ``now``: the BPF clock now, in Cilium's lifetime unit
    (seconds of CLOCK_MONOTONIC), or -1 when lifetimes are not compared (Cilium's jiffies clock): an entry
    past its lifetime waits for Cilium's garbage collection, and is over for the exporter already.
    """

    layout: cython.int
    now: cython.longlong
    services: dict[tuple[int, int, int], tuple[bytes, int]]  # (family, protocol, rev_nat_index) -> frontend
    held: list[tuple[tuple[int, int, int], Connection]]
    entries: cython.Py_ssize_t  # every entry read
    related: cython.Py_ssize_t
    service_entries: cython.Py_ssize_t
    twins: cython.Py_ssize_t  # IN entries whose OUT twin was read as the connection
    empty: cython.Py_ssize_t  # keys with no protocol (Cilium's lister skips them too)

    def __init__(self, layout: int, now: int, contains: Callable[[int, bytes], bool]) -> None:
        if layout not in (SPLIT, COMBINED):
            raise ValueError(f"CtDecoder: layout {layout} is neither SPLIT nor COMBINED")
        self.layout = layout
        self.now = now
        # Whether the map open as fd holds a key (flow_exporter.cilium.bpf_maps.map_contains): the interpreted
        # build's lookup. The compiled one makes the same bpf(2) call itself, without ctypes' cost per call (the
        # read's cost per entry, measured:
        # docs/performance.md#the-cilium-source-reading-1000000-entries-of-ciliums-ct-maps).
        self.contains = contains
        self._twin = bytearray(40)  # the compiled lookup's key, answer and bpf_attr (map_fd, pad, key, value, flags)
        self._value = bytearray(_VALUE_SIZE)
        self._attr = array("Q", bytes(32))
        self.services = {}
        self.held = []
        self.entries = self.related = self.service_entries = self.twins = self.empty = 0

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def decode(
        self, count: cython.Py_ssize_t, keys: bytes, values: bytes, key_size: cython.Py_ssize_t, fd: cython.int,
    ) -> list[Connection]:  # fmt: skip
        """The connections of one batch (``count`` keys of ``key_size`` bytes and their values, back to back) of
        the map open as ``fd`` (asked whether an ``IN`` entry's ``OUT`` twin is there). Connections through a
        service no ``SERVICE`` entry has named yet are held for :meth:`joined`."""
        if key_size not in (14, 38):
            raise ValueError(f"CtDecoder: a key of {key_size} bytes is neither IPv4 (14) nor IPv6 (38)")
        if len(keys) < count * key_size or len(values) < count * _VALUE_SIZE:
            raise ValueError(f"CtDecoder: {count} entries do not fit {len(keys)} key and {len(values)} value bytes")
        alen: cython.Py_ssize_t = 4 if key_size == 14 else 16
        family: cython.int = _AF_INET if alen == 4 else _AF_INET6
        out: list[Connection] = []
        kb = _Bytes(keys)
        vb = _Bytes(values)
        i: cython.Py_ssize_t
        k: cython.Py_ssize_t
        v: cython.Py_ssize_t
        proto: cython.int
        flags: cython.int
        rev_nat: cython.uint
        for i in range(count):
            k = i * key_size
            v = i * _VALUE_SIZE
            self.entries += 1
            proto = kb.v[k + 2 * alen + 4]
            flags = kb.v[k + 2 * alen + 5]
            if proto == 0:
                self.empty += 1
                continue
            if flags & TUPLE_F_RELATED:
                self.related += 1
                continue
            rev_nat = _u16le(vb, v + _REV_NAT)
            if flags & TUPLE_F_SERVICE:
                self.service_entries += 1
                # client (saddr, dport) -> service (daddr, sport): the frontend its index names
                if rev_nat and (family, proto, rev_nat) not in self.services:
                    self.services[(family, proto, rev_nat)] = (keys[k : k + alen], _u16be(kb, k + 2 * alen + 2))
                continue
            if flags & TUPLE_F_IN and self._has_twin(fd, kb, keys, k, key_size):
                self.twins += 1
                continue
            conn = self._connection(kb, vb, keys, k, v, alen, family, proto, flags)
            if rev_nat:
                frontend = self.services.get((family, proto, rev_nat))
                if frontend is None:
                    self.held.append(((family, proto, rev_nat), conn))
                    continue
                _through(conn, frontend[0], frontend[1])
            out.append(conn)
        return out

    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _has_twin(
        self, fd: cython.int, kb: _Bytes, keys: bytes, k: cython.Py_ssize_t, key_size: cython.Py_ssize_t
    ) -> cython.bint:
        """Whether the map holds this ``IN`` entry's ``OUT`` twin: the same key, flags byte 0 (``BPF_MAP_LOOKUP_ELEM``,
        which from a system call leaves an LRU map's recency alone)."""
        if not cython.compiled:
            return bool(self.contains(fd, keys[k : k + key_size - 1] + b"\x00"))
        # Declared in cilium_ct.pxd: bpf(2) through libc's syscall(); attr: map_fd, pad, key, value, flags.
        twin = self._twin
        attr = self._attr
        i: cython.Py_ssize_t
        for i in range(key_size - 1):
            twin[i] = kb.v[k + i]
        twin[key_size - 1] = 0
        attr[0] = fd
        attr[1] = cython.cast(cython.Py_ssize_t, cython.address(twin[0]))
        attr[2] = cython.cast(cython.Py_ssize_t, cython.address(self._value[0]))
        attr[3] = 0
        r: cython.long = syscall(SYS_bpf, 1, cython.address(attr[0]), 32)  # type: ignore[name-defined]  # noqa: F821
        if r == 0:
            return True
        if errno == ENOENT:
            return False
        return bool(self.contains(fd, keys[k : k + key_size - 1] + b"\x00"))  # the same call, to raise its error

    def joined(self) -> list[Connection]:
        """The connections held back, each with its service's address and port as its original destination
        where the read found its ``SERVICE`` entry; the decoder is empty after."""
        services = self.services
        held = self.held
        out: list[Connection] = []
        for join, conn in held:
            frontend = services.get(join)
            if frontend is not None:
                _through(conn, frontend[0], frontend[1])
            out.append(conn)
        self.held = []
        self.services = {}
        return out

    def _connection(
        self, kb: _Bytes, vb: _Bytes, keys: bytes, k: cython.Py_ssize_t,
        v: cython.Py_ssize_t, alen: cython.Py_ssize_t, family: cython.int, proto: cython.int, flags: cython.int,
    ) -> Connection:  # fmt: skip
        c: Connection = Connection.__new__(Connection)
        originator = keys[k : k + alen]  # daddr
        responder = keys[k + alen : k + 2 * alen]  # saddr
        rport: cython.uint = _u16be(kb, k + 2 * alen)  # dport
        oport: cython.uint = _u16be(kb, k + 2 * alen + 2)  # sport
        c.family = family
        c.proto = proto
        c.orig_src = originator
        c.orig_dst = responder
        c.reply_src = responder
        c.reply_dst = originator
        if proto in (_ICMP, _ICMPV6):
            # An echo: the request's identifier in the sport slot (Cilium keeps no other ICMP as a connection's
            # own entry; errors are RELATED). Keyed as the netfilter source keys ICMP: type << 8 | code.
            request: cython.int = 8 if proto == _ICMP else 128
            c.orig_sport = oport
            c.orig_dport = request << 8
            c.reply_sport = oport
            c.reply_dport = 0 if proto == _ICMP else 129 << 8
            c.icmp_type = request
            c.icmp_code = 0
            c.icmp_id = oport
        else:
            c.orig_sport = oport
            c.orig_dport = rport
            c.reply_sport = rport
            c.reply_dport = oport
            c.icmp_type = c.icmp_code = c.icmp_id = None
        c.zone = 0
        c.ct_id = 0
        c.mark = 0
        c.labels = None
        op: cython.ulonglong
        ob: cython.ulonglong
        rp: cython.ulonglong
        rb: cython.ulonglong
        if self.layout == COMBINED:
            op, ob, rp, rb = _ule(vb, v + 16, 8), _ule(vb, v + 24, 8), 0, 0
        elif flags & TUPLE_F_IN:  # the endpoint received the originator's packets
            op, ob, rp, rb = _ule(vb, v, 8), _ule(vb, v + 8, 8), _ule(vb, v + 16, 8), _ule(vb, v + 24, 8)
        else:  # OUT: the endpoint sent them
            op, ob, rp, rb = _ule(vb, v + 16, 8), _ule(vb, v + 24, 8), _ule(vb, v, 8), _ule(vb, v + 8, 8)
        c.orig_packets = op
        c.orig_bytes = ob
        c.reply_packets = rp
        c.reply_bytes = rb
        # With accounting on, Cilium counts the packet that creates an entry: all zero means not counted.
        c.counted = (op | ob | rp | rb) != 0
        closing: cython.bint = (_u16le(vb, v + _FLAGS) & (_RX_CLOSING | _TX_CLOSING)) != 0
        expired: cython.bint = self.now >= 0 and cython.cast(cython.longlong, _ule(vb, v + _LIFETIME, 4)) < self.now
        c.status = _DYING if closing or expired else 0
        c.tcp_state = None
        c.start_ns = 0
        c.stop_ns = 0
        return c
