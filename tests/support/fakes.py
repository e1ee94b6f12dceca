"""In-memory adapters for the loops' ports: a conntrack table and a broker, driven by hand.

They implement :class:`flow_exporter.ports.Source` and :class:`flow_exporter.ports.Sink`, so the
poll and expire loops run in unit tests exactly as they run against netlink and librdkafka, with
no thread, no broker and a fake clock. The fake broker keeps what it accepted, in order, as the
bytes the exporter encoded, so a test can decode it independently.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from flow_exporter.connection import Connection
from flow_exporter.flow import Export
from flow_exporter.ports import DecodeResult, DeliveryReport, Reports, SinkCounters, Unsent


class FakeTable:
    """A conntrack table: set ``entries``; ``fail`` holds errors the next dumps raise, in order."""

    def __init__(self, batch: int = 2) -> None:
        self.entries: list[Connection] = []
        self.fail: list[BaseException] = []
        self.skipped = 0
        self.batch = batch
        self.dumps = 0
        self.stats: dict[str, int] = {}  # what kernel_stats() reports

    def dump_buffers(self, apply: Callable[[memoryview], DecodeResult], zones: Collection[int] | None = None) -> None:
        return None  # no netlink bytes: the exporter uses dump_into

    def dump_into(self, consume: Callable[[list[Connection]], None], zones: Collection[int] | None = None) -> int:
        self.dumps += 1
        if self.fail:
            raise self.fail.pop(0)
        rows = [c for c in self.entries if zones is None or c.zone in zones]
        for i in range(0, len(rows), self.batch):
            consume(rows[i : i + self.batch])
        return len(rows)

    def count(self) -> int:
        return len(self.entries)

    def max_entries(self) -> int:
        return 262_144

    def kernel_stats(self) -> dict[str, int]:
        return dict(self.stats)


@dataclass
class Accepted:
    """One record the fake broker took."""

    topic: str
    key: bytes
    value: bytes
    flow_id: int
    sequence: int


@dataclass
class FakeBroker:
    """A sink whose broker answers as told: ``mode`` is "up", "down" (transient failure) or "refuse" (for good).

    Produced records wait in flight until ``poll`` or ``flush`` answers them, as librdkafka's
    delivery callbacks only run there.
    """

    encode: Callable[[Export, int], bytes]
    topic: str = "flows"
    mode: str = "up"
    accepted: list[Accepted] = field(default_factory=list)
    counters: SinkCounters = field(default_factory=SinkCounters)
    queued: list[Export] = field(default_factory=list)
    purged: int = 0
    peak_in_flight: int = 0  # the most records produced and not yet answered at any time
    _reports: Reports = field(default_factory=Reports)

    def prepare_all(self, exports: list[Export], export_ms: int) -> list[tuple[Export, Exception]]:
        failures: list[tuple[Export, Exception]] = []
        for export in exports:
            if export.value is None:
                try:
                    export.value = self.encode(export, export_ms)
                except Exception as exc:
                    failures.append((export, exc))
                    continue
                export.topic = self.topic
                export.key = export.flow_id.to_bytes(8, "big", signed=True)
        return failures

    def produce(self, export: Export) -> None:
        assert export.value is not None, "produce() before prepare()"
        self.queued.append(export)
        self.peak_in_flight = max(self.peak_in_flight, len(self.queued))
        self.counters.produced += 1
        self.counters.bytes_produced += len(export.value)

    def produce_all(self, exports: list[Export]) -> None:
        for i, e in enumerate(exports):
            try:
                self.produce(e)
            except Exception as exc:
                raise Unsent(i) from exc

    def _answer(self) -> int:
        n = len(self.queued)
        for e in self.queued:
            if self.mode == "up":
                assert e.value is not None and e.topic is not None and e.key is not None
                self.accepted.append(Accepted(e.topic, e.key, e.value, e.flow_id, e.sequence))
                self.counters.acked += 1
                self.counters.connected = True
                self._reports.add_delivered(e)
            else:
                self.counters.failed += 1
                self._reports.failed.append(DeliveryReport(e, False, f"broker {self.mode}", self.mode == "refuse"))
        self.queued.clear()
        return n

    def poll(self, timeout: float) -> int:
        return self._answer()

    def flush(self, timeout: float) -> int:
        self._answer()
        return 0

    def purge(self) -> None:
        for e in self.queued:
            self.purged += 1
            self.counters.failed += 1
            self._reports.failed.append(DeliveryReport(e, False, "purged"))
        self.queued.clear()

    def in_flight(self) -> int:
        return len(self.queued)

    def take_reports(self) -> Reports:
        taken, self._reports = self._reports, Reports()
        return taken


@dataclass
class NewFlow:
    """What the store hands enrichment for a new connection (``flow.NewConnection``), held by a test."""

    conn: Connection
    meta: dict[str, Any] | None = None
    settled: bool = False
