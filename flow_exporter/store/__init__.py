"""Connection store: the latest state of every tracked connection and what has been reported of it.

Pure logic, no I/O and no clock of its own: the caller passes ``now`` (monotonic seconds, for
deadlines) and ``wall_ns`` (real time, for record timestamps), so tests drive it with a fake
clock.

One concept a module, each layer on the one below (``.importlinter`` enforces the order):

* :mod:`~flow_exporter.store.columns`: slot mechanics, every connection's fields in flat columns;
* :mod:`~flow_exporter.store.table`: following the kernel's table (dumps, events, the cap,
  tombstones, given-up connections);
* :mod:`~flow_exporter.store.ledger`: what was reported (records built, delivered, resent, and
  what a checkpoint keeps);
* :mod:`~flow_exporter.store.shutdown`: final records at SIGTERM.

:class:`ConnectionStore` composes them; it is the only name the rest of the exporter uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flow_exporter.flow import GIVE_UP_IDLE, GIVE_UP_REFUSED, Export, NewConnection
from flow_exporter.settings import DEFAULTS
from flow_exporter.store.ledger import RESEND_MAX_DELAY, RETRY_DELAY
from flow_exporter.store.shutdown import Shutdown
from flow_exporter.store.stats import StoreStats
from flow_exporter.store.table import (
    TOMBSTONE_MIN_TTL,
    GivenUp,
    Tombstone,
    TrackedState,
)
from flow_exporter.timeouts import Timeouts

__all__ = [
    "GIVE_UP_IDLE",
    "GIVE_UP_REFUSED",
    "RESEND_MAX_DELAY",
    "RETRY_DELAY",
    "TOMBSTONE_MIN_TTL",
    "ConnectionStore",
    "Export",
    "GivenUp",
    "StoreStats",
    "Tombstone",
    "TrackedState",
]


@dataclass
class ConnectionStore(Shutdown):
    """Tracked connections keyed by :class:`~flow_exporter.connection.ConnectionKey`, and their expiry queue."""

    timeouts: Timeouts = field(default_factory=Timeouts)
    on_new: Callable[[NewConnection], None] | None = None  # enrichment hook, called once per new connection
    max_connections: int = DEFAULTS["limits.maxConnections"]  # bounded memory: beyond this, connections are given up
    adopt: bool = True  # no state to continue from: connections found live are flagged ADOPTED
    id_seed: bytes | None = None  # the id allocator's start (tests); random by default
    compiled: bool = True  # False: the lockstep tests' reference (no fused poll or bulk admission; interpreted rules)
    cache_prefixes: bool = True  # keep an active connection's record prefix for its next record (export.prefixCache)

    def __post_init__(self) -> None:
        self._init_columns()
        self._init_table()
        self._init_ledger()
        self._init_shutdown()
