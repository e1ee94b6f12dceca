"""The compiled poll path (``flow_exporter/_native.c``, ``_admit.c``, ``_records.c``), when built.

The extension is optional: a build without a C compiler leaves it out, and ``FLOW_EXPORTER_INTERPRETED=1``
turns it off (flow_exporter.compiled makes that choice once). Either way the pure-Python decoder and store
update do the same work (the property tests in ``tests/unit/test_native.py`` hold both to the same
Connections, store state and records), slower.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Container
from typing import Any, Protocol, cast

from flow_exporter import compiled as compiled_build

__all__ = ["Native", "compiled"]

# (decoded, skipped, ignored, done, errno, interrupted, kept): DecodeResult's fields, in order.
NativeResult = tuple[int, int, int, bool, int, bool, int]


class Native(Protocol):
    """What ``flow_exporter._native`` offers (its docstring and ``_native.c`` say what each does)."""

    def apply_dump(
        self,
        buf: Any,
        zones: Container[int] | None,
        connection: type,
        connections: dict[Any, int],
        keys: list[Any],
        labels: dict[int, bytes],
        columns: tuple[Any, ...],
        generation: int,
        ordinal: int,
        slow: Callable[[list[Any]], None],
        zone_counts: dict[int, int],
        admission: Callable[[], list[Any]] | None = None,
    ) -> NativeResult: ...

    def admit_rows(
        self, rows: list[Any], start: int, connection: type, connections: dict[Any, int], admission: list[Any]
    ) -> int: ...  # the index of the first row it left to the caller


_loaded: Native | None = None
if not compiled_build.forced_interpreted() and "deadline_heap" not in compiled_build.NOT_BUILT:  # the C calls it
    try:  # by name: the module's types are the protocol above (no stub to keep in step)
        _loaded = cast(Native, importlib.import_module("flow_exporter._native"))
    except ImportError:  # built without a C compiler: the pure path
        _loaded = None


def compiled(enabled: bool = True) -> Native | None:
    """The compiled module, or None when it is not built or ``enabled`` is false."""
    return _loaded if enabled else None
