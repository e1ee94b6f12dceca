"""Kafka sink and the loops against the real broker, with plain-value connections as input."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import replace
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError
from prometheus_client import generate_latest

from flow_exporter.app import Exporter, ExporterOptions
from flow_exporter.connection import PROTO_TCP, Connection
from flow_exporter.flow import END_OF_FLOW
from flow_exporter.metrics import Metrics
from flow_exporter.ports import BrokerStats, DecodeResult
from flow_exporter.sink import KafkaSink, Route
from flow_exporter.sink.encoder import RecordEncoder, partition_key
from flow_exporter.sink.kafka import client_stats
from flow_exporter.store import ConnectionStore
from flow_exporter.timeouts import Timeouts
from tests.support.fakes import FakeTable
from tests.support.reference import AvroSerializer, build_record

pytestmark = pytest.mark.kafka


START_NS = time.time_ns()


def conn(sport: int, packets: int = 3, state: int = 3) -> Connection:
    return Connection(
        family=socket.AF_INET,
        proto=PROTO_TCP,
        orig_src=bytes([10, 0, 0, 1]),
        orig_dst=bytes([10, 0, 0, 2]),
        orig_sport=sport,
        orig_dport=80,
        reply_src=bytes([10, 0, 0, 2]),
        reply_dst=bytes([10, 0, 0, 1]),
        reply_sport=80,
        reply_dport=sport,
        ct_id=sport,
        tcp_state=state,
        orig_packets=packets,
        orig_bytes=packets * 60,
        reply_packets=packets,
        reply_bytes=packets * 90,
        start_ns=START_NS,
    )


def consume(bootstrap: str, topic: str, n: int, timeout: float = 20.0) -> list[Any]:
    """At least ``n`` messages (if they come), and everything that follows within a quiet second."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g{time.time_ns()}", "auto.offset.reset": "earliest"})
    c.subscribe([topic])
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            m = c.poll(1.0)
            if m is None:
                if len(out) >= n:
                    break
                continue
            if m.error() is None:
                out.append(m)
    finally:
        c.close()
    return out


def test_partition_key_is_direction_independent() -> None:
    store = ConnectionStore()
    a = conn(40000)
    b = replace(
        a,
        orig_src=a.reply_src,
        orig_dst=a.orig_src,
        orig_sport=80,
        orig_dport=40000,
        reply_src=a.orig_src,
        reply_dst=a.reply_src,
        reply_sport=40000,
        reply_dport=80,
    )
    store.update([a, b], 0.0, 0)
    e1, e2 = store.export_all(0.0)
    assert partition_key(e1) == partition_key(e2)
    # The layout README "Message key" documents, rebuilt from the record's own fields.
    rec = build_record(e1, "n", 0)
    ends = sorted(
        (ipaddress.ip_address(rec[f"{side}Address"]).packed, rec[f"{side}Port"]) for side in ("source", "destination")
    )
    expected = bytes([rec["protocol"]]) + b"".join(addr + port.to_bytes(2, "big") for addr, port in ends)
    assert partition_key(e1) == expected and len(expected) == (13 if rec["ipVersion"] == 4 else 37)


def test_routes_and_delivery_reports(kafka_broker: Any) -> None:
    main_topic, ended_topic = f"main-{time.time_ns()}", f"ended-{time.time_ns()}"
    kafka_broker.create_topic(main_topic)
    kafka_broker.create_topic(ended_topic)
    ser = AvroSerializer()
    sink = KafkaSink(
        {"bootstrap.servers": kafka_broker.bootstrap},
        main_topic,
        RecordEncoder("n1").encode,
        [Route(ended_topic, end_reason=END_OF_FLOW)],
    )
    assert sink.unusable_topics() == {}
    store = ConnectionStore()
    store.update([conn(1), conn(2), conn(3, state=7)], 0.0, time.time_ns())
    exports = store.expire(100.0, time.time_ns())
    assert len(exports) == 3
    for e in exports:
        sink.send(e, 0)
    assert sink.flush(20) == 0
    reports = sink.take_reports()
    assert len(reports) == 3 and all(r.delivered for r in reports)
    assert sink.counters.acked == 3 and sink.counters.failed == 0 and sink.in_flight() == 0
    ended = consume(kafka_broker.bootstrap, ended_topic, 1)
    main = consume(kafka_broker.bootstrap, main_topic, 2)
    assert [ser.decode(m.value())["flowEndReason"] for m in ended] == [END_OF_FLOW]
    assert len(main) == 2
    assert {m.key() for m in main} == {partition_key(e) for e in exports if e.reason != END_OF_FLOW}


def test_client_statistics_reach_the_metrics(kafka_broker: Any) -> None:
    topic = f"stats-{time.time_ns()}"
    kafka_broker.create_topic(topic)
    sink = KafkaSink(
        {"bootstrap.servers": kafka_broker.bootstrap, "statistics.interval.ms": 100}, topic, RecordEncoder("n1").encode
    )
    store = ConnectionStore()
    store.update([conn(1)], 0.0, time.time_ns())
    for e in store.expire(100.0, time.time_ns()):
        sink.send(e, 0)
    assert sink.flush(20) == 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the next statistics after the delivery
        sink.poll(0.2)
        client = sink.counters.client
        if client is not None and client.brokers and client.queue_messages == 0:
            break
    client = sink.counters.client
    assert client is not None and client.queue_messages == 0 and client.queue_bytes == 0
    [broker] = client.brokers  # the one broker of the test cluster, under its advertised name
    assert broker.name.startswith("127.0.0.1:") and broker.request_errors == 0 and broker.disconnects == 0
    assert broker.requests > 0 and 0 < broker.rtt_seconds < 5  # a produce and metadata requests: not a count we set
    metrics = Metrics()
    exp = Exporter(FakeTable(), sink, ExporterOptions(timeouts=Timeouts(), node_name="n1"))
    metrics.bind(exp.readings)
    text = generate_latest(metrics.registry).decode()
    assert f'flow_exporter_kafka_broker_requests_total{{broker="{broker.name}"}}' in text
    assert "flow_exporter_kafka_queue_messages 0.0" in text


def test_a_fatal_producer_error_is_kept_for_the_loops() -> None:
    """librdkafka's error_cb with a fatal error (e.g. an idempotence epoch error) marks the sink failed."""
    sink = KafkaSink({"bootstrap.servers": "127.0.0.1:9", "log_level": 0}, "t", RecordEncoder("n1").encode)
    on_error = sink.config["error_cb"]  # the callback librdkafka calls
    on_error(KafkaError(KafkaError._TRANSPORT, "brokers down"))
    assert sink.counters.fatal is None  # transient: retried, still ready once the broker answers
    on_error(KafkaError(KafkaError._FENCED, "producer fenced", fatal=True))
    assert sink.counters.fatal == "producer fenced"


def test_client_statistics_parse_librdkafka_documents() -> None:
    doc = {
        "msg_cnt": 7, "msg_size": 900,
        "brokers": {
            "b1:9092/1": {"nodeid": 1, "nodename": "b1:9092", "rtt": {"avg": 2500}, "tx": 40, "txerrs": 1,
                          "txretries": 2, "req_timeouts": 3, "disconnects": 4},
            "GroupCoordinator": {"nodeid": -1, "nodename": "b1:9092", "tx": 99},
        },
    }  # fmt: skip
    c = client_stats(doc)
    assert (c.queue_messages, c.queue_bytes) == (7, 900)
    assert c.brokers == (BrokerStats("b1:9092", 0.0025, 40, 1, 2, 3, 4),)


def test_missing_topic_is_reported(kafka_broker: Any) -> None:
    sink = KafkaSink(
        {"bootstrap.servers": kafka_broker.bootstrap, "allow.auto.create.topics": False},
        "does-not-exist",
        RecordEncoder("n1").encode,
    )
    assert sink.unusable_topics() == {"does-not-exist": "missing"}


class ListSource:
    """A source that replays given dumps (the loops are under test, not conntrack)."""

    def __init__(self, dumps: list[list[Connection]]) -> None:
        self.dumps = dumps
        self.calls = 0

    skipped = 0

    def dump_buffers(self, apply: Callable[[memoryview], DecodeResult], zones: Collection[int] | None = None) -> None:
        return None  # no netlink bytes: the exporter uses dump_into

    def dump_into(self, consume: Callable[[list[Connection]], None], zones: Collection[int] | None = None) -> int:
        d = self.dumps[min(self.calls, len(self.dumps) - 1)]
        self.calls += 1
        consume(d)
        return len(d)

    def count(self) -> int:
        return 0

    def max_entries(self) -> int:
        return 0

    def kernel_stats(self) -> dict[str, int]:
        return {}


def test_loops_export_and_shutdown_flushes_forced_records(kafka_broker: Any) -> None:
    topic = f"loops-{time.time_ns()}"
    kafka_broker.create_topic(topic)
    ser = AvroSerializer()
    sink = KafkaSink({"bootstrap.servers": kafka_broker.bootstrap}, topic, RecordEncoder("n1").encode)
    source = ListSource([[conn(i, packets=1) for i in range(1, 51)], [conn(i, packets=2) for i in range(1, 51)]])
    exp = Exporter(source, sink, ExporterOptions(timeouts=Timeouts(0.2, 0.5, 5.0), node_name="n1", grace=10.0))
    t = threading.Thread(target=exp.run)
    t.start()
    time.sleep(1.5)
    exp.stop_event.set()
    t.join(15)
    assert not t.is_alive()
    assert exp.outcome.lost == 0
    msgs = consume(kafka_broker.bootstrap, topic, 100)
    recs = [ser.decode(m.value()) for m in msgs]
    by_conn: dict[int, list[dict]] = {}
    for r in recs:
        by_conn.setdefault(r["connectionId"], []).append(r)
    assert len(by_conn) == 50
    for rs in by_conn.values():
        rs.sort(key=lambda r: r["sequence"])
        assert [r["sequence"] for r in rs] == list(range(len(rs)))
        assert rs[-1]["flowEndReason"] == 4
        assert sum(r["packetDeltaCount"] for r in rs) == rs[-1]["packetTotalCount"] == 2
