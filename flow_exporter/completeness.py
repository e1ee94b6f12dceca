"""Completeness markers: what lets a windowed job tell complete windows from lossy ones.

A downstream window is complete when every exporter's records with an export time inside it are
in Kafka and nothing the exporters should have reported was lost. Neither is visible in the flow
records themselves, so each exporter sends, every ``markers.interval``, a *round* of
CompletenessMarkers: one per flow-topic partition it has written to
(``schemas/completeness_marker.avsc``, on ``markers.topic``), all built at once:

* ``upTo``: every record of this exporter with an export time before it has been acknowledged by
  Kafka (the smallest export time still unacknowledged, or the round's time when none is), so a
  window ending at or before ``upTo`` has all of this exporter's records in the topic;
* ``since``/``until``: the exporter's wall-clock interval the counts cover, from the ``until`` of
  its previous round (its start, for the first) to when this round was built;
* the losses in it: conntrack events the kernel dropped (overruns), connections given up at the
  cap, records Kafka refused for good (node-wide, the same in every marker of the round); and the
  records acknowledged in this partition, and the partition's highest acknowledged offset (a job
  can check it has read that far).

Rounds are frozen when built, as flow records are, and there is one in flight at a time: a marker
whose delivery failed is sent again as the same bytes, and while a round is not confirmed (every
marker of it acknowledged) no other is built, so counts that arrive meanwhile wait for the next
round, whose interval starts at this one's ``until``. Rebuilding the pending interval instead, at
every tick, put one overlapping marker per tick on the topic after a broker outage, and a consumer
summing them counted the outage's losses and acknowledgements that many times. Now the consumer
rule is as exact as the records': (exporterNode, topic, partition, since) names one marker content,
so drop the duplicates and every count is in exactly one marker left; one exporter's intervals
neither overlap nor repeat.

The README's window rule: a window is *lossy* if a marker interval with losses overlaps it,
*complete* if every exporter has a marker with ``upTo`` at or after its end, else *unconfirmed*.

:class:`Completeness` is the bookkeeping (fed by the expire loop's delivery reports, read when a
round is built); :class:`MarkerRounds` builds, sends, resends and confirms the rounds through a
``produce`` callable, so both run in tests without Kafka; the producer is the runner's.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any

import fastavro

from flow_exporter.flow import Export
from flow_exporter.ports import Reports
from flow_exporter.record import load_schema

__all__ = ["Completeness", "Delivered", "Losses", "MarkerRounds", "Produce", "Round", "encode_marker"]

log = logging.getLogger(__name__)

SCHEMA_FILE = "completeness_marker.avsc"

# produce(value, delivered): hand one encoded marker to Kafka; ``delivered`` is called once for it,
# with None when Kafka acknowledged it or the error text when its delivery failed.
Delivered = Callable[[str | None], None]
Produce = Callable[[bytes, Delivered], None]


@lru_cache(maxsize=1)
def marker_schema() -> Any:
    return fastavro.parse_schema(load_schema(SCHEMA_FILE))


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
    map_full_reads: int = 0  # the Cilium source's polls that found a map at its capacity
    # Not losses, counted alike: connections first met, and the ones of them the sampler kept (RFC 7014's
    # selectorIDTotalFlowsObserved and selectorIDTotalFlowsSelected).
    connections_observed: int = 0
    connections_selected: int = 0
    sampling_changes: int = 0  # adaptive shedding's changes of the probability (each logged)

    def minus(self, other: Losses) -> Losses:
        return Losses(
            self.event_losses - other.event_losses,
            self.connections_given_up - other.connections_given_up,
            self.records_given_up - other.records_given_up,
            self.map_full_reads - other.map_full_reads,
            self.connections_observed - other.connections_observed,
            self.connections_selected - other.connections_selected,
            self.sampling_changes - other.sampling_changes,
        )


@dataclass(frozen=True, slots=True)
class Round:
    """One round of markers as built: sent, and sent again, as exactly these values until all are in Kafka.

    ``losses`` (the cumulative counters when built) and ``acked`` (the acknowledgements counted
    into it, per partition) are what confirming it subtracts, so the next round counts from there.
    """

    since: int
    until: int
    losses: Losses
    acked: tuple[tuple[int, int], ...]  # (partition, recordsAcknowledged) for partitions >= 0
    markers: tuple[dict[str, Any], ...]
    values: tuple[bytes, ...]  # markers[i], encoded


@dataclass
class _Partition:
    acked: int = 0  # acknowledged records not yet in a confirmed round
    last_offset: int = -1


@dataclass
class Completeness:
    """Acknowledged-up-to and per-partition counts, for the markers (thread-safe)."""

    topic: str
    started_ms: int
    _in_flight: dict[int, int] = field(default_factory=dict)  # id(export) -> its export time (ms)
    _partitions: dict[int, _Partition] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _confirmed_until: int = -1  # until of the last round Kafka confirmed (-1: none yet: started_ms)
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
            self._settle(key, partition, offset)

    def _settle(self, key: int, partition: int | None, offset: int | None) -> None:
        self._in_flight.pop(key, None)
        if partition is not None and partition >= 0:
            p = self._partitions.setdefault(partition, _Partition())
            p.acked += 1
            if offset is not None and offset > p.last_offset:
                p.last_offset = offset

    # The DeliveryObserver port (flow_exporter.ports): one call per batch of the loops.
    def produced_all(self, exports: Iterable[Export]) -> None:
        """Records about to go to the producer; one restored from a checkpoint was built before this process."""
        before = self.started_ms - 1
        with self._lock:
            for e in exports:
                self._in_flight.setdefault(id(e), e.export_ms or before)

    def settled_all(self, reports: Reports) -> None:
        """Delivery reports: delivered ones and ones refused for good settle; a record to be resent stays in flight."""
        with self._lock:
            settle = self._settle
            for export, partition, offset in zip(reports.delivered, reports.partitions, reports.offsets, strict=True):
                settle(id(export), partition, offset)
            for r in reports.failed:
                if r.permanent:
                    settle(id(r.export), None, None)

    def build_round(
        self, node: str, now_ms: int, losses: Losses, source: str = "netfilter", sampling_probability: float = 1.0
    ) -> Round:
        """The round to send now: one marker per partition written to (partition -1 before any).

        It covers [since, until) from the last confirmed round's ``until``, with everything counted
        since then; only :meth:`confirmed` moves that start, so building a round changes nothing
        here. ``until`` is at least ``since`` + 1 ms, also if the wall clock stepped back, so each
        round of one exporter run has a ``since`` of its own (the markers' identity).
        """
        with self._lock:
            since = self._confirmed_until
            until = max(now_ms, since + 1)
            up_to = min(min(self._in_flight.values(), default=now_ms), now_ms)
            lost = losses.minus(self._confirmed_losses)
            parts = [(n, p.acked, p.last_offset) for n, p in sorted(self._partitions.items())] or [(-1, 0, -1)]
        markers = tuple(
            {
                "exporterNode": node,
                "topic": self.topic,
                "partition": number,
                "since": since,
                "until": until,
                "upTo": up_to,
                "recordsAcknowledged": acked,
                "lastOffset": last_offset,
                "eventLosses": lost.event_losses,
                "connectionsGivenUp": lost.connections_given_up,
                "recordsGivenUp": lost.records_given_up,
                "source": source,
                "mapFullReads": lost.map_full_reads,
                "samplingProbability": sampling_probability,
                "connectionsObserved": lost.connections_observed,
                "connectionsSelected": lost.connections_selected,
                "samplingChanges": lost.sampling_changes,
            }
            for number, acked, last_offset in parts
        )
        return Round(
            since=since,
            until=until,
            losses=losses,
            acked=tuple((number, acked) for number, acked, _ in parts if number >= 0),
            markers=markers,
            values=tuple(encode_marker(m) for m in markers),
        )

    def confirmed(self, rnd: Round) -> None:
        """Kafka has every marker of ``rnd``: its counts are final, the next round starts at its ``until``.

        Only the round built from the current start can be confirmed; any other (there is none
        while :class:`MarkerRounds` keeps one round in flight) changes nothing, so no count is
        subtracted twice.
        """
        with self._lock:
            if rnd.since != self._confirmed_until:
                return
            self._confirmed_until = rnd.until
            self._confirmed_losses = rnd.losses
            for number, acked in rnd.acked:
                self._partitions[number].acked -= acked


class MarkerRounds:
    """The rounds of one exporter's markers, one in flight at a time (thread-safe, Kafka-free).

    :meth:`tick`, every ``markers.interval`` and once at stop, builds the next round when none is
    in flight, else sends the pending round's failed markers again (the same bytes), else waits:
    a round Kafka has not confirmed yet is never replaced by one covering the same interval.
    """

    def __init__(
        self,
        completeness: Completeness,
        node: str,
        produce: Produce,
        *,
        wall_ms: Callable[[], int],
        losses: Callable[[], Losses],
        source: str = "netfilter",
        sampling_probability: Callable[[], float] = lambda: 1.0,
    ) -> None:
        self._done, self.node, self._produce = completeness, node, produce
        self.source = source  # conntrack.source as chosen: what the markers say the node could not see
        self.sampling_probability = sampling_probability  # for new connections now (it falls while shedding)
        self._wall_ms, self._losses = wall_ms, losses
        # Re-entrant: a delivery report may be served from inside produce (a test double does).
        self._lock = threading.RLock()
        self._round: Round | None = None
        self._unsent: set[int] = set()  # markers of the pending round not in flight: never sent, or failed
        self._acked: set[int] = set()
        self.rounds_built = 0
        self.rounds_confirmed = 0
        self.markers_resent = 0

    @property
    def pending(self) -> Round | None:
        """The round built and not yet confirmed, if any."""
        return self._round

    def tick(self) -> None:
        """The next round if the last one is confirmed; else the pending round's failed markers again."""
        with self._lock:
            if self._round is None:
                self._round = self._done.build_round(
                    self.node, self._wall_ms(), self._losses(), self.source, self.sampling_probability()
                )
                self._unsent = set(range(len(self._round.values)))
                self._acked = set()
                self.rounds_built += 1
            elif self._unsent:
                self.markers_resent += len(self._unsent)
            rnd = self._round
            for i in sorted(self._unsent):
                if self._round is not rnd:
                    break
                self._unsent.discard(i)  # before produce: its report may come at once
                try:
                    self._produce(rnd.values[i], partial(self._delivered, rnd, i))
                except Exception as exc:  # the flow records matter more: never let this stop anything
                    self._unsent.add(i)
                    log.warning("completeness marker not sent: %s (sent again at the next interval)", exc)
                    return

    def _delivered(self, rnd: Round, index: int, error: str | None) -> None:
        with self._lock:
            if rnd is not self._round:
                return
            if error is not None:
                self._unsent.add(index)
                log.warning("completeness marker not delivered: %s (the same marker goes again next interval)", error)
                return
            self._acked.add(index)
            if len(self._acked) == len(rnd.values):
                self._done.confirmed(rnd)
                self._round = None
                self.rounds_confirmed += 1
