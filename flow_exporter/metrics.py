"""Prometheus metrics, ``/healthz`` and ``/readyz`` on one HTTP port.

Counters kept by the loops and the sink are plain ints, read at scrape time by a
collector: the hot path (one call per record) never touches a metric object.
Only the per-poll and per-batch durations are observed directly, in histograms.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from flow_exporter.app import Exporter

log = logging.getLogger(__name__)

POLL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
EXPORT_BUCKETS = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)


class Metrics:
    """The exporter's metrics registry (one per process; tests make their own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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

    def bind(self, exporter: Exporter, extra: Callable[[], dict[str, float]] | None = None) -> None:
        self.registry.register(_ExporterCollector(exporter, extra))


class _ExporterCollector(Collector):
    def __init__(self, exporter: Exporter, extra: Callable[[], dict[str, float]] | None) -> None:
        self.exporter = exporter
        self.extra = extra

    def collect(self) -> Iterator[Metric]:
        e = self.exporter
        s = e.stats
        sink = e.sink
        st = e.store.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"flow_exporter_{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"flow_exporter_{name}", doc, value=value)

        yield gauge("conntrack_entries", "Entries in the conntrack table (all zones).", s.table_count)
        yield gauge("conntrack_max", "nf_conntrack_max: the table's capacity.", s.table_max)
        yield gauge("connections_tracked", "Connections held in the store.", len(e.store))
        yield gauge("records_in_flight", "Records handed to the producer, not yet acknowledged.", sink.in_flight)
        yield counter("polls", "Conntrack polls completed.", s.polls)
        yield counter("poll_errors", "Conntrack dumps that failed and were retried.", s.poll_errors)
        yield counter("records_produced", "Records handed to the Kafka producer.", sink.produced)
        yield counter("records_acknowledged", "Records whose delivery Kafka acknowledged.", sink.acked)
        yield counter("records_failed", "Records Kafka did not take (their counts go in the next one).", sink.failed)
        yield counter("bytes_produced", "Avro bytes handed to the producer.", sink.bytes_produced)
        yield counter("connections_added", "Connections first seen.", st.added)
        yield counter("connections_deleted", "Connections removed after their final record.", st.deleted)
        given_up = CounterMetricFamily(
            "flow_exporter_connections_given_up",
            "Connections given up at limits.maxConnections, by reason (each got one lack-of-resources record).",
            labels=["reason"],
        )
        for reason in ("cap_refused", "cap_idle"):
            given_up.add_metric([reason], st.given_up.get(reason, 0))
        yield given_up
        yield counter("decode_skipped", "Netlink messages skipped as malformed.", s.decode_skipped)
        ev = e.events
        yield counter("event_losses", "Conntrack events the kernel dropped (buffer full).", ev.lost if ev else 0)
        yield counter("conntrack_resyncs", "Full dumps run at once because events were lost.", s.resyncs)
        yield counter("records_resent", "Records sent again, as the same bytes, after a failed delivery.", st.resends)
        yield counter("records_given_up", "Records Kafka refused for good (their counts are lost).", s.records_given_up)
        yield counter("late_events_continued", "Ended connections continued by a late event.", st.resurrected)
        yield counter("counter_resets", "Entries whose counters went down (new connectionId).", st.counter_resets)
        yield counter("connections_restored", "Connections continued from the checkpoint after a restart.", st.restored)
        cp = e.checkpoint
        if cp is not None:
            cs = cp.stats
            yield counter("checkpoint_snapshots", "Checkpoint snapshots written.", cs.snapshots)
            yield counter("checkpoint_errors", "Checkpoint writes that failed (state then dropped).", cs.errors)
            yield gauge("checkpoint_snapshot_bytes", "Size of the last checkpoint snapshot.", cs.last_snapshot_bytes)
            yield gauge("checkpoint_snapshot_seconds", "Time to write the last snapshot.", cs.last_snapshot_seconds)
            yield gauge("checkpoint_journal_bytes", "Size of the journal since the last snapshot.", cs.journal_bytes)
        if self.extra is not None:
            for name, value in self.extra().items():
                yield counter(name, name.replace("_", " "), value)


class HealthServer:
    """Serves /metrics, /healthz (the loops are alive) and /readyz (ready to export)."""

    def __init__(
        self,
        metrics: Metrics,
        host: str,
        port: int,
        alive: Callable[[], tuple[bool, str]],
        ready: Callable[[], tuple[bool, str]],
    ) -> None:
        registry = metrics.registry

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                elif path in ("/healthz", "/readyz"):
                    ok, why = (alive if path == "/healthz" else ready)()
                    self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, ctype: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # probes every few seconds would flood the log

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics and health on port %d (/metrics, /healthz, /readyz)", self.port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def liveness(exporter: Exporter, max_silence: float) -> Callable[[], tuple[bool, str]]:
    """Alive while both loops have ticked within ``max_silence`` seconds."""

    def check() -> tuple[bool, str]:
        now = time.monotonic()
        stale = [name for name, t in exporter.heartbeats.items() if now - t > max_silence]
        if stale:
            return False, "stalled: " + ", ".join(sorted(stale))
        return True, "ok"

    return check


def readiness(exporter: Exporter, caches_ready: Callable[[], bool] | None = None) -> Callable[[], tuple[bool, str]]:
    """Ready once the first poll is done, the caches synced and the producer reached the broker."""

    def check() -> tuple[bool, str]:
        missing = []
        if not exporter.first_poll_done.is_set():
            missing.append("first poll")
        if caches_ready is not None and not caches_ready():
            missing.append("kubernetes caches")
        if not exporter.sink.connected:
            missing.append("kafka")
        return (False, "waiting for: " + ", ".join(missing)) if missing else (True, "ok")

    return check
