"""Completeness markers: what lets a windowed job tell complete windows from lossy ones.

A downstream window is complete when every exporter's records with an export time inside it are
in Kafka and nothing the exporters should have reported was lost. Neither is visible in the flow
records themselves, so each exporter sends, every ``markers.interval``, one CompletenessMarker per
flow-topic partition it has written to (``schemas/completeness_marker.avsc``, on ``markers.topic``):

* ``upTo``: every record of this exporter with an export time before it has been acknowledged by
  Kafka (the smallest export time still unacknowledged, or the marker's time when none is), so a
  window ending at or before ``upTo`` has all of this exporter's records in the topic;
* ``since``/``until``: the exporter's wall-clock interval the loss counts cover, from the end of
  the last marker Kafka acknowledged (so a lost marker's losses are carried into the next one);
* the losses in it: conntrack events the kernel dropped (overruns), connections given up at the
  cap, records Kafka refused for good; and the records acknowledged in this partition, and the
  partition's highest acknowledged offset (a job can check it has read that far).

The README's rule: a window is *lossy* if a marker interval with losses overlaps it, *complete* if
every exporter has a marker with ``upTo`` at or after its end, else *unconfirmed* (yet).

:class:`Completeness` is the bookkeeping (pure: fed by the expire loop's delivery reports and the
exporter's counters, read by the marker thread); the producing is the runner's.
"""

from __future__ import annotations

import io
import json
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

import fastavro

__all__ = ["Completeness", "Losses", "encode_marker"]

SCHEMA_FILE = "completeness_marker.avsc"


@lru_cache(maxsize=1)
def marker_schema() -> Any:
    text = (resources.files("flow_exporter") / "schemas" / SCHEMA_FILE).read_text()
    return fastavro.parse_schema(json.loads(text))


def encode_marker(marker: dict[str, Any]) -> bytes:
    """Bare Avro, like the flow records (a handful a minute: fastavro is fine)."""
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, marker_schema(), marker)
    return buf.getvalue()


@dataclass(frozen=True, slots=True)
class Losses:
    """Cumulative loss counters of one exporter."""

    event_losses: int = 0
    connections_given_up: int = 0
    records_given_up: int = 0

    def minus(self, other: Losses) -> Losses:
        return Losses(
            self.event_losses - other.event_losses,
            self.connections_given_up - other.connections_given_up,
            self.records_given_up - other.records_given_up,
        )


@dataclass
class _Partition:
    acked: int = 0  # acknowledged records since the last marker Kafka confirmed
    acked_pending: int = 0  # ... counted into markers sent but not yet confirmed
    last_offset: int = -1


@dataclass
class Completeness:
    """Acknowledged-up-to and per-partition counts, for the markers (thread-safe)."""

    topic: str
    started_ms: int
    _in_flight: dict[int, int] = field(default_factory=dict)  # id(export) -> its export time (ms)
    _partitions: dict[int, _Partition] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _confirmed_until: int = -1  # until of the last marker Kafka acknowledged (-1: none yet)
    _confirmed_losses: Losses = field(default_factory=Losses)

    def __post_init__(self) -> None:
        if self._confirmed_until < 0:
            self._confirmed_until = self.started_ms

    def produced(self, key: int, export_ms: int) -> None:
        """A record went to the producer (again, for a resend: the first export time stays)."""
        with self._lock:
            self._in_flight.setdefault(key, export_ms)

    def settled(self, key: int, partition: int | None = None, offset: int | None = None) -> None:
        """A record is acknowledged (with its partition and offset) or given up for good (without)."""
        with self._lock:
            self._in_flight.pop(key, None)
            if partition is not None and partition >= 0:
                p = self._partitions.setdefault(partition, _Partition())
                p.acked += 1
                if offset is not None and offset > p.last_offset:
                    p.last_offset = offset

    def markers(self, node: str, now_ms: int, losses: Losses) -> tuple[list[dict[str, Any]], int]:
        """The markers to send now, one per partition written to (partition -1 before any), and their ``until``.

        Counts go into these markers; :meth:`confirmed` makes them final once Kafka took the
        markers, else the next markers carry them again, over the interval from the last
        confirmed marker.
        """
        with self._lock:
            up_to = min(self._in_flight.values(), default=now_ms)
            up_to = min(up_to, now_ms)
            lost = losses.minus(self._confirmed_losses)
            parts = sorted(self._partitions.items()) or [(-1, _Partition())]
            out = []
            for number, p in parts:
                p.acked_pending = p.acked
                out.append(
                    {
                        "exporterNode": node,
                        "topic": self.topic,
                        "partition": number,
                        "since": self._confirmed_until,
                        "until": now_ms,
                        "upTo": up_to,
                        "recordsAcknowledged": p.acked,
                        "lastOffset": p.last_offset,
                        "eventLosses": lost.event_losses,
                        "connectionsGivenUp": lost.connections_given_up,
                        "recordsGivenUp": lost.records_given_up,
                    }
                )
            return out, now_ms

    def confirmed(self, until: int, losses: Losses) -> None:
        """Kafka acknowledged the markers sent with ``until`` (and ``losses`` as the cumulative counters then)."""
        with self._lock:
            if until <= self._confirmed_until:
                return
            self._confirmed_until = until
            self._confirmed_losses = losses
            for p in self._partitions.values():
                p.acked -= p.acked_pending
                p.acked_pending = 0
