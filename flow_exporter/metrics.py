"""Prometheus metrics: the families, their collector and the loops' histograms (served beside the probes).

Counters kept by the loops and the sink are plain ints, read at scrape time by a
collector: the hot path (one call per record) never touches a metric object.
Only the per-poll and per-batch durations are observed directly, in histograms.
Names follow Prometheus conventions (``flow_exporter_`` prefix, base units, ``_total``
for counters, labels instead of name variants); the process's own metrics
(``process_*``, ``python_info``) and ``flow_exporter_build_info`` come with them.
:func:`catalogue` lists every family, so the README's table is generated, never written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flow_exporter.flow import GIVE_UP_REASONS
from flow_exporter.ports import BrokerStats, ClientStats
from flow_exporter.readings import Readings
from flow_exporter.settings import DEFAULT_SETTINGS, Settings

log = logging.getLogger(__name__)

POLL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
EXPORT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)

# (field of Readings, metric name after "flow_exporter_", help, "counter" or "gauge"): every plain field.
_FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("table_count", "conntrack_entries", "Entries in the conntrack table (all zones).", "gauge"),
    ("table_max", "conntrack_max", "nf_conntrack_max: the table's capacity.", "gauge"),
    ("connections_tracked", "connections_tracked", "Connections held in the store.", "gauge"),
    ("records_in_flight", "records_in_flight", "Records handed to the producer, not yet acknowledged.", "gauge"),
    ("polls", "polls", "Conntrack polls completed.", "counter"),
    ("poll_errors", "poll_errors", "Conntrack dumps that failed and were retried.", "counter"),
    ("expire_errors", "expire_errors", "Expire-loop turns that raised (logged, retried after a backoff).", "counter"),
    (
        "states_dropped",
        "states_dropped",
        "Restored states dropped because applying them raised: a new lineage, live connections flagged adopted.",
        "counter",
    ),
    ("resyncs", "conntrack_resyncs", "Full dumps run at once because events were lost.", "counter"),
    (
        "barrier_timeouts",
        "event_barrier_timeouts",
        "Polls whose sweep ran before the event listener caught up (a DESTROY may come late).",
        "counter",
    ),
    ("decode_skipped", "decode_skipped", "Netlink messages skipped as malformed (dumps and events).", "counter"),
    ("events_received", "conntrack_events", "Conntrack NEW and DESTROY events received.", "counter"),
    ("event_losses", "event_losses", "Conntrack events the kernel dropped (buffer full).", "counter"),
    (
        "event_buffer_bytes",
        "event_buffer_bytes",
        "Receive buffer of the event socket as the kernel grants it; doubles after losses (conntrack.eventBufferMax).",
        "gauge",
    ),
    ("connections_added", "connections_added", "Connections first seen.", "counter"),
    (
        "connections_added_from_events",
        "connections_added_from_events",
        "Connections first seen in a NEW or DESTROY event rather than a dump.",
        "counter",
    ),
    (
        "connections_sampled_out",
        "connections_sampled_out",
        "Connections the sampler dropped (sampling.probability), each counted once, when first met.",
        "counter",
    ),
    (
        "sampling_probability",
        "sampling_probability",
        "The probability new connections are kept with: sampling.probability, or lower while shedding (1: all).",
        "gauge",
    ),
    (
        "sampling_changes",
        "sampling_changes",
        "Adaptive shedding's changes of the probability for new connections (each logged).",
        "counter",
    ),
    ("connections_deleted", "connections_deleted", "Connections removed after their final record.", "counter"),
    ("tuples_reused", "tuples_reused", "Tuples taken over by a new conntrack entry (the old one ended).", "counter"),
    ("destroy_events", "destroy_events", "DESTROY events applied.", "counter"),
    ("late_events_continued", "late_events_continued", "Ended connections continued by a late event.", "counter"),
    (
        "late_destroys_dropped",
        "late_destroys_dropped",
        "Late DESTROY events with nothing new to report.",
        "counter",
    ),
    ("counter_resets", "counter_resets", "Entries whose counters went down (new connectionId).", "counter"),
    (
        "connections_restored",
        "connections_restored",
        "Connections continued from the checkpoint after a restart.",
        "counter",
    ),
    (
        "connections_restored_gone",
        "connections_restored_gone",
        "Connections in the checkpoint that had ended while no exporter ran.",
        "counter",
    ),
    (
        "connections_readmitted",
        "connections_readmitted",
        "Incarnations met again after the store forgot them: a new connectionId flagged adopted.",
        "counter",
    ),
    (
        "tombstones_dropped_early",
        "tombstones_dropped_early",
        "Ended connections forgotten before their tombstone's time, to stay within limits.maxConnections.",
        "counter",
    ),
    (
        "unreported_ends",
        "unreported_ends",
        "Final counters that could not be reported (connection given up, or unknown).",
        "counter",
    ),
    ("records_built", "records_built", "Records built (first sends; resends are counted apart).", "counter"),
    ("records_resent", "records_resent", "Records sent again, as the same bytes, after a failed delivery.", "counter"),
    ("records_produced", "records_produced", "Records handed to the Kafka producer.", "counter"),
    ("records_acknowledged", "records_acknowledged", "Records whose delivery Kafka acknowledged.", "counter"),
    ("records_failed", "records_failed", "Deliveries that failed (the same record is sent again).", "counter"),
    ("records_given_up", "records_given_up", "Records Kafka refused for good (their counts are lost).", "counter"),
    ("bytes_produced", "produced_bytes", "Avro bytes handed to the producer.", "counter"),
)
_CHECKPOINT_FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("snapshots", "checkpoint_snapshots", "Checkpoint snapshots written.", "counter"),
    ("errors", "checkpoint_errors", "Checkpoint writes that failed, retries included.", "counter"),
    ("last_snapshot_bytes", "checkpoint_last_snapshot_bytes", "Size of the last checkpoint snapshot.", "gauge"),
    ("last_snapshot_seconds", "checkpoint_last_snapshot_seconds", "Time to write the last snapshot.", "gauge"),
    ("journal_bytes", "checkpoint_journal_bytes", "Size of the journal since the last snapshot.", "gauge"),
    ("broken", "checkpoint_broken", "1 while state.dir cannot be written (a snapshot is retried).", "gauge"),
    ("stale", "checkpoint_stale", "1 while state.dir keeps an old state it cannot delete: records held back.", "gauge"),
)
GIVEN_UP_REASONS = GIVE_UP_REASONS
# Settings served as gauges, so an alert or a dashboard can set a reading against its limit
# (last_poll_seconds / poll_interval_seconds, records_in_flight / max_in_flight): (its reading, name, help).
_SETTING_FAMILIES: tuple[tuple[Callable[[Settings], float], str, str], ...] = (
    (lambda s: s.conntrack.poll_interval, "poll_interval_seconds",
     "conntrack.pollInterval: the time between two polls."),
    (lambda s: s.limits.max_in_flight, "max_in_flight", "limits.maxInFlight: the cap on records awaiting Kafka's ack."),
    (lambda s: s.limits.max_connections, "max_connections",
     "limits.maxConnections: the cap on connections in the store."),
)  # fmt: skip
# Counters other parts hand in through Readings.extra (the runner: Kubernetes enrichment), with their help.
EXTRA_FAMILIES = {
    "enrichment_lookups": "Connections looked up in the Kubernetes caches.",
    "enrichment_misses": "Lookups that found neither end known (records with null Kubernetes fields).",
    "enrichment_errors": "Enrichment calls that failed (the record goes out unenriched).",
    "labels_truncated": "Pod label values cut to the maximum length.",
    "networks_named": "New connections with an end named by networks.file (sourceNetwork, destinationNetwork).",
    "networks_reloads": "Times networks.file was read again after it changed.",
    "networks_reload_errors": "Times networks.file changed and could not be used (the table read before is kept).",
}


def _families(values: object, table: tuple[tuple[str, str, str, str], ...]) -> Iterator[Metric]:
    for attr, name, doc, kind in table:
        family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        yield family(f"flow_exporter_{name}", doc, value=getattr(values, attr))


def build_labels() -> dict[str, str]:
    """flow_exporter_build_info's labels: what a record's bytes and the delivery behaviour depend on."""
    import platform

    import confluent_kafka

    from flow_exporter import __version__

    return {
        "version": __version__,
        "python": platform.python_version(),
        "librdkafka": confluent_kafka.libversion()[0],
        "confluent_kafka": confluent_kafka.version()[0],
    }


class Metrics:
    """The exporter's metrics registry (one per process; tests make their own); also its :class:`Timings`.

    ``settings`` gives the values of the setting gauges (None: the defaults).
    """

    def __init__(self, settings: Settings | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._ready: Callable[[], bool] | None = None
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, resident memory, open fds
        PlatformCollector(registry=self.registry)  # python_info
        Info("flow_exporter_build", "Version of the exporter and of the libraries that shape its output.",
             registry=self.registry).info(build_labels())  # fmt: skip
        self.poll_seconds = Histogram(
            "flow_exporter_poll_duration_seconds",
            "Time of one conntrack dump plus store update.",
            buckets=POLL_BUCKETS,
            registry=self.registry,
        )
        self.export_seconds = Histogram(
            "flow_exporter_export_duration_seconds",
            "Time to build, encode and hand to the producer one batch of due records.",
            buckets=EXPORT_BUCKETS,
            registry=self.registry,
        )

        given = DEFAULT_SETTINGS if settings is None else settings
        self.registry.register(_SettingsCollector({name: float(read(given)) for read, name, _ in _SETTING_FAMILIES}))
        self.registry.register(_ReadyCollector(self))

    def bind_ready(self, check: Callable[[], bool]) -> None:
        """Serve ``check()`` (what /readyz answers) as flow_exporter_ready at each scrape."""
        self._ready = check

    def observe_poll(self, seconds: float) -> None:
        self.poll_seconds.observe(seconds)

    def observe_export(self, seconds: float) -> None:
        self.export_seconds.observe(seconds)

    def bind(self, read: Callable[[], Readings]) -> None:
        """Serve what ``read`` returns at each scrape."""
        self.registry.register(_ReadingsCollector(read))


class _SettingsCollector(Collector):
    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def collect(self) -> Iterator[Metric]:
        for _, name, doc in _SETTING_FAMILIES:
            yield GaugeMetricFamily(f"flow_exporter_{name}", doc, value=self.values[name])


class _ReadyCollector(Collector):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        check = self.metrics._ready
        if check is not None:
            yield GaugeMetricFamily(
                "flow_exporter_ready", "1 while /readyz answers 200 (ready), else 0.", value=float(check())
            )


class _ReadingsCollector(Collector):
    def __init__(self, read: Callable[[], Readings]) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        r = self.read()
        yield from _families(r, _FAMILIES)
        given_up = CounterMetricFamily(
            "flow_exporter_connections_given_up",
            "Connections given up at limits.maxConnections, by reason (each got one lack-of-resources record).",
            labels=["reason"],
        )
        for reason in GIVEN_UP_REASONS:
            given_up.add_metric([reason], r.given_up.get(reason, 0))
        yield given_up
        failures = CounterMetricFamily(
            "flow_exporter_delivery_failures",
            "Deliveries that failed, by Kafka error code (KafkaError.name(), e.g. TOPIC_AUTHORIZATION_FAILED, "
            "_MSG_TIMED_OUT); they add up to records_failed_total.",
            labels=["error"],
        )
        for code, n in sorted(r.delivery_failures.items()):
            failures.add_metric([code], n)
        yield failures
        yield from _health_families(r)
        if r.checkpoint is not None:
            yield from _families(r.checkpoint, _CHECKPOINT_FAMILIES)
        if r.kafka_client is not None:
            yield from _client_families(r.kafka_client)
        for name, value in r.extra.items():
            yield CounterMetricFamily(f"flow_exporter_{name}", EXTRA_FAMILIES.get(name, name), value=value)


def _health_families(r: Readings) -> Iterator[Metric]:
    """Conntrack health: fill per zone, the kernel's own statistics, the last poll's duration."""
    zones = GaugeMetricFamily(
        "flow_exporter_conntrack_zone_entries",
        "Entries per conntrack zone in the last dump (zones the exporter reads).",
        labels=["zone"],
    )
    for zone, n in sorted(r.zone_entries.items()):
        zones.add_metric([str(zone)], n)
    yield zones
    kernel = CounterMetricFamily(
        "flow_exporter_conntrack_kernel",
        "Conntrack's own statistics in the exporter's namespace, summed over CPUs (conntrack -S): "
        "insert_failed, drop, early_drop, error, invalid, search_restart, clash_resolve, chain_toolong; with the "
        "Cilium source, cilium_full_reads: polls that found one of Cilium's CT maps at its capacity.",
        labels=["stat"],
    )
    for stat, n in sorted(r.conntrack_kernel.items()):
        kernel.add_metric([stat], n)
    yield kernel
    source = GaugeMetricFamily(
        "flow_exporter_source",
        "1 for the source the exporter reads (conntrack.source as chosen): netfilter or cilium.",
        labels=["source"],
    )
    source.add_metric([r.source], 1)
    yield source
    yield GaugeMetricFamily(
        "flow_exporter_last_poll_seconds", "Duration of the last conntrack poll.", value=r.last_poll_seconds
    )


# Per-broker families from the Kafka client's statistics: (field of BrokerStats, name, help, type).
_BROKER_FAMILIES: tuple[tuple[str, str, str, str], ...] = (
    ("rtt_seconds", "kafka_broker_rtt_seconds", "Average round-trip time to the broker (last interval).", "gauge"),
    ("requests", "kafka_broker_requests", "Requests sent to the broker.", "counter"),
    ("request_errors", "kafka_broker_request_errors", "Requests to the broker that failed.", "counter"),
    ("retries", "kafka_broker_request_retries", "Requests to the broker sent again.", "counter"),
    ("timeouts", "kafka_broker_request_timeouts", "Requests to the broker that timed out.", "counter"),
    ("disconnects", "kafka_broker_disconnects", "Connections to the broker that were lost.", "counter"),
)


def _client_families(c: ClientStats) -> Iterator[Metric]:
    """The Kafka client's statistics (librdkafka, every statistics.interval.ms)."""
    yield GaugeMetricFamily(
        "flow_exporter_kafka_queue_messages", "Messages waiting in the Kafka client.", value=c.queue_messages
    )
    yield GaugeMetricFamily(
        "flow_exporter_kafka_queue_bytes", "Bytes of messages waiting in the Kafka client.", value=c.queue_bytes
    )
    for attr, name, doc, kind in _BROKER_FAMILIES:
        family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        f = family(f"flow_exporter_{name}", doc, labels=["broker"])
        for b in c.brokers:
            f.add_metric([b.name], getattr(b, attr))
        yield f


def catalogue() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """(name as scraped, type, help, label names) of every family this exporter serves, in order.

    Read from a registry fed all-zero readings (with a checkpoint and enrichment), so it is
    exactly what ``/metrics`` shows; the README's metrics table is made from it.
    """
    import dataclasses

    from flow_exporter.readings import CheckpointReadings

    zero: dict[str, object] = {}
    for f in dataclasses.fields(Readings):
        zero[f.name] = {} if f.name in ("given_up", "extra", "zone_entries", "conntrack_kernel") else 0
    zero["zone_entries"] = {0: 0}
    zero["delivery_failures"] = {"TOPIC_AUTHORIZATION_FAILED": 0}
    zero["conntrack_kernel"] = {"drop": 0}
    zero["checkpoint"] = CheckpointReadings(**{f.name: 0 for f in dataclasses.fields(CheckpointReadings)})
    zero["extra"] = dict.fromkeys(EXTRA_FAMILIES, 0)
    zero["kafka_client"] = ClientStats(0, 0, (BrokerStats("broker:9092", 0.0, 0, 0, 0, 0, 0),))
    metrics = Metrics()
    metrics.bind(lambda: Readings(**zero))  # type: ignore[arg-type]
    metrics.bind_ready(lambda: False)
    out = []
    for family in metrics.registry.collect():
        labels: set[str] = set()
        for sample in family.samples:
            labels.update(k for k in sample.labels if k not in ("le",))
        name = family.name + ("_total" if family.type == "counter" else "")
        name = name + "_info" if family.type == "info" else name
        out.append((name, family.type, family.documentation, tuple(sorted(labels))))
    return out
