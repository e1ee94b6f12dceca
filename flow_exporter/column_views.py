"""The store's columns as typed views, in one object: what the fused poll and the admission read and write.

Making a typed view of a column costs about half a microsecond (a buffer acquired, its format checked); a dump
buffer holds a hundred rows or so, and the fused poll and the admission together read 20 columns, so the views
are made once and the table keeps them (``Table._column_views``) until the columns grow or the poll ends: a
column that exports a buffer cannot be resized, so ``Columns._grow`` drops them first, and so must every caller
before it runs Python that may grow them (the fused poll's hand-over to ``update_batch``, an admission's pause).
Interpreted, the object holds the arrays themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

__all__ = ["ColumnViews"]


@cython.final
@cython.cclass
class ColumnViews:
    """Views of ``table``'s slot columns, its queue's, and the fused poll's dump order (``rows``: the slots every
    column has; ``orders``: the row positions the dump order has)."""

    def __init__(self, table: Any) -> None:
        _heap, queued, q_active, q_idle = table.queue.parts()
        self.seen, self.ct, self.seq, self.status, self.mark = (
            table._seen, table._ct, table._seq, table._status, table._mark
        )  # fmt: skip
        self.start, self.first, self.last_active, self.fid = table._start, table._first, table._last_active, table._fid
        self.bits, self.flags, self.tcp = table._bits, table._flags, table._tcp
        self.op, self.ob, self.rp, self.rb = table._op, table._ob, table._rp, table._rb
        self.queued, self.q_active, self.q_idle = queued, q_active, q_idle
        self.order = table._dump_order
        self.keys, self.static = table._keys, table._static
        self.rows = min(
            len(table._seen), len(table._ct), len(table._seq), len(table._status), len(table._mark),
            len(table._start), len(table._first), len(table._last_active), len(table._fid), len(table._bits),
            len(table._flags), len(table._tcp), len(table._op), len(table._ob), len(table._rp), len(table._rb),
            len(queued), len(q_active), len(q_idle), len(table._keys), len(table._static),
        )  # fmt: skip
        self.orders = len(table._dump_order)
