# Types of the compiled module (flow_exporter/_native.c); flow_exporter.native.Native is the protocol it meets.
from collections.abc import Callable, Container
from typing import Any

def decode(
    buf: Any, out: list[Any], zones: Container[int] | None, destroyed: list[Any] | None, connection: type, /
) -> tuple[int, int, int, bool, int, bool, int]: ...
def apply_dump(
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
    /,
) -> tuple[int, int, int, bool, int, bool, int]: ...
