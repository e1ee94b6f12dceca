"""Connection store: the latest state of every tracked connection and what has been reported of it.

Pure logic, no I/O and no clock of its own: the caller passes ``now`` (monotonic seconds, for
deadlines) and ``wall_ns`` (real time, for record timestamps), so tests drive it with a fake
clock.

One concept a module; objects that own their data, composed (``.importlinter`` enforces the order):

* :mod:`~flow_exporter.store.columns`: slot mechanics, every connection's fields in flat columns;
* :mod:`~flow_exporter.store.memory`: what the store remembers of connections it does not track
  (tombstones, given-up connections, a checkpoint's unmatched rows, the dumps seen), and what that
  memory says a row or an event is;
* :mod:`~flow_exporter.store.table`: the one object that owns the columns and the key index:
  following the kernel's table (dumps, events, the cap) with its memory, and what was reported of
  each connection, through a batch API (due, build, settle, finals);
* :mod:`~flow_exporter.store.ledger`: records asked for when due, delivered, resent (it owns
  the resend queue);
* :mod:`~flow_exporter.store.shutdown`: final records at SIGTERM (it owns the closing pass).

:class:`ConnectionStore` holds one of each and forwards to them; it is the only name the rest of
the exporter uses.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Iterator, MutableMapping

from flow_exporter.connection import Connection, ConnectionKey
from flow_exporter.expiry import ExpiryQueue
from flow_exporter.flow import FORCED_END, GIVE_UP_IDLE, GIVE_UP_REFUSED, Export, NewConnection, ReportedRows, Restored
from flow_exporter.ports import DecodeResult
from flow_exporter.sampling import Sampler
from flow_exporter.settings import DEFAULT_SETTINGS
from flow_exporter.store.ledger import RESEND_MAX_DELAY, RETRY_DELAY, Ledger
from flow_exporter.store.memory import TOMBSTONE_MIN_TTL, GivenUp, Tombstone
from flow_exporter.store.shutdown import Shutdown
from flow_exporter.store.stats import StoreStats
from flow_exporter.store.table import Table, TrackedState
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


class ConnectionStore:
    """Tracked connections keyed by :class:`~flow_exporter.connection.ConnectionKey`, and their expiry queue.

    A facade over three objects that own their data: the :class:`~flow_exporter.store.table.Table`
    (``table``: the columns, the key index and the memory of what left), the
    :class:`~flow_exporter.store.ledger.Ledger` (the resend queue) and the
    :class:`~flow_exporter.store.shutdown.Shutdown` (the closing pass).
    """

    def __init__(
        self,
        timeouts: Timeouts | None = None,
        on_new: Callable[[NewConnection], None] | None = None,  # enrichment hook, called once per new connection
        max_connections: int = DEFAULT_SETTINGS.limits.max_connections,  # beyond this, connections are given up
        adopt: bool = True,  # no state to continue from: connections found live are flagged ADOPTED
        id_seed: bytes | None = None,  # the id allocator's start (tests); random by default
        compiled: bool = True,  # False: the lockstep tests' reference (no fused poll or bulk admission; interpreted)
        cache_prefixes: bool = True,  # keep an active connection's record prefix for its next record
        source_flags: int = 0,  # record flags every connection of the source has (flow.BOTH_DIRECTIONS)
        sampler: Sampler | None = None,  # which connections are kept (None: all of them; sampling.probability 1)
    ) -> None:
        self.timeouts = timeouts = Timeouts() if timeouts is None else timeouts
        self.max_connections = max_connections
        self.stats = StoreStats()
        self.table = Table(
            timeouts, self.stats, on_new=on_new, max_connections=max_connections, adopt=adopt, id_seed=id_seed,
            compiled=compiled, cache_prefixes=cache_prefixes, source_flags=source_flags,
            sampler=sampler,
        )  # fmt: skip
        self._ledger = Ledger(self.table, self.stats)
        self._shutdown = Shutdown(self.table, self._ledger)
        self.queue: ExpiryQueue = self.table.queue
        self.connections: dict[ConnectionKey, int] = self.table.connections
        self.tombstone_ttl = self.table.memory.tombstone_ttl

    # ----------------------------------------------------------------- the kernel's table
    @property
    def adopt(self) -> bool:
        """Whether a connection found live that no state names is flagged adopted (until a first complete poll)."""
        return self.table.adopt

    @property
    def fused(self) -> bool:
        """Whether ``apply_dump_buffer`` is available (not in the lockstep tests' reference store)."""
        return self.table.fused

    def __len__(self) -> int:
        return len(self.table)

    def lookup(self, key: ConnectionKey) -> TrackedState | None:
        """What the store holds for the incarnation that has ``key`` (a copy), or None."""
        return self.table.lookup(key)

    def deadlines(self, key: ConnectionKey) -> tuple[float, float] | None:
        """(active, idle) expiry of the connection with ``key`` while it is queued, else None."""
        return self.table.deadlines(key)

    def reserve(self, n: int) -> None:
        """Room for ``n`` slots in one step (the poll reserves the table's size before a dump)."""
        self.table.reserve(n)

    def update(self, dumped: Iterable[Connection], now: float, wall_ns: int) -> None:
        """Apply one full conntrack dump: add or update what is in it, then sweep what is not."""
        self.table.update(dumped, now, wall_ns)

    def begin_poll(self, wall_ns: int = 0) -> None:
        """Start applying a dump that arrives in batches (``update_batch``, then ``end_poll``)."""
        self.table.begin_poll(wall_ns)

    def update_batch(self, dumped: Iterable[Connection], now: float, wall_ns: int) -> None:
        """Add or update the connections of one part of the current dump."""
        self.table.update_batch(dumped, now, wall_ns)

    def apply_dump_buffer(
        self, buf: memoryview, zones: Container[int] | None, now: float, wall_ns: int,
        zone_counts: MutableMapping[int, int],
    ) -> DecodeResult:  # fmt: skip
        """One receive buffer of the current dump, decoded and applied in one compiled pass."""
        return self.table.apply_dump_buffer(buf, zones, now, wall_ns, zone_counts)

    def end_poll(self, now: float, wall_ns: int = 0) -> None:
        """The dump is complete: whatever it did not contain has left the table."""
        self.table.end_poll(now, wall_ns)

    def apply_events(
        self, new: Iterable[Connection], destroyed: Iterable[Connection], now: float, wall_ns: int
    ) -> None:
        """Conntrack NEW and DESTROY events: connections polling may never see."""
        self.table.apply_events(new, destroyed, now, wall_ns)

    # ----------------------------------------------------------------- records
    def restore(self, rows: Iterable[Restored], resends: Iterable[Export], *, adopting: bool = False) -> None:
        """Continue from a previous process's checkpoint (before the first poll): :meth:`Ledger.restore`."""
        self._ledger.restore(rows, resends, adopting=adopting)

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has something to do (None: nothing is queued)."""
        return self._ledger.next_deadline()

    def expire(self, now: float, wall_ns: int, limit: int | None = None) -> list[Export]:
        """Records for every connection that is due at ``now`` (at most ``limit``), resends first."""
        return self._ledger.expire(now, wall_ns, limit)

    def acknowledge(self, export: Export, delivered: bool, now: float, *, permanent: bool = False) -> None:
        """Settle a record after Kafka's delivery report (:meth:`Ledger.acknowledge`)."""
        self._ledger.acknowledge(export, delivered, now, permanent=permanent)

    def acknowledge_delivered(self, exports: list[Export], now: float) -> None:
        """:meth:`acknowledge` of delivered records, a batch in one call, in order."""
        self._ledger.acknowledge_delivered(exports, now)

    def reported(self) -> ReportedRows:
        """What a checkpoint keeps (:meth:`Table.reported`)."""
        return self.table.reported()

    def in_flight(self) -> Iterator[Export]:
        """Every record built and not known to be delivered (in flight or waiting to be resent)."""
        return self.table.in_flight()

    # ----------------------------------------------------------------- shutdown
    def export_all(self, now: float, reason: int = FORCED_END, limit: int | None = None) -> list[Export]:
        """Shutdown: a last record for every connection with something unreported (:meth:`Shutdown.export_all`)."""
        return self._shutdown.export_all(now, reason, limit)

    def unfinished(self) -> int:
        """Records built and not delivered, plus connections still owing one (shutdown)."""
        return self._shutdown.unfinished()
