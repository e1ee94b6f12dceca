"""The ports where the loops meet the edges: what they need from conntrack and from Kafka.

The loops (:mod:`flow_exporter.app`) are written against these protocols only, so they run
the same against the real conntrack dumper and Kafka producer as against the in-memory fakes
the unit tests use. Each port is a handful of methods; callbacks a port needs (when to stop
waiting, a heartbeat while blocked) are given to the adapter when it is built, never patched in.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from flow_exporter.connection import Connection
from flow_exporter.flow import Export, Restored

if TYPE_CHECKING:  # readings imports this module (ClientStats)
    from flow_exporter.readings import CheckpointReadings


@dataclass(slots=True)
class DecodeResult:
    """What one recv() buffer of ctnetlink messages held, besides the connections it gave."""

    decoded: int = 0  # Connections produced (before zone filtering)
    skipped: int = 0  # malformed messages (a truncated buffer tail counts as one)
    ignored: int = 0  # well-formed messages of other types (NOOP, stats, ...)
    done: bool = False  # NLMSG_DONE seen: the dump is complete
    errno: int = 0  # first errno from NLMSG_ERROR (or a negative NLMSG_DONE payload)
    interrupted: bool = False  # NLM_F_DUMP_INTR seen: the dump may be inconsistent
    kept: int = 0  # Connections handed on (after zone filtering)


class Source(Protocol):
    """Conntrack, as the poll loop reads it (the real one: ``conntrack.ConntrackDumper``)."""

    skipped: int
    """Malformed messages skipped so far (cumulative)."""

    def dump_into(self, consume: Callable[[list[Connection]], None], zones: Collection[int] | None = None) -> int:
        """Hand the table to ``consume`` batch by batch (so it never exists twice in memory); returns its size."""
        ...

    def dump_buffers(
        self, apply: Callable[[memoryview], DecodeResult], zones: Collection[int] | None = None
    ) -> int | None:
        """Hand the dump's raw netlink buffers to ``apply`` (the compiled poll path), which decodes them itself.

        Returns the entries ``apply`` kept, or None when this source has no netlink bytes to give
        (the caller then uses ``dump_into``).
        """
        ...

    def count(self) -> int:
        """Entries in the table now."""
        ...

    def max_entries(self) -> int:
        """The table's capacity (nf_conntrack_max)."""
        ...

    def kernel_stats(self) -> dict[str, int]:
        """Conntrack's own counters, cumulative (insert_failed, drop, early_drop, ...: ``conntrack -S``)."""
        ...


class EventSource(Protocol):
    """The conntrack NEW/DESTROY listener, as the poll loop waits on it (the real one: ``ConntrackEvents``)."""

    received: int
    """Events decoded and handed on (cumulative)."""
    lost: int
    """Events the kernel dropped (cumulative)."""
    skipped: int
    """Malformed messages skipped (cumulative)."""
    rcvbuf_granted: int
    """The receive buffer the kernel grants now, bytes (it grows after losses)."""

    def caught_up(self, since: float, timeout: float) -> bool:
        """Block until every event queued before ``since`` is applied; False after ``timeout`` seconds."""
        ...


class Unsent(Exception):
    """Producing a batch stopped at ``index`` on an unexpected error (the ``__cause__``).

    The records from ``index`` on were not handed over; the ones before were.
    """

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class DeliveryReport(NamedTuple):
    """The broker's answer for one record (a record not delivered, in :attr:`Reports.failed`)."""

    export: Export
    delivered: bool
    error: str | None = None
    permanent: bool = False  # failed for good: resending the same bytes cannot succeed
    partition: int = -1  # where Kafka put a delivered record (completeness markers)
    offset: int = -1


@dataclass(slots=True)
class Reports:
    """The broker's answers a sink collected since it last handed them over (:meth:`Sink.take_reports`).

    The records delivered, in the order they were, with the partition and offset Kafka put each at: three
    lists of one entry per record, not an object per record (at 50k records/s a report tuple made per
    record, then iterated and freed by the loop, showed in the node run's CPU: perf, issue 39). The
    records not delivered (a resend may still succeed, or refused for good) are each a
    :class:`DeliveryReport`, in their order. A record is settled by its own answer only, so the two kinds
    need no order between them. Iterating gives a report per record: the delivered ones, then the others.
    """

    delivered: list[Export] = field(default_factory=list)
    partitions: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    failed: list[DeliveryReport] = field(default_factory=list)

    def add_delivered(self, export: Export, partition: int = -1, offset: int = -1) -> None:
        self.delivered.append(export)
        self.partitions.append(partition)
        self.offsets.append(offset)

    def __len__(self) -> int:
        return len(self.delivered) + len(self.failed)

    def __iter__(self) -> Iterator[DeliveryReport]:
        for export, partition, offset in zip(self.delivered, self.partitions, self.offsets, strict=True):
            yield DeliveryReport(export, True, None, False, partition, offset)
        yield from self.failed


@dataclass(slots=True)
class SinkCounters:
    """What a sink has done so far (cumulative), for metrics."""

    produced: int = 0
    acked: int = 0
    failed: int = 0
    bytes_produced: int = 0
    failures_by_error: dict[str, int] = field(default_factory=dict)  # failed, by Kafka error code name
    connected: bool = False  # the broker answered at least once (readiness)
    fatal: str | None = None  # a fatal producer error: nothing can be delivered any more (exit and restart)
    client: ClientStats | None = None  # the Kafka client's own statistics, when it reports them


@dataclass(frozen=True, slots=True)
class BrokerStats:
    """One broker connection, as the Kafka client last reported it."""

    name: str
    rtt_seconds: float  # average request round-trip time over the last statistics interval
    requests: int  # requests sent (cumulative)
    request_errors: int
    retries: int
    timeouts: int
    disconnects: int


@dataclass(frozen=True, slots=True)
class ClientStats:
    """The Kafka client's view of its queue and brokers (librdkafka statistics), for metrics."""

    queue_messages: int  # messages waiting in the client (not yet acknowledged)
    queue_bytes: int
    brokers: tuple[BrokerStats, ...] = ()


class Sink(Protocol):
    """Where records go (the real one: ``sink.KafkaSink``, a produce/poll/flush loop).

    Records are prepared (encoded once, so a resend is the same bytes) and produced in two
    steps so the checkpoint can journal them in between. Delivery reports are collected while
    ``poll``/``flush`` serve the producer and handed over by ``take_reports``, on the loop's own
    thread: a sink never calls back into the store.
    """

    counters: SinkCounters

    def prepare_all(self, exports: list[Export], export_ms: int) -> list[tuple[Export, Exception]]:
        """Encode every record not encoded yet (one call per batch); the ones that cannot be, with why."""
        ...

    def produce(self, export: Export) -> None: ...

    def produce_all(self, exports: list[Export]) -> None:
        """:meth:`produce` each, in order; raises :class:`Unsent` if an unexpected error stops it."""
        ...

    def poll(self, timeout: float) -> int:
        """Serve deliveries for up to ``timeout`` seconds."""
        ...

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for everything in flight; returns how many are still undelivered."""
        ...

    def purge(self) -> None:
        """Drop what is still queued; its reports come back as failures."""
        ...

    def in_flight(self) -> int:
        """Records produced and not yet reported."""
        ...

    def take_reports(self) -> Reports:
        """The delivery reports collected since the last call."""
        ...


class PackedState(NamedTuple):
    """A snapshot's bytes before they are written: its header's room, then every row and record packed.

    Packed straight into one buffer rather than a list of rows first: at 1,000,000 connections the
    list of rows, their packed bytes and the joined body, all at once, were far more than the buffer alone
    (bench_node's peak RSS).
    """

    rows: int
    records: int
    data: bytearray
    seconds: float  # spent packing
    adopting: bool = False  # the store still flags connections found live (checkpoint.Loaded.adopting)


class Journal(Protocol):
    """The state directory as the loops use it (the real one: ``checkpoint.Checkpoint``; none: ``NoJournal``).

    Records are journaled before they are produced and marked when delivered; a snapshot
    replaces the journal when it is due.
    """

    keeps: bool
    """Whether anything is kept at all (a snapshot costs a pass over the store: skipped when not)."""
    broken: bool
    """A write failed: the state on disk is not kept up to date."""

    @property
    def stale(self) -> bool:
        """A write failed and the old state could not be deleted: no record may be produced until a snapshot."""
        ...

    def sent(self, exports: Iterable[Export]) -> None:
        """Journal records about to be produced."""
        ...

    def delivered(self, exports: Iterable[Export]) -> None:
        """Journal records Kafka acknowledged (or refused for good)."""
        ...

    def due(self) -> bool:
        """Time for a snapshot."""
        ...

    def snapshot(self, reported: Iterable[Restored], in_flight: Iterable[Export]) -> None:
        """Write the whole state at once; the journal starts over after it (``write(pack(...))``)."""
        ...

    def pack(self, reported: Iterable[Restored], in_flight: Iterable[Export]) -> PackedState:
        """The state as the snapshot's bytes, one row at a time (the loops hold their lock for this part only)."""
        ...

    def write(self, packed: PackedState) -> None:
        """Write a packed state as the snapshot; the journal starts over after it."""
        ...

    def new_lineage(self) -> None:
        """The state was dropped: what is written from now on belongs to a new lineage (a snapshot follows)."""
        ...

    def readings(self) -> CheckpointReadings | None:
        """Its counters for the metrics endpoint (None: nothing kept)."""
        ...


class NoJournal:
    """No state directory: nothing is kept, nothing is held back."""

    keeps = False
    broken = False

    @property
    def stale(self) -> bool:
        return False

    def sent(self, exports: Iterable[Export]) -> None:
        pass

    def delivered(self, exports: Iterable[Export]) -> None:
        pass

    def due(self) -> bool:
        return False

    def snapshot(self, reported: Iterable[Restored], in_flight: Iterable[Export]) -> None:
        pass

    def pack(self, reported: Iterable[Restored], in_flight: Iterable[Export]) -> PackedState:
        return PackedState(0, 0, bytearray(), 0.0)

    def write(self, packed: PackedState) -> None:
        pass

    def new_lineage(self) -> None:
        pass

    def readings(self) -> CheckpointReadings | None:
        return None


class DeliveryObserver(Protocol):
    """Told of every record produced and settled, a batch at a time (the real one: ``completeness.Completeness``;
    none: ``NoObserver``, which costs one call per batch)."""

    def produced_all(self, exports: Iterable[Export]) -> None:
        """These records are about to be produced."""
        ...

    def settled_all(self, reports: Reports) -> None:
        """The broker's answers: a delivered record (where Kafka put it) or one refused for good is settled."""
        ...


class NoObserver:
    """No completeness markers: deliveries are not followed."""

    def produced_all(self, exports: Iterable[Export]) -> None:
        pass

    def settled_all(self, reports: Reports) -> None:
        pass
