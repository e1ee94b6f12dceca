"""What a store slot keeps of a connection besides its columns, written once (issue 39): its key, interned, and its
static bytes.

* The key (``Connection.key``) shares its addresses and destination port with other connections' keys (a node's
  pods talk to a few peers and Services): one object per distinct value, not one per connection (the store's
  memory per connection, measured: docs/performance.md#targets-issue-13-export-memory-first-poll-events-the-whole-node).
  Source ports are not shared: ephemeral, nearly one per connection, they only churned the table. The table is
  dropped when it grows past :data:`INTERN_MAX`, so a scan of many addresses cannot grow it.
* The static bytes are the two destination addresses, then :data:`STATIC` ("!HHHB": orig_dport, reply_sport,
  reply_dport, and which ICMP fields the kernel gave: 1 type, 2 code, 4 id).

The store's Python path (``flow_exporter.store.columns``) and its compiled admission (``admission.py``) both use
these. Cython's pure-Python mode: compiled, the static bytes are written straight into a new bytes object.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython
if cython.compiled:
    from cython.cimports.cpython.bytes import (  # type: ignore[import-untyped,import-not-found,unused-ignore]
        PyBytes_AS_STRING,
        PyBytes_FromStringAndSize,
    )
    from cython.cimports.libc.string import memcpy  # type: ignore[import-untyped,import-not-found,unused-ignore]

__all__ = ["INTERN_MAX", "STATIC", "icmp_bits", "intern_key", "static_of"]

STATIC = struct.Struct("!HHHB")
INTERN_MAX = 1 << 17
_INTERN_MAX: cython.Py_ssize_t = INTERN_MAX


def intern_key(key: tuple[Any, ...], intern: dict[Any, Any]) -> tuple[Any, ...]:
    """``key`` with its addresses and destination port the ones ``intern`` holds (put there if new): ``key``
    itself when they already were. Compiled, the key is left untracked by the cyclic collector."""
    if len(intern) > _INTERN_MAX:
        intern.clear()
    zone, proto, src, sport, dst, dport = key
    isrc = intern.setdefault(src, src)
    idst = intern.setdefault(dst, dst)
    idport = intern.setdefault(dport, dport)
    out = key if isrc is src and idst is dst and idport is dport else (zone, proto, isrc, sport, idst, idport)
    if cython.compiled:  # ints and bytes form no cycle: a million keys the collector need not walk (interpreted,
        # the collector untracks such a tuple at its first pass over it); declared in slot_static.pxd
        PyObject_GC_UnTrack(out)  # type: ignore[name-defined]  # noqa: F821
    return out


def icmp_bits(icmp_type: object, icmp_code: object, icmp_id: object) -> cython.uchar:
    """The static bytes' last byte: which of a connection's ICMP fields the kernel gave (1 type, 2 code, 4 id)."""
    return (1 if icmp_type is not None else 0) | (2 if icmp_code is not None else 0) | (4 if icmp_id is not None else 0)


def static_of(
    orig_dst: bytes,
    reply_dst: bytes,
    orig_dport: cython.uint,
    reply_sport: cython.uint,
    reply_dport: cython.uint,
    icmp: cython.uchar,
) -> bytes:
    """The static bytes of a connection (a port outside 16 bits is an OverflowError, in both builds)."""
    if not (0 <= orig_dport <= 0xFFFF and 0 <= reply_sport <= 0xFFFF and 0 <= reply_dport <= 0xFFFF):
        raise OverflowError("a port outside 16 bits")
    if not cython.compiled:
        return orig_dst + reply_dst + STATIC.pack(orig_dport, reply_sport, reply_dport, icmp)
    a: cython.Py_ssize_t = len(orig_dst)
    b: cython.Py_ssize_t = len(reply_dst)
    out: bytes = PyBytes_FromStringAndSize(cython.NULL, a + b + 7)
    p: cython.p_uchar = cython.cast(cython.p_uchar, PyBytes_AS_STRING(out))
    memcpy(p, cython.cast(cython.p_const_char, orig_dst), a)
    memcpy(cython.address(p[a]), cython.cast(cython.p_const_char, reply_dst), b)
    t: cython.Py_ssize_t = a + b
    p[t] = orig_dport >> 8
    p[t + 1] = orig_dport & 0xFF
    p[t + 2] = reply_sport >> 8
    p[t + 3] = reply_sport & 0xFF
    p[t + 4] = reply_dport >> 8
    p[t + 5] = reply_dport & 0xFF
    p[t + 6] = icmp
    return out
