"""The conntrack health stream: one low-rate ConntrackHealth record per node and interval, to Kafka.

Platform teams want to know that conntrack itself is healthy (table filling up, inserts failing,
entries evicted early, event overruns, slow polls) even where they do not want every flow
(antrea#8366 asks for exactly that). The same numbers are Prometheus metrics; this stream puts them
beside the flows, in the same pipeline, with the same node name, and works with flow export off
(``export.flows: false``: connections are still tracked, their records are dropped unsent).

The record is built from :class:`~flow_exporter.readings.Readings` (pure), encoded with fastavro
(one record a minute: no reason for a hand-written encoder) against ``schemas/conntrack_health.avsc``,
and produced by a producer of its own (the flow sink's queue and accounting stay about flows).
A failed delivery is logged and not retried: the next record carries cumulative counters anyway.
"""

from __future__ import annotations

import io
import logging
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import fastavro

from flow_exporter.readings import Readings
from flow_exporter.record import load_schema

log = logging.getLogger(__name__)

SCHEMA_FILE = "conntrack_health.avsc"
# Readings.conntrack_kernel names -> record fields.
KERNEL_FIELDS = {
    "insert_failed": "insertFailed",
    "drop": "drop",
    "early_drop": "earlyDrop",
    "error": "error",
    "invalid": "invalid",
    "search_restart": "searchRestart",
    "clash_resolve": "clashResolve",
    "chain_toolong": "chainTooLong",
    "cilium_full_reads": "mapFullReads",  # the Cilium source's (CiliumSource.kernel_stats)
}


@lru_cache(maxsize=1)
def health_schema() -> Any:
    return fastavro.parse_schema(load_schema(SCHEMA_FILE))


def health_record(r: Readings, node: str, now_ms: int, interval: float, flows: bool) -> dict[str, Any]:
    """The ConntrackHealth record of these readings."""
    rec: dict[str, Any] = {
        "exporterNode": node,
        "time": now_ms,
        "intervalSeconds": float(interval),
        "flowExport": flows,
        "conntrackEntries": r.table_count,  # read after the last poll's dump, not now: the schema says so
        "conntrackMax": r.table_max,
        "zoneEntries": {str(z): n for z, n in sorted(r.zone_entries.items())},
        "polls": r.polls,
        "pollErrors": r.poll_errors,
        "lastPollSeconds": float(r.last_poll_seconds),
        "eventsReceived": r.events_received,
        "eventLosses": r.event_losses,
        "connectionsTracked": r.connections_tracked,
        "connectionsGivenUp": sum(r.given_up.values()),
        "recordsGivenUp": r.records_given_up,
        "source": r.source,
        "samplingProbability": r.sampling_probability,
        "connectionsObserved": r.connections_added + r.connections_sampled_out,
        "connectionsSelected": r.connections_added,
        "samplingChanges": r.sampling_changes,
    }
    for stat, field in KERNEL_FIELDS.items():
        rec[field] = r.conntrack_kernel.get(stat)
    return rec


def encode(record: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, health_schema(), record)
    return buf.getvalue()


class HealthReporter:
    """A thread that sends one health record every ``interval`` seconds (and one at stop)."""

    def __init__(
        self,
        read: Callable[[], Readings],
        produce: Callable[[bytes, bytes], None],
        *,
        node: str,
        interval: float,
        flows: bool,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self._read, self._produce = read, produce
        self.node, self.interval, self.flows = node, interval, flows
        self._wall_ms = wall_ms
        self.sent = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def send_once(self) -> None:
        record = health_record(self._read(), self.node, self._wall_ms(), self.interval, self.flows)
        try:
            self._produce(self.node.encode(), encode(record))
            self.sent += 1
        except Exception as exc:  # never let the health stream take the exporter down
            self.errors += 1
            log.warning("health record not sent: %s", exc)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.send_once()

    def start(self) -> HealthReporter:
        self._thread = threading.Thread(target=self._run, name="health", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
