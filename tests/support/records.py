"""Flow records as a consumer reads them from Kafka: decoded with the reference Apache ``avro`` package.

(Not fastavro, which the exporter writes with.)
"""

from __future__ import annotations

import functools
import io
import time
from collections import defaultdict
from typing import Any

import avro.io
import avro.schema
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from flow_exporter.record import schema_path


def read_records(
    bootstrap: str, topic: str, expect_at_least: int = 1, timeout: float = 30.0, *, framed: bool = False
) -> list[dict]:
    """Every record on the topic, decoded with the reference avro implementation.

    ``framed``: every value must carry the Confluent header (magic 0, 4-byte id), which is skipped.
    """
    schema = avro.schema.parse(schema_path().read_text())
    reader = avro.io.DatumReader(schema)
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"t-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    out: list[dict] = []
    deadline = time.monotonic() + timeout
    idle_since = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                if len(out) >= expect_at_least:
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since > 3:
                        break
                continue
            idle_since = None
            assert msg.error() is None, msg.error()
            value = msg.value()
            if framed:
                assert value[:1] == b"\x00", value[:8]
                value = value[5:]
            out.append(reader.read(avro.io.BinaryDecoder(io.BytesIO(value))))
    finally:
        consumer.close()
    return out


def by_connection(records: list[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for r in records:
        groups[r["connectionId"]].append(r)
    for recs in groups.values():
        recs.sort(key=lambda r: r["sequence"])
    return groups


def read_raw_records(bootstrap: str, topic: str, timeout: float = 60.0) -> list[tuple[int, int, bytes]]:
    """Every record on the topic as (partition, offset, value bytes), read up to each partition's high watermark
    as it stood when reading began: an exact end, not a wait for silence (duplicates would fool a count)."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"t-{time.time_ns()}", "enable.auto.commit": False}
    )
    try:
        meta = consumer.list_topics(topic, timeout=timeout)
        parts = sorted(meta.topics[topic].partitions)
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout)[1] for p in parts}
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
        out: list[tuple[int, int, bytes]] = []
        left = {p for p, end in ends.items() if end > 0}
        deadline = time.monotonic() + timeout
        while left:
            assert time.monotonic() < deadline, f"partitions {sorted(left)} not read to their end in {timeout}s"
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            p, offset = msg.partition(), msg.offset()
            if offset < ends[p]:
                out.append((p, offset, msg.value()))
            if offset + 1 >= ends[p]:
                left.discard(p)
        return out
    finally:
        consumer.close()


@functools.cache
def _reader() -> avro.io.DatumReader:
    return avro.io.DatumReader(avro.schema.parse(schema_path().read_text()))


def decode(value: bytes) -> dict:
    """One record value decoded with the reference avro implementation."""
    return _reader().read(avro.io.BinaryDecoder(io.BytesIO(value)))


def read_until_quiet(bootstrap: str, topic: str, schema: Any) -> list[tuple[int, int, dict[str, Any]]]:
    """(partition, offset, value) of every bare-Avro message on ``topic``, decoded with the parsed fastavro
    ``schema``: read until 3 s pass without one (the first may wait up to 20 s for a group join)."""
    import fastavro

    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"q{time.time_ns()}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    out: list[tuple[int, int, dict[str, Any]]] = []
    idle = time.monotonic() + 20
    try:
        while time.monotonic() - idle < 3:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            out.append(
                (msg.partition(), msg.offset(), fastavro.schemaless_reader(io.BytesIO(msg.value()), schema, schema))
            )
            idle = time.monotonic()
    finally:
        consumer.close()
    return out
