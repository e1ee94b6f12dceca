"""The side streams beside the flows: ConntrackHealth records and completeness markers, each on a producer of its own.

Low-rate streams get their own librdkafka producer (the flows' connection settings, not their
queue), so a full flow queue never delays a health record or a marker, and a marker's delivery
report is its own. Each stream owns its thread and its producer; ``stop`` sends the last one and
flushes, so a stopped node's final state is on its topic.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import Producer

from flow_exporter.completeness import Completeness, Delivered, Losses, MarkerRounds
from flow_exporter.conntrack_health import HealthReporter
from flow_exporter.readings import Readings

log = logging.getLogger("flow_exporter.sink.streams")


def side_producer(producer_config: Mapping[str, Any]) -> Any:
    """A producer of its own for a low-rate side stream: the flows' settings, not their queue."""
    return Producer({"logger": logging.getLogger("flow_exporter.rdkafka"), **producer_config})


class HealthStream:
    """A :class:`HealthReporter` and the Kafka producer it writes with."""

    def __init__(
        self,
        producer_config: Mapping[str, Any],
        read: Callable[[], Readings],
        topic: str,
        *,
        node: str,
        interval: float,
        flows: bool,
    ) -> None:
        self._producer = side_producer(producer_config)
        self.topic = topic

        def produce(key: bytes, value: bytes) -> None:
            self._producer.produce(topic, value, key, on_delivery=self._delivered)
            self._producer.poll(0)

        self.reporter = HealthReporter(read, produce, node=node, interval=interval, flows=flows).start()
        log.info("health stream: a ConntrackHealth record every %.0fs to %s", interval, topic)

    @staticmethod
    def _delivered(err: Any, msg: Any) -> None:
        if err is not None:
            log.warning("health record not delivered to %s: %s", msg.topic(), err)

    def stop(self) -> None:
        self.reporter.stop()
        self.reporter.send_once()  # the last readings, so a stopped node's final state is on the topic
        self._producer.flush(5)


class MarkerStream:
    """Completeness markers (flow_exporter.completeness) every ``interval`` seconds.

    :class:`MarkerRounds` decides what goes: one round in flight at a time, a failed marker sent
    again as the same bytes, so no count is in two markers and none is dropped with a lost one.
    """

    def __init__(
        self,
        producer_config: Mapping[str, Any],
        read: Callable[[], Readings],
        completeness: Completeness,
        topic: str,
        *,
        node: str,
        interval: float,
    ) -> None:
        self._producer = side_producer(producer_config)
        self.topic, self.node, self.interval = topic, node, interval
        self._read = read
        key = node.encode()

        def produce(value: bytes, delivered: Delivered) -> None:
            def report(err: Any, _msg: Any) -> None:
                delivered(None if err is None else str(err))

            self._producer.produce(topic, value, key, on_delivery=report)

        self.rounds = MarkerRounds(
            completeness,
            node,
            produce,
            wall_ms=lambda: time.time_ns() // 1_000_000,
            losses=self._losses,
            source=read().source,
            sampling_probability=lambda: read().sampling_probability,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="markers", daemon=True)
        self._thread.start()
        log.info("completeness markers every %.0fs to %s", interval, topic)

    def _losses(self) -> Losses:
        r = self._read()
        return Losses(
            r.event_losses,
            sum(r.given_up.values()),
            r.records_given_up,
            r.conntrack_kernel.get("cilium_full_reads", 0),
            r.connections_added + r.connections_sampled_out,
            r.connections_added,
            r.sampling_changes,
        )

    def send_round(self) -> None:
        self.rounds.tick()
        self._producer.poll(0)

    def _run(self) -> None:
        due = time.monotonic() + self.interval
        while not self._stop.wait(min(0.2, self.interval)):
            self._producer.poll(0)  # delivery reports: a confirmed round lets the next one be built
            if time.monotonic() >= due:
                due += self.interval
                self.send_round()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        deadline = time.monotonic() + 5  # the same 5 s as one flush: a broker that is gone costs no more
        self._producer.flush(5)  # the round in flight first: the final one starts where it ends
        self.send_round()  # after the last flush: what this process sent, confirmed up to now
        self._producer.flush(max(deadline - time.monotonic(), 0))
