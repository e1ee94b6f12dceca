"""Bits of a store slot's state column (``flow_exporter.store.columns`` keeps the column).

A module of its own, outside the store package, so the compiled rules that read and write the column (the fused
poll, the admission, the sweep, the due loop and the record build) import the bits without importing the store.
"""

from __future__ import annotations

__all__ = ["ACTIVE", "CLOSED", "DESTROYED", "FINAL_DUE", "LAST_ACTIVE", "ORPHAN", "PRESENT", "UNCOUNTED"]

PRESENT = 1  # in the kernel's table, as far as the last dump or event tells
ACTIVE = 2  # cleared once an idle record went out, until the counters move again
DESTROYED = 4  # a DESTROY event gave its final counters: dump rows of it are stale
FINAL_DUE = 8  # a record must still go out for its end
CLOSED = 16  # shutdown: its forced-end record was built
ORPHAN = 32  # out of the keyed table (replaced, reset or given up): settles on its own
LAST_ACTIVE = 64  # its last record was an active-timeout record: its end still owes an end-of-flow record
UNCOUNTED = 128  # its rows carry no counter attributes (created with accounting off)
