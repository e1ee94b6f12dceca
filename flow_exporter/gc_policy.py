"""Garbage-collector thresholds for a process that holds a large, long-lived store.

The store keeps several container objects per tracked connection for minutes to hours, and
every record allocates a few short-lived ones. With CPython's default thresholds (700, 10, 10)
the young generations are collected every few hundred records and the cyclic collector keeps
traversing the store: at 100k connections that was a large part of ``store.expire``'s time per
record (bench/bench_app_export.py). Reference counting frees nearly everything here (the store
keeps connections in columns and records hold no cycle), so collecting less often costs little
memory. Bulk work that makes hundreds of thousands of tuples at once (a checkpoint snapshot or
load) pauses the collector: it would only rescan the heap several times and find nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

THRESHOLDS = (50_000, 20, 10)


def tune() -> tuple[int, int, int]:
    """Apply :data:`THRESHOLDS`; returns the previous ones."""
    previous = gc.get_threshold()
    gc.set_threshold(*THRESHOLDS)
    return previous


@contextmanager
def paused() -> Iterator[None]:
    """No cyclic collection inside the block (bulk allocation of acyclic objects)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
