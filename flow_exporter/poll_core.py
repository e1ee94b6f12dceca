"""The poll's rules over the store's columns, written once (issue 39): for now, the sweep's scan.

:func:`swept` is the end of a dump: the connections the dump did not show (their seen mark is not this
dump's generation) that were present and not destroyed left the kernel's table. In Cython's pure-Python
mode: compiled, one pass over the key index with typed views of the two columns (the comprehension it
replaces was a large part of a 1M-entry poll as Python; the poll's cost, measured:
docs/performance.md#compiled-poll-path-against-the-pure-one-issue-24); interpreted, the same loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flow_exporter.slot_state import DESTROYED, PRESENT

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

__all__ = ["swept"]

_PRESENT: cython.uchar = PRESENT
_DESTROYED: cython.uchar = DESTROYED


@cython.final
@cython.cclass
class _Marks:
    """The seen mark and state bits of every slot (compiled: typed views), taken once per scan."""

    def __init__(self, seen: Any, bits: Any) -> None:
        self.seen = seen
        self.bits = bits
        self.rows = min(len(seen), len(bits))


@cython.boundscheck(False)
@cython.wraparound(False)
def swept(connections: dict[Any, int], seen: Any, bits: Any, generation: cython.ulonglong) -> list[int]:
    """The slots of ``connections`` (the key index) the dump of ``generation`` did not show that are still
    present and not destroyed, in the index's order; a slot past the columns is an IndexError."""
    m = _Marks(seen, bits)
    out: list[int] = []
    s: cython.Py_ssize_t
    b: cython.uchar
    for slot in connections.values():
        s = slot
        if s < 0 or s >= m.rows:
            raise IndexError(f"slot {s} past the columns ({m.rows} rows)")
        b = m.bits[s]
        if m.seen[s] != generation and b & _PRESENT and not b & _DESTROYED:
            out.append(s)
    return out
