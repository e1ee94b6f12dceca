"""One record on its way out: :class:`Export`, frozen when built, encoded once, resent as the same bytes.

Written once (issue 39) in Cython's pure-Python mode. Compiled, ``Export`` is an extension type whose
fields are C struct members (``export.pxd``): the compiled modules that read a record per message
(``checkpoint_rows``, ``deliveries``) load a field in one instruction where an attribute lookup walks the
type's dictionary and a member descriptor; Python code reads the same fields by name. Interpreted, it is
the same class as a plain dataclass.

Why compiled: at 50k records/s the journal and produce loops read about 19 fields of each record; as
attribute lookups on a slots dataclass they were a visible share of the node run's CPU (perf on
``flow-exporter run`` at 250k connections, active 5 s: ``PyMember_GetOne``, ``_PyObject_GenericGetAttrWithDict``
and ``_PyType_Lookup``), what took that issue's journal and delivery ports past the 10% gate (measured:
docs/performance.md#issue-39-gate-export-cclass-250000-connections-active-5s-idle-1h).

The fields stay Python objects (any int, or None where the annotation says so), as the slots dataclass
had them. Compiled, the type takes no part in the cyclic garbage collector (``no_gc``): a record refers to
values and to its connection's fields, and nothing it holds refers back to it, so reference counting frees
it; tracked, the records in flight (up to ``limits.maxInFlight``) were traversed by every young collection
(bench/bench_app_export.py; measured: docs/performance.md#the-compiled-record-path-issue-24-before-and-after).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # Cython's top-level `cython` module has no type information; the shim states the same names
    from flow_exporter import cython_shim as cython
    from flow_exporter.connection import Connection, ConnectionKey
    from flow_exporter.flow import Totals
else:
    try:
        import cython
    except ModuleNotFoundError:  # interpreted without Cython installed
        from flow_exporter import cython_shim as cython

__all__ = ["Export", "as_export"]


@cython.dataclasses.dataclass
@cython.no_gc  # nothing it holds refers back to it (see the module's docstring)
@cython.cclass
class Export:
    """One record: frozen when built, encoded once, resent as the same bytes until delivered.

    It carries what the sink, the encoder and the checkpoint need of its connection, so
    nothing downstream reaches into the store: the store keeps connections in columns,
    not objects (flow_exporter.store.columns). ``slot`` is -1 for a record restored from a checkpoint (a
    previous process built it; only its bytes are left). ``prefix`` is the encoded
    connection-lifetime part of the record (sink.encoder) when the store has it cached;
    otherwise ``conn`` holds the static fields to encode it from, and the store keeps
    the prefix the encoder leaves here once the record is delivered. ``value``, ``topic``
    and ``key`` are set by the sink's first encoding and reused by every resend.
    """

    reason: int
    sequence: int
    totals: Totals
    deltas: Totals
    final: bool
    flow_end_ns: int
    flow_id: int
    first_seen_ns: int = 0
    conn_key: ConnectionKey | None = None
    ct_id: int = 0
    start_ns: int = 0
    flags: int = 0
    ended: bool = False  # the connection is over for good (not a give-up of a live entry): its row can go
    tcp_state: int | None = None
    meta: dict[str, Any] | None = None
    conn: Connection | None = None
    prefix: bytes | None = None
    slot: int = -1
    epoch: int = 0  # the store's prefix-cache stamp of the slot when built
    value: bytes | None = None
    topic: str | None = None
    key: bytes | None = None
    attempts: int = 0
    export_ms: int = 0  # the exportTime written into ``value`` (0: unknown, a record restored from a checkpoint)
    row_kind: int = 0  # ROW_* bits for the checkpoint row this record leaves, when it ends its connection


@cython.ccall  # also a Python function: an interpreted module beside this compiled one calls it
def as_export(x: object) -> Export:
    """``x`` as an :class:`Export`, else TypeError: what a compiled loop checks before it reads a record's fields
    as struct members (an object of another type, or None, has no such members)."""
    if not isinstance(x, Export):
        raise TypeError(f"a record is an Export, not {type(x).__name__}")
    return x
