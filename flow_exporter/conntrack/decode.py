"""ctnetlink conntrack messages decoded into `Connection` objects, a recv() buffer at a time.

The walk itself is ``flow_exporter/ctnetlink.py``, written once (Cython's pure-Python mode: compiled
where built, interpreted elsewhere; ``flow_exporter.compiled`` chooses), which says why it is written
by hand. It never raises on garbage: a message with truncated or out-of-bounds lengths, a missing
tuple, or addresses not matching the nfgenmsg family is skipped and counted.

Field conventions (see `flow_exporter.connection.Connection`):

* `zone` is CTA_ZONE, else the CTA_TUPLE_ZONE of the original (then reply) tuple
  (directional zones), else 0. The kernel omits zone 0.
* `labels` is the raw CTA_LABELS payload (16 bytes from the kernel: its `unsigned long`
  bitmap, so on little-endian hosts `int.from_bytes(labels, "little")` is the integer
  pyroute2 reports). None when the attribute is absent *or all zero* (pyroute2 reports
  None and 0 respectively); the kernel never sends all-zero labels, so "no labels" has a
  single representation.
* `tcp_state` is CTA_PROTOINFO_TCP_STATE, None for entries without TCP protoinfo.
* Counters: 64-bit CTA_COUNTERS_* preferred, the 32-bit CTA_COUNTERS32_* otherwise, 0
  when absent (nf_conntrack_acct off). Timestamps: 0 when absent.
* ICMP/ICMPv6 (by protocol number 1/58, using the attributes of that protocol): sport
  is the id, dport is type << 8 | code, missing attributes count as 0; `icmp_*` repeat
  the original tuple's values and are None for other protocols.
* When an attribute occurs twice, the first occurrence wins (like pyroute2's get_attr).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from flow_exporter import compiled as compiled_build
from flow_exporter import ctnetlink as _ctnetlink
from flow_exporter.connection import Connection
from flow_exporter.ctnetlink import CT_DELETE, CT_NEW, NLMSG_DONE, NLMSG_ERROR
from flow_exporter.ports import DecodeResult

__all__ = [
    "CT_DELETE",
    "CT_NEW",
    "NLMSG_DONE",
    "NLMSG_ERROR",
    "DecodeResult",
    "Decoder",
    "decode_batch",
]


class Decoder:
    """Decodes recv() buffers of ctnetlink messages (``flow_exporter.ctnetlink``).

    ``compiled=False`` (a test seam, as the store's): the interpreted build of the same source, loaded beside
    the compiled one, so the lockstep tests hold the two builds to the same Connections.
    """

    def __init__(self, compiled: bool = True) -> None:
        self._walk: Any = _ctnetlink if compiled else compiled_build.reference("ctnetlink")

    def decode_batch(
        self,
        buf: bytes | bytearray | memoryview,
        out: list[Connection],
        zones: Container[int] | None = None,
        destroyed: list[Connection] | None = None,
    ) -> DecodeResult:
        """Appends a Connection per IPCTNL_MSG_CT_NEW/DELETE message of `buf` to `out`.

        `zones`: keep only entries in these zones. `destroyed`: if given, entries of DELETE
        messages (destroy events) go there instead of `out`. Never raises on bad input.
        """
        mv = memoryview(buf)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        return DecodeResult(*self._walk.decode(mv, out, zones, destroyed))


_default = Decoder()


def decode_batch(
    buf: bytes | bytearray | memoryview,
    out: list[Connection],
    zones: Container[int] | None = None,
    destroyed: list[Connection] | None = None,
) -> DecodeResult:
    """`Decoder.decode_batch` on a process-wide decoder."""
    return _default.decode_batch(buf, out, zones, destroyed)
