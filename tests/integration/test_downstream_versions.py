"""Both downstream jobs read a topic holding records of an older schema version beside current ones.

After an exporter upgrade the topic still holds records written before a field was added
(here: communityId and reporter). With the registry, each value names its writer schema, and
the jobs' reader schemas (the current file's fields, with their defaults) must resolve them all.
"""

from __future__ import annotations

import io
import json
import time
import uuid
from pathlib import Path

import fastavro
import pytest
from confluent_kafka import Producer

from devtools.kafka import KafkaBroker
from devtools.registry import RegistryServer
from flow_exporter.record import schema_path
from tests.support.downstream import run_flink, run_spark, synthetic_record

pytestmark = [pytest.mark.kafka, pytest.mark.spark]

ADDED_SINCE = ("communityId", "reporter")


@pytest.mark.parametrize("job", ["spark", "flink"])
def test_older_writer_versions_resolve(kafka_broker: KafkaBroker, tmp_path: Path, job: str) -> None:
    current = json.loads(schema_path().read_text())
    older = dict(current, fields=[f for f in current["fields"] if f["name"] not in ADDED_SINCE])
    topic = f"versions-{uuid.uuid4().hex[:8]}"
    kafka_broker.create_topic(topic)
    with RegistryServer() as registry:
        old_id = registry.register(f"{topic}-value", json.dumps(older))
        new_id = registry.register(f"{topic}-value", json.dumps(current))
        assert old_id != new_id
        now_ms = time.time_ns() // 1_000_000
        producer = Producer({"bootstrap.servers": kafka_broker.bootstrap})
        expected = {}
        for i, (schema, sid) in enumerate([(older, old_id), (current, new_id), (older, old_id)]):
            rec = synthetic_record(40100 + i, ("ns", "a"), ("ns", "b"), None, now_ms, (i + 1, 100 * (i + 1), 2, 20))
            rec = {f["name"]: rec.get(f["name"], f.get("default")) for f in schema["fields"]}
            if schema is current:
                rec.update(communityId="1:test", reporter=1)
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), rec)
            producer.produce(topic, b"\x00" + sid.to_bytes(4, "big") + buf.getvalue())
            expected[rec["sourcePort"]] = (i + 1 + 2, 100 * (i + 1) + 20)
        # Spark emits a window once a later record moves the watermark past it: one an hour ahead.
        clock = synthetic_record(40199, ("t", "c"), ("t", "c"), None, now_ms + 3_600_000, (1, 1, 0, 0))
        clock.update(communityId="", reporter=0)
        buf = io.BytesIO()
        fastavro.schemaless_writer(buf, fastavro.parse_schema(current), clock)
        producer.produce(topic, b"\x00" + new_id.to_bytes(4, "big") + buf.getvalue())
        assert producer.flush(30) == 0
        run = (run_spark if job == "spark" else run_flink)(
            kafka_broker.bootstrap,
            topic,
            tmp_path,
            "--schema-registry",
            registry.url,
            **({"min_batches": 1} if job == "spark" else {}),
        )
    got = {r["sourcePort"]: (r["packets"], r["bytes"]) for r in run.connections if r["sourcePort"] in expected}
    assert got == expected
    windows = [r for r in run.windows if r["source"] == "ns/a"]
    assert sum(r["packets"] for r in windows) == sum(p for p, _ in expected.values())
