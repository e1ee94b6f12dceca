"""What the exporter says about itself: one snapshot of its counters, and the timings it reports.

The loops, the store, the sink and the checkpoint keep plain int counters (the hot path never
touches a metric object). :meth:`Exporter.readings <flow_exporter.app.Exporter.readings>` copies
them into one :class:`Readings` at scrape time, and :mod:`flow_exporter.metrics` turns that into
Prometheus families: metrics depend on this module only, never on the loops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from flow_exporter.ports import ClientStats


class Timings(Protocol):
    """Durations the loops observe as they happen (histograms in :class:`~flow_exporter.metrics.Metrics`)."""

    def observe_poll(self, seconds: float) -> None: ...

    def observe_export(self, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class CheckpointReadings:
    snapshots: int
    errors: int
    last_snapshot_bytes: int
    last_snapshot_seconds: float
    journal_bytes: int
    broken: int = 0  # 1 while the state directory cannot be written (Checkpoint.broken)
    stale: int = 0  # 1 while it holds an old state it could not delete: records held back (Checkpoint.stale)


@dataclass(frozen=True, slots=True)
class Readings:
    """Every counter the exporter keeps, at one moment; each is exported by the metrics endpoint."""

    # conntrack table and polls
    table_count: int
    table_max: int
    polls: int
    poll_errors: int
    expire_errors: int
    states_dropped: int  # restored states dropped because applying them raised (a new lineage)
    resyncs: int
    barrier_timeouts: int
    decode_skipped: int
    # events
    events_received: int
    event_losses: int
    event_buffer_bytes: int
    # store
    connections_tracked: int
    connections_added: int
    connections_added_from_events: int
    connections_deleted: int
    tuples_reused: int
    destroy_events: int
    late_events_continued: int
    late_destroys_dropped: int
    counter_resets: int
    connections_restored: int
    connections_restored_gone: int
    connections_readmitted: int
    tombstones_dropped_early: int
    unreported_ends: int
    given_up: dict[str, int]
    records_built: int
    records_resent: int
    # sink
    records_in_flight: int
    records_produced: int
    records_acknowledged: int
    records_failed: int
    records_given_up: int
    bytes_produced: int
    checkpoint: CheckpointReadings | None = None
    kafka_client: ClientStats | None = None
    extra: dict[str, float] = field(default_factory=dict)  # from other parts (Kubernetes enrichment)
    zone_entries: dict[int, int] = field(default_factory=dict)  # entries per conntrack zone, last dump
    conntrack_kernel: dict[str, int] = field(default_factory=dict)  # conntrack -S, summed over CPUs
    last_poll_seconds: float = 0.0
    delivery_failures: dict[str, int] = field(default_factory=dict)  # failed deliveries by Kafka error code
    source: str = "netfilter"  # conntrack.source as chosen
    sampling_probability: float = 1.0  # sampling.probability: the share of connections kept
    connections_sampled_out: int = 0  # connections the sampler dropped, each counted when first met
    sampling_changes: int = 0  # adaptive shedding's changes of the probability for new connections
