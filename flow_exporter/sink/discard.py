"""The sink of an exporter with flow export off (``export.flows: false``): records are settled unsent.

With only the health stream wanted, connections are still tracked (the dump gives the table's
fill per zone, the poll time is measured, events are counted) and the store still builds its
records, because building them is how it lets ended connections go. This sink reports each one
delivered at once, without encoding or sending anything, so the store runs exactly as with Kafka.
"""

from __future__ import annotations

from flow_exporter.flow import Export
from flow_exporter.ports import Reports, SinkCounters


class DiscardSink:
    """A :class:`~flow_exporter.ports.Sink` that drops every record and reports it delivered."""

    def __init__(self) -> None:
        self.counters = SinkCounters(connected=True)  # nothing to reach: never the reason for not ready
        self.discarded = 0
        self._reports = Reports()

    def prepare_all(self, exports: list[Export], export_ms: int) -> list[tuple[Export, Exception]]:
        return []

    def produce(self, export: Export) -> None:
        self.discarded += 1
        self._reports.add_delivered(export)

    def produce_all(self, exports: list[Export]) -> None:
        for e in exports:
            self.produce(e)

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        return 0

    def purge(self) -> None:
        pass

    def in_flight(self) -> int:
        return 0

    def take_reports(self) -> Reports:
        reports, self._reports = self._reports, Reports()
        return reports
